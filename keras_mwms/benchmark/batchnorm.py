"""`python -m keras_mwms.benchmark batchnorm`: what one process's BatchNormalization costs per step.

By default an ordinary BatchNormalization normalizes over the global batch, as one process does
(`CommunicationOptions(batch_norm_statistics="global")`): one small all-reduce per layer in
the forward pass and one in the backward pass. `"per_worker"` normalizes over each worker's
shard, as tf.distribute does, with no extra collective. Per backend one gang of 2 workers on
localhost fits the same MLP (a BatchNormalization after every hidden Dense) under both
choices, alternating over the repeats in the same processes, and prints per choice:
milliseconds per step (best repeat), the cost over per-worker statistics and the collectives
per step the ledger counted (torch counts the forward all-reduces, their backward twins run
inside autograd; TensorFlow's run inside the step's `tf.function` and JAX's inside XLA's step).

    python -m keras_mwms.benchmark batchnorm --backends torch,jax

Example (the table rows of one worker's measurements):

>>> row = {"statistics": "global", "steps": 40, "seconds_per_step": 0.012, "batch_norm_layers": 3,
...        "collectives": {"gradient all-reduce": 40, "BatchNormalization all-reduce": 120}}
>>> rows_for("torch", [dict(row, statistics="per_worker", seconds_per_step=0.010,
...                         collectives={"gradient all-reduce": 40}), row])[1]
['torch', 'global', 3, 12.0, '+2.0 ms (1.20x)', '4.00']
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from keras_mwms.benchmark.accumulation import run_gang
from keras_mwms.benchmark.gang_options import chosen_backends, gang_parser
from keras_mwms.benchmark.report import format_table

HEADERS = ["backend", "statistics", "BN layers", "ms/step", "cost vs per_worker", "collectives/step"]
CHOICES = ("per_worker", "global")


def rows_for(backend: str, measured: list[dict]) -> list[list[object]]:
    """Table rows from worker 0's measurements: the best repeat per choice, cost over per_worker."""
    best: dict[str, dict] = {}
    for row in measured:
        if row["statistics"] not in best or row["seconds_per_step"] < best[row["statistics"]]["seconds_per_step"]:
            best[row["statistics"]] = row
    baseline = best.get("per_worker")
    table = []
    for statistics in [choice for choice in CHOICES if choice in best]:
        row = best[statistics]
        counted = sum(row["collectives"].values())
        cost = "—"
        if baseline is not None:
            extra = (row["seconds_per_step"] - baseline["seconds_per_step"]) * 1000
            cost = f"{extra:+.1f} ms ({row['seconds_per_step'] / baseline['seconds_per_step']:.2f}x)"
        table.append([backend, statistics, row["batch_norm_layers"], round(row["seconds_per_step"] * 1000, 1),
                      cost, f"{counted / row['steps']:.2f}" if counted else "in-graph"])
    return table


def build_parser(prog: str) -> argparse.ArgumentParser:
    return gang_parser(prog, "batchnorm", __doc__.split("\n\n")[0], steps=40, warmup=8, repeats=2, width=256,
                       global_batch=64, timeout=900, depth_help="hidden Dense + BatchNormalization pairs")


def main(argv: Sequence[str] | None = None, prog: str = "python -m keras_mwms.benchmark") -> int:
    """Runs the measurement; prints the table and writes batchnorm.json under --out."""
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    backends = chosen_backends(parser, arguments.backends)
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"steps": arguments.steps, "warmup": arguments.warmup, "width": arguments.width,
                "depth": arguments.depth, "features": 64, "classes": 10, "global_batch": arguments.global_batch,
                "statistics": list(CHOICES), "repeats": arguments.repeats}
    started = datetime.datetime.now(datetime.timezone.utc)
    table, failures = [], []
    for backend in backends:
        print(f"[batchnorm] {backend} ...", flush=True)
        try:
            workers = run_gang(backend, settings, out, arguments.timeout,
                               worker_module="keras_mwms.benchmark.batchnorm_worker", what="batchnorm")
        except RuntimeError as error:
            failures.append(str(error))
            print(str(error), flush=True)
            continue
        table += rows_for(backend, workers[0]["rows"])
        print(format_table(HEADERS, table[-len(CHOICES):]), flush=True)
    load = os.getloadavg()
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, load "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end; 2 workers on localhost, 1 thread each; "
              f"MLP 64-({arguments.width} + BatchNormalization)x{arguments.depth}-10, global batch "
              f"{arguments.global_batch}, SGD, {arguments.steps} timed steps after {arguments.warmup}, "
              f"best of {arguments.repeats}")
    print("\n" + header + "\n" + format_table(HEADERS, table), flush=True)
    (out / "batchnorm.json").write_text(json.dumps({"header": header, "headers": HEADERS, "rows": table,
                                                    "failures": failures}, indent=1))
    return 1 if failures else 0
