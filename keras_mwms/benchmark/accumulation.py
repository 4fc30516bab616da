"""`python -m keras_mwms.benchmark accumulation`: gradient accumulation, K = 4 against K = 1.

Per backend one gang of 2 workers on localhost fits the same MLP with
`gradient_accumulation_steps=K` for each K (default 1 and 4), alternating over the repeats in the
same processes, and prints per K: milliseconds per micro-step (best repeat), the speed-up over
K = 1, gradient all-reduces per optimizer step, all collectives per micro-step (row counts and
metric states still cross every micro-step, so batch logs stay global) and the bytes handed to
the engine per micro-step. TensorFlow runs a step's collectives inside one `tf.function`, where
the ledger counts the step (one entry for its in-graph collectives: the row count, or at K = 1
the gradients carrying it), so its K = 1 gradient all-reduce shows as "in-graph"; the window
all-reduce of K > 1 is counted when it runs.

    python -m keras_mwms.benchmark accumulation --backends torch,jax --k 1,4

Example (the table rows of one worker's measurements):

>>> row = {"k": 4, "micro_steps": 48, "optimizer_steps": 12, "seconds_per_micro_step": 0.02,
...        "collectives": {"gradient all-reduce": 12, "row all-reduce": 48, "metric all-reduce": 49},
...        "engine_bytes_per_micro_step": 1000.0, "parameters": 10}
>>> rows_for("torch", [dict(row, k=1, seconds_per_micro_step=0.03), row])[1]
['torch', 4, 20.0, 1.5, '1.00', 2.27, 1000]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_mwms.benchmark.compression_worker import mlp_parameters
from keras_mwms.benchmark.gang_options import chosen_backends, gang_parser
from keras_mwms.benchmark.processes import run_bounded
from keras_mwms.benchmark.report import format_table
from keras_mwms.benchmark.runner import gang_environment
from keras_mwms.launch import find_free_ports

HEADERS = ["backend", "K", "ms/micro-step", "speed-up vs K=1", "gradient all-reduces/optimizer step",
           "collectives/micro-step", "engine bytes/micro-step"]


def run_gang(backend: str, settings: dict, out: Path, timeout: float,
             worker_module: str = "keras_mwms.benchmark.accumulation_worker", what: str = "accumulation") -> list[dict]:
    """One 2-worker gang of `worker_module` on localhost; each worker's rows (raises with the logs on failure)."""
    workers = [f"localhost:{port}" for port in find_free_ports(2)]
    settings_path = out / f"{backend}.settings.json"
    settings_path.write_text(json.dumps(settings))
    base = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    run_bounded([([sys.executable, "-m", worker_module, str(out / f"{backend}.worker{index}.json"), str(settings_path)],
                  dict(base, **gang_environment(backend, 1),
                       TF_CONFIG=json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})),
                  out / f"{backend}.worker{index}.log") for index in range(2)],
                timeout, f"{backend} {what} gang")
    return [json.loads((out / f"{backend}.worker{index}.json").read_text()) for index in range(2)]


def rows_for(backend: str, measured: list[dict]) -> list[list[object]]:
    """Table rows from worker 0's measurements: the best repeat per K, speed-up over K = 1."""
    best: dict[int, dict] = {}
    for row in measured:
        if row["k"] not in best or row["seconds_per_micro_step"] < best[row["k"]]["seconds_per_micro_step"]:
            best[row["k"]] = row
    baseline = best.get(1)
    table = []
    for k, row in sorted(best.items()):
        gradient = sum(count for kind, count in row["collectives"].items() if kind.startswith("gradient all-reduce"))
        per_update = f"{gradient / row['optimizer_steps']:.2f}" if gradient else "in-graph"
        speed_up = (round(baseline["seconds_per_micro_step"] / row["seconds_per_micro_step"], 2)
                    if baseline else None)
        table.append([backend, k, round(row["seconds_per_micro_step"] * 1000, 1), speed_up, per_update,
                      round(sum(row["collectives"].values()) / row["micro_steps"], 2),
                      round(row["engine_bytes_per_micro_step"])])
    return table


def _counts(text: str) -> list[int]:
    ks = sorted({int(part) for part in text.split(",") if part.strip()})
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"--k takes accumulation steps >= 1, e.g. 1,4; got {text!r}")
    return ks


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = gang_parser(prog, "accumulation", __doc__.split("\n\n")[0], steps=48, warmup=8, repeats=2,
                         width=1024, global_batch=64, timeout=900, unit="micro-steps")
    parser.add_argument("--k", type=_counts, default=[1, 4], help="accumulation steps, comma-separated (default 1,4)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m keras_mwms.benchmark") -> int:
    """Runs the measurement; prints the table and writes accumulation.json under --out."""
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    backends = chosen_backends(parser, arguments.backends)
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"steps": arguments.steps, "warmup": arguments.warmup, "width": arguments.width,
                "depth": arguments.depth, "features": 256, "classes": 10, "global_batch": arguments.global_batch,
                "ks": arguments.k, "repeats": arguments.repeats}
    started = datetime.datetime.now(datetime.timezone.utc)
    table, failures = [], []
    for backend in backends:
        print(f"[accumulation] {backend} ...", flush=True)
        try:
            workers = run_gang(backend, settings, out, arguments.timeout)
        except RuntimeError as error:
            failures.append(str(error))
            print(str(error), flush=True)
            continue
        table += rows_for(backend, workers[0]["rows"])
        print(format_table(HEADERS, table[-len(arguments.k):]), flush=True)
    load = os.getloadavg()
    parameters = mlp_parameters(settings["features"], arguments.width, arguments.depth, settings["classes"])
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, load "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end; 2 workers on localhost, 1 thread each; "
              f"MLP 256-{arguments.width}x{arguments.depth}-10 ({parameters / 1e6:.1f} M parameters), "
              f"global batch {arguments.global_batch} per micro-step, SGD, {arguments.steps} timed micro-steps "
              f"after {arguments.warmup}, best of {arguments.repeats}")
    print("\n" + header + "\n" + format_table(HEADERS, table), flush=True)
    (out / "accumulation.json").write_text(json.dumps({"header": header, "headers": HEADERS, "rows": table,
                                                       "failures": failures}, indent=1))
    return 1 if failures else 0
