#!/usr/bin/env python3
"""keras_mwms on GPUs: one prepared check for a machine with GPUs, no network, no TensorFlow.

The machine needs a Python with torch and/or JAX built for CUDA and numpy, h5py and ml-dtypes;
Keras and the pure-Python packages it imports come from a bundle of wheels prepared here
(nothing is installed from the network, nothing is installed into that Python: the wheels are
unpacked into a folder on `PYTHONPATH`). The project itself is this checkout.

Here, once (from the project's venv, which pins the versions)::

    make gpu-check-bundle        # = .venv/bin/python scripts/gpu_check.py --make-bundle build/gpu-bundle

On the GPU machine, in the checkout, with `build/gpu-bundle` carried along::

    make gpu-check               # = python3 scripts/gpu_check.py --bundle build/gpu-bundle

Per backend (torch, jax) it runs, each step bounded and the whole within `--budget` seconds
(default 480):

1. **one worker on the GPU vs one process**: plain Keras in one process, then one keras_mwms
   worker (`keras_mwms.launch --workers 1`): weights within 1e-5, variables on the GPU;
2. **two workers sharing one GPU, RING**: torch (gloo with CUDA tensors) must train like the
   process (workers bit-identical, within 1e-5); JAX must refuse, naming both workers, since
   JAX's GPU collectives are NCCL whatever is asked;
3. **two workers sharing one GPU, AUTO** (NCCL on GPUs): keras_mwms' clear error naming both
   workers and the GPU, every worker exiting non-zero within 10 s of creating the strategy;
4. **N workers on N GPUs** (only with N > 1 GPUs): `keras_mwms.launch --workers N` (one GPU
   each, AUTO = NCCL): like the process within 1e-5, workers bit-identical, N distinct GPUs.

It writes `report.md` (and every step's log) into `--out` (default `build/gpu-check`), and also
into `$OUT` when that is set (the device machine sends `$OUT` back). Exit code 0 when every
check passed. JAX matmuls run at full float32 precision (`JAX_DEFAULT_MATMUL_PRECISION=highest`),
since TF32 would make split batches differ from one process by more than the tolerance; the
backends' versions may be outside keras_mwms' tested range, so `KERAS_MWMS_ALLOW_UNTESTED_KERAS=1`.

`--allow-cpu` runs the same flow on a machine without GPUs, as a self-test of this script:
the GPU placement checks are reported as skipped, and the shared GPU is simulated with the
test-only `KERAS_MWMS_FAKE_GPU_UUIDS`. `--dry-run` prints the plan and the bundle's state.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
TOLERANCE = 1e-5
REFUSAL_SECONDS = 10.0
STEP_TIMEOUT_SECONDS = 180.0
# Distribution → module it provides: what Keras (and keras_mwms) import beyond numpy, h5py and
# ml-dtypes (binary packages every GPU image with torch or JAX already has).
BUNDLED = {"keras": "keras", "namex": "namex", "optree": "optree", "absl-py": "absl",
           "rich": "rich", "markdown-it-py": "markdown_it", "mdurl": "mdurl",
           "pygments": "pygments", "packaging": "packaging",
           "typing-extensions": "typing_extensions"}
NEEDED_ON_THE_MACHINE = ("numpy", "h5py", "ml_dtypes")
# The device machine's Python (../shared/device/README.md), and this one for the self-test.
TARGET_PYTHONS = ("3.12", f"{sys.version_info.major}.{sys.version_info.minor}")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
SHARED_FAKE_UUID = "GPU-self-test-0000-shared"


# -- the bundle ---------------------------------------------------------------------------------


def make_bundle(folder: Path) -> int:
    """Downloads the wheels (this venv's versions) for the target Pythons into `folder/wheels`."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pins = []
    for distribution in BUNDLED:
        try:
            pins.append(f"{distribution}=={importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"gpu_check: {distribution} is not installed here; run this from the project's "
                  "venv (make gpu-check-bundle).", file=sys.stderr)
            return 2
    for python in dict.fromkeys(TARGET_PYTHONS):
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
                   *[argument for name in PLATFORMS for argument in ("--platform", name)],
                   "--dest", str(wheels), *pins]
        print("gpu_check:", " ".join(command), flush=True)
        if subprocess.run(command).returncode != 0:
            print(f"gpu_check: pip download failed for Python {python}", file=sys.stderr)
            return 1
    (folder / "MANIFEST.txt").write_text(
        "Wheels for scripts/gpu_check.py (unpacked onto PYTHONPATH on the GPU machine, only for "
        "modules its Python lacks):\n" + "\n".join(sorted(path.name for path in wheels.glob("*.whl"))) + "\n")
    size = sum(path.stat().st_size for path in wheels.glob("*.whl")) / 2**20
    print(f"gpu_check: bundle ready in {folder} ({size:.1f} MiB); carry it to the GPU machine "
          f"with the checkout (e.g. the device tool's carry=['{folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder}']).")
    return 0


def _wheel_fits(wheel: Path) -> bool:
    """Whether a wheel's tags fit this Python (pure wheels always do)."""
    tags = wheel.name[:-4].split("-")[-3:]
    python_tag, abi_tag = tags[0], tags[1]
    if abi_tag == "none":
        return True
    return python_tag == f"cp{sys.version_info.major}{sys.version_info.minor}"


def unpack_bundle(bundle: Path, site: Path) -> tuple[list[str], list[str]]:
    """Unpacks the bundle's wheels of modules this Python lacks into `site`.

    Returns (unpacked wheel names, modules still missing).
    """
    site.mkdir(parents=True, exist_ok=True)
    unpacked, missing = [], []
    wheels = sorted((bundle / "wheels").glob("*.whl")) if bundle.is_dir() else []
    for distribution, module in BUNDLED.items():
        if importlib.util.find_spec(module) is not None or (site / module).exists():
            continue
        prefix = distribution.replace("-", "_").lower() + "-"
        candidates = [wheel for wheel in wheels if wheel.name.lower().startswith(prefix) and _wheel_fits(wheel)]
        if not candidates:
            missing.append(module)
            continue
        with zipfile.ZipFile(candidates[-1]) as archive:
            archive.extractall(site)
        unpacked.append(candidates[-1].name)
    missing += [module for module in NEEDED_ON_THE_MACHINE if importlib.util.find_spec(module) is None]
    return unpacked, missing


# -- running steps ------------------------------------------------------------------------------


@dataclass
class Step:
    """One bounded command and how it ended."""

    name: str
    returncode: int | None = None
    seconds: float = 0.0
    log: Path | None = None
    output: str = ""


@dataclass
class Check:
    """One row of the report."""

    backend: str
    name: str
    expected: str
    result: str = "SKIP"
    figures: str = ""
    steps: list[Step] = field(default_factory=list)


class Runner:
    """Runs worker commands within the overall budget, keeping their logs."""

    def __init__(self, out: Path, env: dict[str, str], budget: float):
        self.out = out
        self.env = env
        self.deadline = time.monotonic() + budget
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Step:
        step = Step(name, log=self.out / "logs" / f"{name}.log")
        timeout = min(STEP_TIMEOUT_SECONDS, self.left())
        if timeout < 20:
            step.output = "not run: the check's time budget is spent"
            return step
        started = time.monotonic()
        process = subprocess.Popen(argv, cwd=REPO, env={**self.env, **(env or {})},
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            step.output, _ = process.communicate(timeout=timeout)
            step.returncode = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            step.output, _ = process.communicate()
            step.output += f"\ngpu_check: killed after {timeout:.0f} s"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        step.seconds = time.monotonic() - started
        step.log.write_text(" ".join(argv) + "\n\n" + step.output)
        print(f"gpu_check: {name}: exit {step.returncode} after {step.seconds:.1f} s", flush=True)
        return step


def worker_argv(mode: str, implementation: str, prefix: Path) -> list[str]:
    return [sys.executable, "-u", str(SCRIPT), "--worker", mode, implementation, str(prefix)]


def launch_argv(workers: int, gpus_per_worker: str, implementation: str, prefix: Path) -> list[str]:
    return [sys.executable, "-m", "keras_mwms.launch", "--workers", str(workers), "--grace-period", "5",
            "--gpus-per-worker", gpus_per_worker, *worker_argv("strategy", implementation, prefix)[2:]]


def _results(prefix: Path, workers: int) -> list[dict]:
    found = []
    for index in range(workers):
        path = prefix.parent / f"{prefix.name}-w{index}.json"
        found.append(json.loads(path.read_text()) if path.exists() else None)
    return found


def _weights(path: Path) -> list:
    import numpy as np

    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def compare(reference: Path, prefix: Path, workers: int) -> tuple[float, bool]:
    """(max |w − reference| of worker 0, whether every worker is bit-identical to worker 0)."""
    import numpy as np

    first = _weights(prefix.parent / f"{prefix.name}-w0.npz")
    single = _weights(reference)
    delta = max(float(np.max(np.abs(a - b))) for a, b in zip(first, single))
    identical = all(all(np.array_equal(a, b) for a, b in zip(first, _weights(prefix.parent / f"{prefix.name}-w{i}.npz")))
                    for i in range(1, workers))
    return delta, identical


# -- the checks ---------------------------------------------------------------------------------


def check_backend(backend: str, runner: Runner, gpus: list[tuple[str, str]], cpu_mode: bool) -> list[Check]:
    folder = runner.out / backend
    folder.mkdir(exist_ok=True)
    env = {"KERAS_BACKEND": backend}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[0][0]
    placement = "not checked: no GPU, --allow-cpu" if cpu_mode else None
    checks = []

    # 1. one worker vs one process.
    check = Check(backend, "one worker on the GPU vs one process",
                  f"max|dw| ≤ {TOLERANCE:g}, variables on the GPU")
    plain = runner.run(f"{backend}-plain", worker_argv("plain", "AUTO", folder / "plain"), env)
    one = runner.run(f"{backend}-one-worker", launch_argv(1, "auto", "AUTO", folder / "one"), env)
    check.steps = [plain, one]
    reference = folder / "plain-w0.npz"
    if plain.returncode == 0 and one.returncode == 0:
        delta, _ = compare(reference, folder / "one", 1)
        (result,) = _results(folder / "one", 1)
        on_gpu = result["platform"] == "gpu"
        check.result = "PASS" if delta <= TOLERANCE and (on_gpu or cpu_mode) else "FAIL"
        check.figures = (f"max|dw| = {delta:.3g}; variables on {result['device']} "
                         f"({placement or ('GPU' if on_gpu else 'NOT the GPU')}); replicas "
                         f"{result['replicas']}; fit {result['fit_seconds']:.1f} s vs "
                         f"{_results(folder / 'plain', 1)[0]['fit_seconds']:.1f} s in one process")
    else:
        check.result, check.figures = "FAIL", "a run failed: see its log"
    checks.append(check)

    # 2. and 3. two workers sharing one GPU.
    shared_env = dict(env)
    if cpu_mode:
        shared_env["KERAS_MWMS_FAKE_GPU_UUIDS"] = SHARED_FAKE_UUID
    for implementation in ("RING", "AUTO"):
        refuses = implementation == "AUTO" or backend == "jax"
        check = Check(backend, f"two workers sharing one GPU, {implementation}",
                      f"keras_mwms' error naming both workers, exit ≠ 0 within {REFUSAL_SECONDS:g} s"
                      if refuses else f"workers bit-identical, max|dw| ≤ {TOLERANCE:g}, on the GPU")
        prefix = folder / f"shared-{implementation.lower()}"
        step = runner.run(f"{backend}-shared-{implementation.lower()}",
                          launch_argv(2, "all", implementation, prefix), shared_env)
        check.steps = [step]
        if refuses:
            check.result, check.figures = judge_refusal(step)
        elif step.returncode == 0 and reference.exists():
            delta, identical = compare(reference, prefix, 2)
            results = _results(prefix, 2)
            on_gpu = all(result["platform"] == "gpu" for result in results)
            same_gpu = len({tuple(result["gpus"]) for result in results}) == 1
            check.result = "PASS" if delta <= TOLERANCE and identical and (on_gpu or cpu_mode) else "FAIL"
            check.figures = (f"max|dw| = {delta:.3g}; workers {'bit-identical' if identical else 'DIFFER'}; "
                             f"variables on {', '.join(result['device'] for result in results)} "
                             f"({placement or ('GPU' if on_gpu else 'NOT the GPU')}); one GPU: {same_gpu}; "
                             f"engine {results[0]['engine']}; fit {results[0]['fit_seconds']:.1f} s")
        else:
            check.result, check.figures = "FAIL", "the gang failed: see its log"
        checks.append(check)

    # 4. N workers on N GPUs.
    count = len(gpus) if not cpu_mode else 2
    check = Check(backend, f"{count} workers on {count} GPUs, AUTO",
                  f"workers bit-identical, max|dw| ≤ {TOLERANCE:g}, {count} distinct GPUs")
    if count < 2:
        check.result, check.figures = "SKIP", "this machine has one GPU"
    else:
        prefix = folder / "each"
        many_env = {key: value for key, value in env.items() if key != "CUDA_VISIBLE_DEVICES"}
        step = runner.run(f"{backend}-each-own-gpu", launch_argv(count, "auto", "AUTO", prefix), many_env)
        check.steps = [step]
        if step.returncode == 0 and reference.exists():
            delta, identical = compare(reference, prefix, count)
            results = _results(prefix, count)
            distinct = len({tuple(result["gpus"]) for result in results}) == count
            on_gpu = all(result["platform"] == "gpu" for result in results)
            check.result = ("PASS" if delta <= TOLERANCE and identical and ((distinct and on_gpu) or cpu_mode)
                            else "FAIL")
            check.figures = (f"max|dw| = {delta:.3g}; workers {'bit-identical' if identical else 'DIFFER'}; "
                             f"GPUs {[result['gpus'] for result in results]} "
                             f"({placement or ('distinct' if distinct else 'NOT distinct')}); engine "
                             f"{results[0]['engine']}; replicas {results[0]['replicas']}; fit "
                             f"{results[0]['fit_seconds']:.1f} s")
        else:
            check.result, check.figures = "FAIL", "the gang failed: see its log"
    checks.append(check)
    return checks


def judge_refusal(step: Step) -> tuple[str, str]:
    """PASS when every worker refused in the rendezvous, naming both workers, fast enough."""
    refusals = re.findall(r"\[worker (\d)\] REFUSED after ([0-9.]+) s: (.*)", step.output)
    if step.returncode in (None, 0) or not refusals:
        return "FAIL", (f"exit {step.returncode} after {step.seconds:.1f} s without keras_mwms' "
                        "refusal: see the log")
    slowest = max(float(seconds) for _, seconds, _ in refusals)
    message = refusals[0][2]
    named = all(f"worker:{index} at" in message for index in (0, 1)) and "both train on GPU" in message
    verdict = "PASS" if named and slowest <= REFUSAL_SECONDS else "FAIL"
    return verdict, (f"exit {step.returncode}; refused {slowest:.2f} s after creating the strategy "
                     f"({step.seconds:.1f} s with start-up); message: `{message[:400]}`")


# -- the report ---------------------------------------------------------------------------------


def describe_machine(gpus: list[tuple[str, str]], unpacked: list[str], backends: list[str]) -> list[str]:
    lines = [f"- host `{platform.node()}`, Python {platform.python_version()} (`{sys.executable}`), "
             f"{os.cpu_count()} CPU cores",
             f"- GPUs (nvidia-smi -L): {', '.join(f'{index}: {uuid}' for index, uuid in gpus) or 'none'}"]
    for name in ("keras", "torch", "jax", "jaxlib", "numpy", "tensorflow"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            lines.append(f"- {name} {importlib.metadata.version(name)}")
    lines.append(f"- unpacked from the bundle: {', '.join(unpacked) or 'nothing (all present)'}")
    lines.append(f"- backends checked: {', '.join(backends)}")
    return lines


def write_report(out: Path, checks: list[Check], machine: list[str], cpu_mode: bool, seconds: float) -> str:
    passed = all(check.result in ("PASS", "SKIP") for check in checks)
    lines = [f"# keras_mwms GPU check — {'PASSED' if passed else 'FAILED'}", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {seconds:.0f} s in all"
             + ("; **CPU self-test (--allow-cpu): no GPU here, placement checks skipped, the "
                "shared GPU simulated with KERAS_MWMS_FAKE_GPU_UUIDS**" if cpu_mode else ""), "",
             *machine, "",
             "| backend | check | expected | result | figures |", "|---|---|---|---|---|"]
    for check in checks:
        expected, figures = (text.replace("|", "\\|").replace("\n", " ") for text in (check.expected, check.figures))
        lines.append(f"| {check.backend} | {check.name} | {expected} | **{check.result}** | {figures} |")
    lines += ["", "Model: Dense 64→256→256→10 (ReLU), SGD(0.05, momentum 0.9), 4096 rows, global batch "
              "256, 2 epochs (32 steps), no shuffle; JAX at full float32 matmul precision.", ""]
    for check in checks:
        for step in check.steps:
            if check.result == "FAIL" and step.output:
                tail = "\n".join(step.output.splitlines()[-40:])
                lines += [f"## {step.name} (exit {step.returncode}, {step.seconds:.1f} s): last lines",
                          "", "```", tail, "```", ""]
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    return report


# -- the worker ---------------------------------------------------------------------------------


def run_worker(mode: str, implementation: str, prefix: str) -> int:
    """One training process: plain Keras ("plain") or a keras_mwms worker ("strategy")."""
    import numpy as np

    started = time.monotonic()
    if mode == "strategy":
        import keras

        import keras_mwms
        from keras_mwms import devices
        from keras_mwms.backends import backend_class

        backend_class(keras.backend.backend())   # imported first: the timing is the strategy's
        created = time.monotonic()
        try:
            strategy = keras_mwms.MultiWorkerMirroredStrategy(
                keras_mwms.CommunicationOptions(implementation=implementation))
        except keras_mwms.RendezvousError as error:
            print(f"REFUSED after {time.monotonic() - created:.2f} s: {error}", flush=True)
            return 3
        rank, scope, replicas = strategy.worker_index, strategy.scope(), strategy.num_replicas_in_sync
        engine = strategy.backend.engine_description()
        gpus = devices.worker_identity(keras.backend.backend(), strategy.num_workers)["gpus"]
    else:
        import keras

        rank, scope, replicas, engine, gpus = 0, contextlib.nullcontext(), 1, "none", []
    keras.utils.set_random_seed(1234 + 7 * rank)   # keras_mwms must still start from the chief's values
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(64, 10)) + 0.1 * rng.normal(size=(4096, 10)), axis=1)
    with scope:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    device, where = _placement(model.trainable_variables[0])
    fit_started = time.monotonic()
    history = model.fit(x, y, batch_size=256, epochs=2, shuffle=False, verbose=0)
    fit_seconds = time.monotonic() - fit_started
    base = Path(prefix)
    base.parent.mkdir(parents=True, exist_ok=True)
    np.savez(base.parent / f"{base.name}-w{rank}.npz", *model.get_weights())
    result = {"device": device, "platform": where, "replicas": replicas, "engine": engine, "gpus": gpus,
              "fit_seconds": fit_seconds, "seconds": time.monotonic() - started,
              "loss": [float(value) for value in history.history["loss"]],
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    (base.parent / f"{base.name}-w{rank}.json").write_text(json.dumps(result, indent=1))
    print(f"DONE worker {rank}: {json.dumps(result)}", flush=True)
    return 0


def _placement(variable) -> tuple[str, str]:
    """(device description, "gpu" or "cpu") of a Keras variable's value."""
    value = variable.value
    if hasattr(value, "devices"):   # a jax.Array
        found = sorted(value.devices(), key=lambda device: device.id)
        return ", ".join(str(device) for device in found), found[0].platform
    device = getattr(value, "device", None)   # a torch.Tensor
    kind = getattr(device, "type", "cpu")
    return str(device), "gpu" if kind == "cuda" else kind


# -- main ---------------------------------------------------------------------------------------


def nvidia_smi_gpus() -> list[tuple[str, str]]:
    """(index, UUID) of every GPU nvidia-smi lists; [] without one."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"^GPU (\d+):.*\(UUID: ([^)]+)\)", listed.stdout, re.MULTILINE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-bundle", metavar="DIR", type=Path, help="download the wheels into DIR and stop")
    parser.add_argument("--bundle", type=Path, default=REPO / "build" / "gpu-bundle")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "gpu-check")
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 480)")
    parser.add_argument("--allow-cpu", action="store_true", help="self-test on a machine without GPUs")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the bundle's state")
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "IMPLEMENTATION", "PREFIX"), help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.worker:
        return run_worker(*arguments.worker)
    if arguments.make_bundle:
        return make_bundle(arguments.make_bundle.resolve())

    started = time.monotonic()
    gpus = nvidia_smi_gpus()
    cpu_mode = not gpus
    if cpu_mode and not arguments.allow_cpu and not arguments.dry_run:
        print("gpu_check: nvidia-smi lists no GPU here. This check is for GPU machines; pass "
              "--allow-cpu to self-test the script on the CPU.", file=sys.stderr)
        return 2
    backends = [name for name in arguments.backends.split(",") if name]
    available = [name for name in backends if importlib.util.find_spec(name) is not None]
    wheels = sorted(path.name for path in (arguments.bundle / "wheels").glob("*.whl")) if arguments.bundle.is_dir() else []
    if arguments.dry_run:
        print(f"gpu_check plan: GPUs {gpus or 'none'}; backends {available} (asked {backends}); "
              f"bundle {arguments.bundle}: {len(wheels)} wheel(s) {wheels}; for each backend: "
              "one process, one worker, two workers sharing a GPU under RING and AUTO, "
              f"{max(2, len(gpus))} workers on their own GPUs (with > 1 GPU); report in {arguments.out}")
        return 0
    out = arguments.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    unpacked, missing = unpack_bundle(arguments.bundle.resolve(), out / "site")
    if missing:
        print(f"gpu_check: this Python lacks {', '.join(missing)} and the bundle "
              f"({arguments.bundle}) has no wheel for it; build the bundle with `make gpu-check-bundle` "
              "and carry it along.", file=sys.stderr)
        return 2
    if not available:
        print(f"gpu_check: none of {backends} is importable by {sys.executable}.", file=sys.stderr)
        return 2
    env = {key: value for key, value in os.environ.items()
           if key not in ("TF_CONFIG", "KERAS_MWMS_FAKE_GPU_UUIDS", "PYTHONPATH")}
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(out / "site"), str(REPO),
                                                            os.environ.get("PYTHONPATH")])),
                "KERAS_MWMS_ALLOW_UNTESTED_KERAS": "1", "PYTHONUNBUFFERED": "1",
                "KERAS_MWMS_RENDEZVOUS_TIMEOUT": "60", "TF_CPP_MIN_LOG_LEVEL": "2",
                "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_DEFAULT_MATMUL_PRECISION": "highest"})
    if cpu_mode:
        env.update({"JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"})
    runner = Runner(out, env, arguments.budget)
    checks = []
    for backend in available:
        checks += check_backend(backend, runner, gpus, cpu_mode)
    for backend in sorted(set(backends) - set(available)):
        checks.append(Check(backend, "every check", "-", "SKIP", f"{backend} is not importable here"))
    report = write_report(out, checks, describe_machine(gpus, unpacked, available), cpu_mode,
                          time.monotonic() - started)
    with tarfile.open(out / "gpu-check-logs.tgz", "w:gz") as archive:
        archive.add(out / "logs", arcname="logs")
        for path in out.glob("*/*.json"):
            archive.add(path, arcname=str(path.relative_to(out)))
    if os.environ.get("OUT"):
        for name in ("report.md", "gpu-check-logs.tgz"):
            shutil.copy(out / name, Path(os.environ["OUT"]) / name)
    print(report)
    return 0 if all(check.result in ("PASS", "SKIP") for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
