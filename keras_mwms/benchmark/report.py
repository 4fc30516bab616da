"""The benchmark's outputs: tables on stdout, `benchmark.json`, and `benchmark.png`.

The PNG has two panels: the all-reduce bus bandwidth per backend against message size, with
the measured loopback link bandwidth as the ceiling; and steps/s of keras_mwms beside each
native peer, for one process and for N workers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table, columns right-aligned except the first.

    Example:

    >>> print(format_table(["name", "value"], [["a", 1.5], ["bb", None]]))
    name  value
    ----  -----
    a      1.50
    bb        -
    """
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(header)), *(len(row[i]) for row in cells)) for i, header in enumerate(headers)]

    def line(values):
        return "  ".join(value.ljust(widths[i]) if i == 0 else value.rjust(widths[i])
                         for i, value in enumerate(values)).rstrip()

    return "\n".join([line(headers), line(["-" * width for width in widths])] + [line(row) for row in cells])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def human_bytes(nbytes: int) -> str:
    """`4 B`, `64 KiB`, `2.2 MiB`.

    Example:

    >>> human_bytes(4), human_bytes(65536), human_bytes(2254888)
    ('4 B', '64 KiB', '2.2 MiB')
    """
    for unit, size in (("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def allreduce_text(backend: str, rows: Sequence[dict], workers: int, link_gbps: float) -> str:
    headers = ["size", "what", "iters", "time us", "algbw GB/s", "busbw GB/s", "ring bound us", "of bound"]
    body = [[human_bytes(row["bytes"]), row["label"], row["iterations"], row["time_us"], row["algbw_gbps"],
             row["busbw_gbps"], row["bound_us"], f"{100 * row['of_bound']:.1f}%"] for row in rows]
    return (f"all-reduce, {backend}, {workers} workers (ring bound at the {link_gbps:.2f} GB/s loopback "
            f"link):\n" + format_table(headers, body))


def fits_text(rows: Sequence[dict], global_batch: int) -> str:
    headers = ["backend", "model", "workers", "threads", "batch", "variant", "steps/s", "examples/s",
               "first step s", "start-up s", "graph breaks"]
    body = [[row["backend"], row["model"], row["workers"], row["threads"], row["global_batch"], row["variant"],
             row["steps_per_second"], row["examples_per_second"], row["first_step_seconds"],
             row["startup_seconds"], row.get("graph_breaks")] for row in rows]
    return (f"fit (batch = global batch; {global_batch} unless it is one worker's share):\n"
            + format_table(headers, body))


def ratios_text(rows: Sequence[dict]) -> str:
    headers = ["backend", "model", "workers", "batch", "native peer", "keras_mwms steps/s", "peer steps/s",
               "ratio", "1-process ratio", "distribution ratio", "start-up ours s", "start-up peer s",
               "graph breaks", "sync overhead ms", "overhead/all-reduce"]

    def times(value):
        return None if value is None else f"{value:.2f}x"

    def peer(row):
        ours = row.get("ours", "keras_mwms")
        return row["peer"] if ours == "keras_mwms" else f"{row['peer']} [ours: {ours}]"

    body = [[row["backend"], row["model"], row["workers"], row["global_batch"], peer(row),
             row["keras_mwms_steps_per_second"],
             row["peer_steps_per_second"], times(row["ratio"]), times(row.get("one_process_ratio")),
             times(row.get("distribution_ratio")), row["keras_mwms_startup_seconds"],
             row["peer_startup_seconds"], row.get("graph_breaks"), row.get("sync_overhead_ms"),
             times(row.get("overhead_vs_allreduce"))] for row in rows]
    return ("ratio keras_mwms / native (>= 1.00x: at least as fast; distribution ratio = ratio / "
            "1-process ratio on the same global batch; graph breaks: TorchDynamo's, in keras_mwms' "
            "compiled fit; sync overhead: keras_mwms' per step, as in the table above):\n" + format_table(headers, body))


def one_process_text(rows: Sequence[dict]) -> str:
    headers = ["backend", "model", "batch", "plain Keras variant", "keras_mwms 1 worker steps/s",
               "plain Keras steps/s", "ratio"]
    body = [[row["backend"], row["model"], row["global_batch"], row["plain"], row["keras_mwms_steps_per_second"],
             row["plain_steps_per_second"], f"{row['ratio']:.2f}x"] for row in rows]
    return ("one worker of keras_mwms / plain Keras, one process (same process, interleaved; "
            ">= 1.00x: one worker costs nothing):\n" + format_table(headers, body))


def ledger_text(rows: Sequence[dict]) -> str:
    headers = ["backend", "model", "workers", "batch", "ledger on steps/s", "ledger off steps/s", "slower"]
    body = [[row["backend"], row["model"], row["workers"], row["global_batch"],
             row["ledger_on_steps_per_second"], row["ledger_off_steps_per_second"],
             f"{row['slower_percent']:.1f}%"] for row in rows]
    return ("collective ledger and timers (keras_mwms.diagnostics) on vs off, same gang, interleaved "
            "(best of the repeats):\n" + format_table(headers, body))


def overhead_text(rows: Sequence[dict]) -> str:
    headers = ["backend", "model", "variant", "step ms share", "step ms N", "sync overhead ms",
               "gradients", "all-reduce ms", "overhead/all-reduce"]
    body = [[row["backend"], row["model"], row["variant"], row["step_ms_share"], row["step_ms_workers"],
             row["sync_overhead_ms"], human_bytes(row["gradient_bytes"]) if row["gradient_bytes"] else None,
             row["allreduce_ms"],
             None if row["overhead_vs_allreduce"] is None else f"{row['overhead_vs_allreduce']:.2f}x"]
            for row in rows]
    return ("per-step sync overhead = step time of N workers - step time of one process on one worker's "
            "share\n(global batch / N, same threads), vs one raw all-reduce of the gradient bytes:\n"
            + format_table(headers, body))


def write_json(report: dict, out_dir: Path) -> Path:
    path = out_dir / "benchmark.json"
    path.write_text(json.dumps(report, indent=1, sort_keys=False))
    return path


def write_plot(report: dict, out_dir: Path) -> Path:
    """Writes `benchmark.png` (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (left, right) = pyplot.subplots(1, 2, figsize=(13, 5))
    link_gbps = report["machine"]["loopback_tcp_bytes_per_second"] / 1e9
    for backend, rows in report["allreduce"].items():
        sweep = [row for row in rows if row["label"] == "sweep"]
        if sweep:
            left.plot([row["bytes"] for row in sweep], [row["busbw_gbps"] for row in sweep], marker="o",
                      label=backend)
    left.axhline(link_gbps, color="gray", linestyle="--", label=f"loopback TCP {link_gbps:.2f} GB/s")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("message size (bytes)")
    left.set_ylabel("bus bandwidth (GB/s)")
    left.set_title(f"all-reduce, {report['config']['workers']} workers")
    left.legend()

    fits = [row for row in report["fits"] if row["global_batch"] == report["config"]["global_batch"]]
    groups = sorted({(row["backend"], row["model"], row["workers"]) for row in fits})
    variants = sorted({row["variant"] for row in fits}, key=lambda name: (name != "keras_mwms", name))
    colors = {variant: f"C{number}" for number, variant in enumerate(variants)}
    width = 0.8 / max(1, max((sum(1 for row in fits if (row["backend"], row["model"], row["workers"]) == group)
                              for group in groups), default=1))
    labelled = set()
    for position, group in enumerate(groups):
        present = sorted((row for row in fits if (row["backend"], row["model"], row["workers"]) == group),
                         key=lambda row: variants.index(row["variant"]))
        for offset, row in enumerate(present):
            x = position + (offset - (len(present) - 1) / 2) * width
            label = None if row["variant"] in labelled else row["variant"]
            labelled.add(row["variant"])
            right.bar(x, row["steps_per_second"], width, color=colors[row["variant"]], label=label)
    right.set_xticks(range(len(groups)))
    short = {"tensorflow": "TF"}  # "tensorflow" under every bar ran into its neighbours
    right.set_xticklabels([f"{short.get(backend, backend)}\n{model}\nn={workers}" for backend, model, workers in groups],
                          fontsize=8)
    right.set_xlabel("backend / model / n = workers (1: one process)", fontsize=8)
    right.set_ylabel("steps/s (higher is better)")
    right.set_title(f"fit, global batch {report['config']['global_batch']}")
    right.legend(fontsize=8)
    figure.suptitle(f"keras_mwms benchmark — {report['machine']['description']}", fontsize=9)
    figure.tight_layout()
    path = out_dir / "benchmark.png"
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
