"""`python -m keras_mwms.benchmark orchestrators`: the same gang started three ways.

A gang of 2 workers on this host fits the same MLP (the accumulation benchmark's worker, K = 1)
started by `keras_mwms.launch`, by a simulated `srun --ntasks 2` (the `SLURM_*` variables Slurm
exports on one node) and by a simulated `mpirun -np 2` (Open MPI's `OMPI_COMM_WORLD_*`), with no
thread variable set (`OMP_NUM_THREADS`, `MKL_NUM_THREADS`, ... removed), as a user's shell has
none. Each row: milliseconds per step (best repeat), steps/s, the ratio to the launcher and the
compute threads torch ran with. Before keras_mwms split the cores by the workers of every
orchestrator, torch under srun/mpirun ran every worker with all cores: 40-100x slower on a
16-core host.

    python -m keras_mwms.benchmark orchestrators --backends torch

Example (the table rows from the measured gangs):

>>> measured = {"launch": {"seconds_per_step": 0.01, "threads": 1},
...             "srun": {"seconds_per_step": 0.0125, "threads": 1}}
>>> rows_for("torch", measured)
[['torch', 'launch', 10.0, 100.0, '1.00', 1], ['torch', 'srun', 12.5, 80.0, '0.80', 1]]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_mwms.benchmark.gang_options import chosen_backends, gang_parser
from keras_mwms.benchmark.processes import run_bounded
from keras_mwms.benchmark.report import format_table

REPOSITORY = Path(__file__).resolve().parents[2]
HEADERS = ["backend", "started by", "ms/step", "steps/s", "vs launcher", "threads/worker"]
STYLES = ("launch", "srun", "mpirun")
# What a user's shell does not set; every orchestrator variable goes too, so each style
# starts from the same clean environment.
CLEARED_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "KERAS_MWMS_", "SLURM_", "OMPI_", "PMI_", "PMIX_")
CLEARED = {"TF_CONFIG", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
           "MASTER_PORT", "XLA_FLAGS"}


def consecutive_free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 free on localhost right now (for a port base)."""
    for _ in range(200):
        base = random.randrange(20000, 40000, 16)
        probes = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports on localhost")


def clean_environment(backend: str) -> dict[str, str]:
    """This process's environment without thread or orchestrator variables, `backend` chosen."""
    env = {key: value for key, value in os.environ.items()
           if key not in CLEARED and not key.startswith(CLEARED_PREFIXES)}
    env.update(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2", KERAS_MWMS_RENDEZVOUS_TIMEOUT="120",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")])))
    return env


def style_environments(style: str, workers: int) -> list[dict[str, str]]:
    """The variables each worker gets from `srun --ntasks N` or `mpirun -np N` on one node."""
    base = str(consecutive_free_ports(workers))
    if style == "srun":
        job = str(random.randrange(10 ** 6, 10 ** 7))
        return [{"SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
                 "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": str(workers),
                 "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost",
                 "SLURM_STEP_TASKS_PER_NODE": str(workers), "SLURM_NTASKS": str(workers),
                 "SLURM_JOB_NODELIST": "localhost", "SLURMD_NODENAME": "localhost",
                 "KERAS_MWMS_PORT_BASE": base} for rank in range(workers)]
    return [{"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(workers),
             "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(workers),
             "OMPI_COMM_WORLD_NODE_RANK": "0", "KERAS_MWMS_PORT_BASE": base} for rank in range(workers)]


def run_style(backend: str, style: str, settings_path: Path, out: Path, timeout: float) -> dict:
    """One gang started the `style` way; worker 0's measurements (raises with logs on failure)."""
    worker = [sys.executable, "-m", "keras_mwms.benchmark.accumulation_worker",
              str(out / f"{backend}.{style}.worker{{worker}}.json"), str(settings_path)]
    env = clean_environment(backend)
    if style == "launch":
        commands = [([sys.executable, "-m", "keras_mwms.launch", "--workers", "2", "-m", *worker[2:]], env)]
    else:
        commands = [(worker, {**env, **extra}) for extra in style_environments(style, 2)]
    run_bounded([(command, command_env, out / f"{backend}.{style}.process{index}.log")
                 for index, (command, command_env) in enumerate(commands)],
                timeout, f"{backend} gang started by {style}")
    result = json.loads((out / f"{backend}.{style}.worker0.json").read_text())
    best = min(result["rows"], key=lambda row: row["seconds_per_micro_step"])
    return {"seconds_per_step": best["seconds_per_micro_step"], "threads": result.get("threads")}


def rows_for(backend: str, measured: dict[str, dict]) -> list[list[object]]:
    """Table rows, one per style, with the ratio of steps/s to the launcher's."""
    launcher = measured.get("launch")
    rows = []
    for style, row in measured.items():
        ratio = f"{launcher['seconds_per_step'] / row['seconds_per_step']:.2f}" if launcher else "-"
        rows.append([backend, style, round(row["seconds_per_step"] * 1000, 1),
                     round(1 / row["seconds_per_step"], 1), ratio, row["threads"]])
    return rows


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = gang_parser(prog, "orchestrators", __doc__.split("\n\n")[0], steps=40, warmup=8, repeats=2,
                         width=512, global_batch=64, timeout=600, backends="torch")
    parser.add_argument("--styles", default=",".join(STYLES), help=f"comma-separated (default {','.join(STYLES)})")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m keras_mwms.benchmark") -> int:
    """Runs every style on every backend; prints the table, writes orchestrators.json under --out."""
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    backends = chosen_backends(parser, arguments.backends)
    styles = [name.strip() for name in arguments.styles.split(",") if name.strip()]
    if set(styles) - set(STYLES) or not styles:
        parser.error(f"--styles takes a comma-separated subset of {', '.join(STYLES)}; got {arguments.styles!r}")
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    settings_path = out / "settings.json"
    settings_path.write_text(json.dumps({
        "steps": arguments.steps, "warmup": arguments.warmup, "width": arguments.width, "depth": arguments.depth,
        "features": 256, "classes": 10, "global_batch": arguments.global_batch, "ks": [1],
        "repeats": arguments.repeats, "threads": "as started"}))
    started = datetime.datetime.now(datetime.timezone.utc)
    table, failures = [], []
    for backend in backends:
        measured = {}
        for style in styles:
            print(f"[orchestrators] {backend} started by {style} ...", flush=True)
            try:
                measured[style] = run_style(backend, style, settings_path, out, arguments.timeout)
            except RuntimeError as error:
                failures.append(str(error))
                print(str(error), flush=True)
        table += rows_for(backend, measured)
    load = os.getloadavg()
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, load "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end; 2 workers on localhost, no thread "
              f"variable set; MLP 256-{arguments.width}x{arguments.depth}-10, global batch "
              f"{arguments.global_batch}, SGD, {arguments.steps} timed steps after {arguments.warmup}, "
              f"best of {arguments.repeats}")
    print("\n" + header + "\n" + format_table(HEADERS, table), flush=True)
    (out / "orchestrators.json").write_text(json.dumps({"header": header, "headers": HEADERS, "rows": table,
                                                        "failures": failures}, indent=1))
    return 1 if failures else 0
