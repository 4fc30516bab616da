"""The benchmark driver: plan the gangs, run them one at a time, write the report.

The driver never imports a Keras backend. It measures the machine's link bandwidth, then runs
one gang after another through the launcher's `Gang` (never two at once: they would share the
cores), each with `KERAS_BACKEND`, `OMP_NUM_THREADS` = cores ÷ workers (and XLA's single-thread
flag for one-thread JAX workers) and a deadline; the single process gets the threads of one of
the N workers (see `keras_mwms.benchmark.analysis`). Per backend:

* one process (`keras_mwms` role): keras_mwms on one worker, and the native peers without a
  strategy, on the global batch and on one worker's share of it;
* N workers (`keras_mwms` role): keras_mwms fit, the peers that can share its processes (JAX
  DataParallel, torch DDP), the all-reduce sweep and the gradient-size all-reduce;
* TensorFlow only, N workers (`tensorflow_native` role): Keras 3 and tf-keras on a plain
  `tf.distribute.MultiWorkerMirroredStrategy`;
* a scaling sweep's further counts (`scaling` role, `--workers 2,3,4`): keras_mwms alone, and
  then every process gets cores ÷ the largest count threads (`keras_mwms.benchmark.scaling`).

A failed or timed-out gang is reported (with its log's tail) and the others still run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from keras_mwms.benchmark import analysis, bandwidth, report, scaling, torch_variants
from keras_mwms.benchmark.config import BenchmarkConfig
from keras_mwms.benchmark.timing import LAUNCHED_AT_ENV
from keras_mwms.benchmark.worker import THREADS_ENV
from keras_mwms.devices import threads_per_worker
from keras_mwms.launch import Gang

REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class GangPlan:
    """One gang to run: a backend, its worker count and the worker role."""

    backend: str
    workers: int
    role: str

    @property
    def name(self) -> str:
        return f"{self.backend}-{self.workers}w-{self.role}"


def plan(config: BenchmarkConfig) -> list[GangPlan]:
    """The gangs a config needs, in run order.

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> [gang.name for gang in plan(quick_config(backends=("tensorflow", "torch")))]
    ['tensorflow-1w-keras_mwms', 'tensorflow-2w-keras_mwms', 'tensorflow-2w-tensorflow_native', 'torch-1w-keras_mwms', 'torch-2w-keras_mwms']
    >>> [gang.name for gang in plan(quick_config(backends=("jax",), sections=("allreduce",)))]
    ['jax-2w-keras_mwms']
    >>> [gang.name for gang in plan(quick_config(backends=("torch",), scaling_workers=(3, 4)))]
    ['torch-1w-keras_mwms', 'torch-2w-keras_mwms', 'torch-3w-scaling', 'torch-4w-scaling']
    """
    gangs = []
    fit = "fit" in config.sections
    for backend in config.backends:
        if fit:
            gangs.append(GangPlan(backend, 1, "keras_mwms"))
        gangs.append(GangPlan(backend, config.workers, "keras_mwms"))
        if fit and backend == "tensorflow":
            gangs.append(GangPlan(backend, config.workers, "tensorflow_native"))
        if torch_variants.nightly_gang_wanted(config, backend):
            gangs.append(GangPlan(backend, config.workers, torch_variants.NIGHTLY_ROLE))
        gangs += [GangPlan(backend, count, scaling.ROLE) for count in config.scaling_workers]
    return gangs


def gang_environment(backend: str, threads: int) -> dict[str, str]:
    """The variables every worker of a gang gets: the backend and `threads` compute threads."""
    env = {
        "KERAS_BACKEND": backend,
        "OMP_NUM_THREADS": str(threads),
        THREADS_ENV: str(threads),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_MWMS_RENDEZVOUS_TIMEOUT": "120",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")])),
    }
    if backend == "jax" and threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1".strip()
    return env


def gang_log_path(out_dir: Path, gang_plan: GangPlan) -> Path:
    """Where a gang's prefixed worker output goes (named in the progress lines)."""
    return out_dir / "logs" / f"{gang_plan.name}.log"


def run_gang(gang_plan: GangPlan, config_path: Path, out_dir: Path, timeout: float, threads: int) -> dict:
    """Runs one gang to completion or deadline; returns its record with every worker's result."""
    prefix = out_dir / "raw" / gang_plan.name
    log_path = gang_log_path(out_dir, gang_plan)
    for stale in prefix.parent.glob(f"{prefix.name}.worker*.json"):
        stale.unlink()
    command = [sys.executable, "-u", "-m", "keras_mwms.benchmark.worker", str(config_path), gang_plan.role,
               str(prefix)]
    env = gang_environment(gang_plan.backend, threads)
    if gang_plan.role == torch_variants.NIGHTLY_ROLE:   # keras-nightly first on the path
        env["PYTHONPATH"] = os.pathsep.join([str(torch_variants.NIGHTLY_OVERLAY), env["PYTHONPATH"]])
        env["KERAS_MWMS_ALLOW_UNTESTED_KERAS"] = "1"
    env[LAUNCHED_AT_ENV] = repr(time.time())
    gang = Gang(command, gang_plan.workers, grace_period=5.0, extra_env=env)
    record = {"name": gang_plan.name, "backend": gang_plan.backend, "workers": gang_plan.workers,
              "role": gang_plan.role, "ok": False, "error": None, "results": []}
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            gang.start(log)
            try:
                code, index = gang.wait(timeout=timeout)
                if code != 0:
                    record["error"] = f"worker {index} failed with exit code {code}"
            except TimeoutError:
                record["error"] = f"did not finish within {timeout:.0f} s"
        finally:
            gang.stop()
    record["seconds"] = time.monotonic() - started
    for index in range(gang_plan.workers):
        path = prefix.parent / f"{prefix.name}.worker{index}.json"
        if path.exists():
            record["results"].append(json.loads(path.read_text()))
    if record["error"] is None and len(record["results"]) != gang_plan.workers:
        record["error"] = f"{len(record['results'])} of {gang_plan.workers} workers wrote results"
    record["ok"] = record["error"] is None
    if not record["ok"]:
        tail = log_path.read_text().splitlines()[-30:]
        record["log_tail"] = tail
    return record


def describe_machine() -> dict:
    """Cores, CPU model, memory, OS, Python, the date, and the load at the start."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    memory_kib = next((int(line.split()[1]) for line in _read_lines("/proc/meminfo")
                       if line.startswith("MemTotal")), 0)
    cores = os.cpu_count() or 1
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {
        "cores": cores, "cpu": cpu, "memory_gib": round(memory_kib / 1024**2, 1),
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        "date": date, "load_average_at_start": list(os.getloadavg()),
        "description": f"{cores} cores ({cpu}), {memory_kib / 1024**2:.0f} GiB, {date}",
    }


def _read_lines(path: str) -> list[str]:
    try:
        with open(path) as file:
            return file.readlines()
    except OSError:
        return []


def say(message: str) -> None:
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)


def run(config: BenchmarkConfig, out_dir: Path) -> dict:
    """Runs every planned gang and returns the report (also written to `out_dir`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "raw").mkdir(exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    config_path = out_dir / "config.json"
    config_path.write_text(config.to_json())
    machine = describe_machine()
    say(f"machine: {machine['description']}; load average {machine['load_average_at_start']}")
    machine.update(bandwidth.measure_machine(tcp_bytes=64 * 1024**2 if config.quick else 256 * 1024**2))
    say(f"loopback TCP {machine['loopback_tcp_bytes_per_second'] / 1e9:.2f} GB/s, "
        f"memcpy {machine['memcpy_bytes_per_second'] / 1e9:.2f} GB/s")
    gangs = []
    threads = threads_per_worker(max(scaling.worker_counts(config)))
    gang_plans = plan(config)
    notes = []
    if ("torch" in config.backends and "fit" in config.sections and not config.quick
            and torch_variants.nightly_overlay() is None):
        notes.append(torch_variants.NIGHTLY_MISSING)
        say(torch_variants.NIGHTLY_MISSING)
    run_started = time.monotonic()
    for number, gang_plan in enumerate(gang_plans, 1):
        progress, log_path = f"[{number}/{len(gang_plans)}]", gang_log_path(out_dir, gang_plan)
        say(f"{progress} running {gang_plan.name} ({threads} thread(s) per process; its output: {log_path})")
        record = run_gang(gang_plan, config_path, out_dir, config.gang_timeout, threads)
        gangs.append(record)
        state = "ok" if record["ok"] else f"FAILED: {record['error']} (log: {log_path})"
        say(f"{progress} {gang_plan.name}: {state} in {record['seconds']:.0f} s "
            f"({time.monotonic() - run_started:.0f} s so far)")
    machine["load_average_at_end"] = list(os.getloadavg())
    fits = analysis.fit_rows(gangs)
    allreduce = analysis.allreduce_tables(gangs, machine["loopback_tcp_bytes_per_second"])
    overhead = analysis.overhead_rows(fits, allreduce, config.workers)
    result = {
        "machine": machine,
        "config": json.loads(config.to_json()),
        "threads_per_process": threads,
        "versions": _versions(gangs),
        "allreduce": allreduce,
        "fits": fits,
        "ratios": analysis.ratio_rows(fits, overhead),
        "one_process": analysis.one_process_rows(fits),
        "overhead": overhead,
        "ledger": analysis.ledger_rows(fits),
        "scaling": scaling.analyse(gangs, fits, config, machine, threads),
        "gangs": [{key: value for key, value in gang.items() if key != "results"} for gang in gangs],
        "notes": notes,
        "definitions": analysis.__doc__,
        "link_probe": bandwidth.__doc__,
    }
    report.write_json(result, out_dir)
    if fits or allreduce:
        report.write_plot(result, out_dir)
    scaling.write_plot(result["scaling"], machine["description"], out_dir)
    return result


def _versions(gangs: list[dict]) -> dict[str, str]:
    found: dict[str, str] = {}
    for gang in gangs:
        for result in gang.get("results", []):
            found.update(result.get("versions", {}))
    return found


def render(result: dict) -> str:
    """Every table of the report, as printed on stdout."""
    machine, config = result["machine"], result["config"]
    link_gbps = machine["loopback_tcp_bytes_per_second"] / 1e9
    parts = [
        f"keras_mwms benchmark — {machine['description']}",
        f"load average at start {machine['load_average_at_start']}, at end "
        f"{machine.get('load_average_at_end')}; {result['threads_per_process']} compute thread(s) per "
        f"process (cores ÷ N workers, also for the single process); versions {result['versions']}",
        f"link: loopback TCP {link_gbps:.2f} GB/s ({machine['loopback_tcp_probe']}); memcpy "
        f"{machine['memcpy_bytes_per_second'] / 1e9:.2f} GB/s",
    ]
    for backend, rows in result["allreduce"].items():
        parts.append(report.allreduce_text(backend, rows, config["workers"], link_gbps))
    if result["fits"]:
        model = f"MLP {config['features']}→{config['depth']}×{config['width']}→{config['classes']}"
        parts.append(f"models: mlp = {model}; conv = Conv16-Conv32-GAP-Dense on "
                     f"{config['image_size']}²×3; Adam, {config['steps']} steps "
                     f"({config['warmup_steps']} warm-up), best of {config['repeats']}")
        parts.append(report.fits_text(result["fits"], config["global_batch"]))
    if result["overhead"]:
        parts.append(report.overhead_text(result["overhead"]))
    if result["ratios"]:
        parts.append(report.ratios_text(result["ratios"]))
    if result.get("one_process"):
        parts.append(report.one_process_text(result["one_process"]))
    if result.get("ledger"):
        parts.append(report.ledger_text(result["ledger"]))
    if result.get("scaling", {}).get("engines"):
        parts.append(scaling.text(result["scaling"]))
    parts += result.get("notes", [])
    for gang in result["gangs"]:
        if not gang["ok"]:
            parts.append(f"FAILED gang {gang['name']}: {gang['error']}\n  " + "\n  ".join(gang.get("log_tail", [])))
    return "\n\n".join(parts)
