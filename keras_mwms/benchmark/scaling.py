"""The scaling sweep (`--workers 2,3,4`) and the α-β cost model's projection to 256 workers.

A sweep runs, per backend, the usual gangs at the smallest count (with the native peers) and
keras_mwms alone at each further count (role `scaling` of `keras_mwms.benchmark.worker`),
always on the same per-worker batch — global batch ÷ the smallest count — so the global batch
grows with n (weak scaling). Every process gets the same threads (cores ÷ the largest count,
at least 1), so a machine with fewer cores than processes × threads is *oversubscribed*: its
processes share cores, and the report says so for every count.

From the run, `analyse` builds the report's `scaling` section (`keras_mwms.benchmark.cost_model`
has the formulas and why):

* per backend, α and β fitted to the all-reduce rows (the sweep's and the gradients' sizes; the
  4-byte latency row only when fewer than two sizes were measured) of the counts that are not
  oversubscribed (all counts when every one is), and the model's error on every all-reduce row;
* per backend, model and measured count: the step time (1 ÷ steps/s), the weak-scaling
  efficiency (one process's step on the per-worker batch ÷ it), and the model's prediction
  at that point — compute × oversubscription + ring all-reduce (serial), and max(compute ×
  oversubscription, all-reduce) (overlapped) — with its error in %;
* the projection: step time and efficiency at 8…256 workers and 10/25/100 Gbit/s, one worker
  per machine (no oversubscription), serial for TensorFlow and JAX; for torch overlapped (its
  design, plotted) and serial (closer to what its measured points show on 2 shared cores).

`write_plot` draws `scaling.png`: the projections, the measured points and the model on this
machine at the measured counts, on the same axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from keras_mwms.benchmark import cost_model
from keras_mwms.benchmark.allreduce import summarize
from keras_mwms.benchmark.config import BenchmarkConfig
from keras_mwms.benchmark.models import parameter_count
from keras_mwms.benchmark.report import format_table

ROLE = "scaling"
OURS = "keras_mwms"
OVERLAPPED = frozenset({"torch"})     # starts the gradient all-reduce during backward()
PLOT_WORKERS = (2, 4, 8, 16, 32, 64, 128, 256)


def worker_counts(config: BenchmarkConfig) -> tuple[int, ...]:
    """Every multi-worker count a run measures: `workers`, then the sweep's further counts.

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> worker_counts(quick_config(workers=2, scaling_workers=(3, 4)))
    (2, 3, 4)
    """
    return (config.workers, *config.scaling_workers)


def per_worker_batch(config: BenchmarkConfig) -> int:
    """Examples per worker per step, the same at every count of the sweep.

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> per_worker_batch(quick_config(workers=2, global_batch=256))
    128
    """
    return config.global_batch // config.workers


def _ok(gangs: Sequence[dict]) -> list[dict]:
    return [gang for gang in gangs if gang.get("ok") and gang.get("results")]


def _allreduce_by_count(gangs: Sequence[dict], link_bandwidth: float) -> dict[str, dict[int, list[dict]]]:
    """Per backend and worker count, the merged all-reduce rows of the keras_mwms gangs."""
    tables: dict[str, dict[int, list[dict]]] = {}
    for gang in _ok(gangs):
        if gang["workers"] < 2 or gang["role"] not in (OURS, ROLE):
            continue
        per_worker = [result["allreduce"] for result in sorted(gang["results"], key=lambda r: r["worker_index"])
                      if result.get("allreduce")]
        if per_worker:
            tables.setdefault(gang["backend"], {})[gang["workers"]] = summarize(
                per_worker, gang["workers"], link_bandwidth)
    return tables


def fit_engines(tables: dict[str, dict[int, list[dict]]], threads: int, cores: int) -> dict[str, dict]:
    """Per backend: α, β fitted to the rows of the counts that are not oversubscribed (else all).

    The rows are the all-reduce section's sizes and the gradient sizes; the 4-byte "latency" row
    joins only when fewer than two other sizes were measured: a one-element message cannot be
    cut into the ring's n chunks, and the engines run it faster than the ring's 2(n−1) steps
    (measured here: torch 284 µs at 2 workers, against 575 µs for 4 KiB).

    Example:

    >>> def row(size, n, seconds=None):  # alpha 100 us, beta 1 ns/B unless `seconds` is given
    ...     seconds = seconds or cost_model.ring_allreduce_seconds(size, n, alpha=1e-4, beta=1e-9)
    ...     return {"label": "sweep", "bytes": size, "time_us": seconds * 1e6}
    >>> tables = {"torch": {2: [row(4096, 2), row(1 << 20, 2)], 3: [row(4096, 3, seconds=0.001)]}}
    >>> torch = fit_engines(tables, threads=1, cores=2)["torch"]  # 3 processes on 2 cores: not fitted
    >>> torch["fitted_from"], round(torch["alpha_us"], 3), round(torch["beta_ns"], 3)
    ([2], 100.0, 1.0)
    >>> [round(check["error_percent"]) for check in torch["checks"]]  # n=3: 405 us vs 1 ms measured
    [0, 0, -59]
    """
    engines = {}
    for backend, by_count in tables.items():
        fitted_from = [n for n in sorted(by_count) if cost_model.oversubscription(n, threads, cores) == 1.0]
        fitted_from = fitted_from or sorted(by_count)
        rows = [(n, row) for n in fitted_from for row in by_count[n]]
        ring_rows = [(n, row) for n, row in rows if row["label"] != "latency"]
        if len({row["bytes"] for _, row in ring_rows}) >= 2:
            rows = ring_rows
        samples = [(n, row["bytes"], row["time_us"] / 1e6) for n, row in rows]
        try:
            model = cost_model.fit_alpha_beta(samples)
        except ValueError as error:
            engines[backend] = {"error": str(error), "fitted_from": fitted_from}
            continue
        checks = []
        for n in sorted(by_count):
            for row in by_count[n]:
                predicted = model.seconds(row["bytes"], n) * 1e6
                checks.append({"workers": n, "label": row["label"], "bytes": row["bytes"],
                               "measured_us": row["time_us"], "predicted_us": predicted,
                               "error_percent": 100.0 * (predicted / row["time_us"] - 1.0)})
        engines[backend] = {"alpha_us": model.alpha * 1e6, "beta_ns": model.beta * 1e9,
                            "effective_gbps": 1.0 / model.beta / 1e9 if model.beta > 0 else None,
                            "samples": model.samples, "relative_rms_percent": 100.0 * model.relative_rms,
                            "fitted_from": fitted_from, "checks": checks}
    return engines


def _model(engine: dict) -> cost_model.AlphaBeta:
    return cost_model.AlphaBeta(engine["alpha_us"] / 1e6, engine["beta_ns"] / 1e9, engine["samples"],
                                engine["relative_rms_percent"] / 100.0)


def messages_per_step(backend: str, gradient_bytes: int) -> int:
    """Collectives per training step, each paying the ring's latency.

    torch: its gradient buckets (the metric states and row counts ride in the last one); JAX's
    flat path: one vector (metrics ride along); TensorFlow with Keras' own train step: the
    gradients in one pack with the row count riding along (`keras_mwms.backends.tensorflow.step`),
    then the metric states (their sync-on-read variables, read for the step's logs); a custom
    `train_step` adds a scalar all-reduce of the row counts first. (Counted in a traced step.)

    Example:

    >>> [messages_per_step(backend, 2_254_888) for backend in ("tensorflow", "jax", "torch")]
    [2, 1, 2]
    """
    if backend == "torch":
        return cost_model.torch_buckets(gradient_bytes)
    return 2 if backend == "tensorflow" else 1


def _measured_rows(fits: Sequence[dict], config: BenchmarkConfig, engines: dict[str, dict], threads: int,
                  cores: int) -> list[dict]:
    """Per backend, model and measured count: measured step and efficiency, and the model's."""
    index = {(row["backend"], row["model"], row["workers"], row["global_batch"]): row
             for row in fits if row["variant"] == OURS}
    batch = per_worker_batch(config)
    rows = []
    for backend in config.backends:
        engine = engines.get(backend)
        for model_name in config.models:
            one = index.get((backend, model_name, 1, batch))
            if one is None:
                continue
            compute = 1.0 / one["steps_per_second"]
            gradient_bytes = 4 * parameter_count(config, model_name)
            messages = messages_per_step(backend, gradient_bytes)
            for n in worker_counts(config):
                measured = index.get((backend, model_name, n, n * batch))
                if measured is None:
                    continue
                step = 1.0 / measured["steps_per_second"]
                factor = cost_model.oversubscription(n, threads, cores)
                row = {"backend": backend, "model": model_name, "workers": n, "threads": threads,
                       "cores": cores, "oversubscription": factor, "per_worker_batch": batch,
                       "global_batch": n * batch, "compute_ms": compute * 1e3, "measured_ms": step * 1e3,
                       "measured_efficiency": compute / step, "gradient_bytes": gradient_bytes,
                       "messages": messages, "form": "overlapped" if backend in OVERLAPPED else "serial"}
                if engine and "alpha_us" in engine:
                    allreduce = _model(engine).seconds(gradient_bytes, n, messages)
                    for form, overlapped in (("serial", False), ("overlapped", True)):
                        predicted = cost_model.step_seconds(compute * factor, allreduce, overlapped)
                        row[f"{form}_ms"] = predicted * 1e3
                        row[f"{form}_error_percent"] = 100.0 * (predicted / step - 1.0)
                    row["allreduce_ms"] = allreduce * 1e3
                    row["predicted_ms"] = row[f"{row['form']}_ms"]
                    row["error_percent"] = row[f"{row['form']}_error_percent"]
                    row["predicted_efficiency"] = compute / (row["predicted_ms"] / 1e3)
                rows.append(row)
    return rows


def _projection_rows(fits: Sequence[dict], config: BenchmarkConfig, engines: dict[str, dict],
                    loopback_bytes_per_second: float,
                    workers: Sequence[int] = cost_model.PROJECTED_WORKERS) -> list[dict]:
    """Step time and efficiency per backend, model, link speed and count (one worker per machine)."""
    batch = per_worker_batch(config)
    rows = []
    for row in fits:
        if row["variant"] != OURS or row["workers"] != 1 or row["global_batch"] != batch:
            continue
        engine = engines.get(row["backend"])
        if not engine or "alpha_us" not in engine:
            continue
        gradient_bytes = 4 * parameter_count(config, row["model"])
        # torch: the overlapped bound (its design) and the serial form (what 2 shared cores give).
        for overlapped in ((True, False) if row["backend"] in OVERLAPPED else (False,)):
            for point in cost_model.project(1.0 / row["steps_per_second"], gradient_bytes, _model(engine),
                                            loopback_bytes_per_second, workers=workers, overlapped=overlapped,
                                            messages=messages_per_step(row["backend"], gradient_bytes)):
                rows.append({"backend": row["backend"], "model": row["model"],
                             "form": "overlapped" if overlapped else "serial",
                             "primary": overlapped == (row["backend"] in OVERLAPPED), "per_worker_batch": batch,
                             "compute_ms": 1e3 / row["steps_per_second"], **point})
    return rows


ASSUMPTIONS = (
    "weak scaling: every worker keeps the per-worker batch; compute = one process's step on it "
    "(measured here, same threads); step = compute + ring all-reduce (serial: TensorFlow, JAX) or "
    "max(compute, all-reduce) (overlapped: torch's buckets during backward, the optimistic bound); "
    "ring all-reduce = m·2(n-1)·alpha + 2(n-1)/n·bytes·beta, m = collectives per step (torch: its "
    "buckets; TensorFlow: gradients with the row count + metric states; JAX: 1); alpha, beta: least squares (relative "
    "residuals) on the all-reduce sizes (without the 4-byte latency row) of the counts that are "
    "not oversubscribed; on a network link of L bit/s, beta = (fitted beta - 1/loopback bandwidth) "
    "+ 8/L (the engine's CPU work per byte stays, the wire changes), alpha as fitted; at the measured "
    "points compute is scaled by max(1, processes x threads / cores), projected workers have their own "
    "cores")


def analyse(gangs: Sequence[dict], fits: Sequence[dict], config: BenchmarkConfig, machine: dict,
            threads: int) -> dict:
    """The report's `scaling` section (see the module docstring); `text` prints it.

    Example: a 2-worker JAX run whose all-reduce follows α = 100 µs, β = 1 ns/B exactly, and
    whose MLP step takes 20 ms alone and 30 ms with 2 workers.

    >>> from keras_mwms.benchmark.config import quick_config
    >>> config = quick_config(backends=("jax",), workers=2)
    >>> rows = [{"label": "sweep", "bytes": size, "iterations": 3, "correct": True,
    ...          "seconds": cost_model.ring_allreduce_seconds(size, 2, alpha=1e-4, beta=1e-9)}
    ...         for size in (4096, 1 << 20)]
    >>> gang = {"ok": True, "backend": "jax", "workers": 2, "role": "keras_mwms",
    ...         "results": [{"worker_index": index, "allreduce": rows} for index in (0, 1)]}
    >>> fits = [{"backend": "jax", "model": "mlp", "workers": workers, "variant": "keras_mwms",
    ...          "global_batch": batch, "steps_per_second": speed}
    ...         for workers, batch, speed in ((1, 128, 50.0), (2, 256, 1 / 0.030))]
    >>> section = analyse([gang], fits, config, {"cores": 2, "loopback_tcp_bytes_per_second": 4e9}, 1)
    >>> engine = section["engines"]["jax"]
    >>> round(engine["alpha_us"], 1), round(engine["beta_ns"], 3)
    (100.0, 1.0)
    >>> point = section["measured"][0]   # 20 ms + 2 x 100 us + 0.34 MB of gradients at 1 ns/B
    >>> round(point["measured_efficiency"], 3), round(point["predicted_ms"], 2), round(point["error_percent"], 1)
    (0.667, 20.54, -31.5)
    >>> [(row["workers"], round(row["efficiency"], 2)) for row in section["projection"][:2]]
    [(8, 0.9), (16, 0.83)]
    >>> print(text(section).splitlines()[0])
    scaling sweep, weak scaling at 128 examples per worker: n=2: 2 processes x 1 thread(s) = 2 on 2 cores
    """
    cores = machine["cores"]
    loopback = machine["loopback_tcp_bytes_per_second"]
    engines = fit_engines(_allreduce_by_count(gangs, loopback), threads, cores)
    counts = worker_counts(config)
    return {
        "cores": cores, "threads_per_process": threads, "worker_counts": list(counts),
        "per_worker_batch": per_worker_batch(config),
        "oversubscription": [{"workers": n, "threads": n * threads,
                              "factor": cost_model.oversubscription(n, threads, cores)} for n in counts],
        "engines": engines,
        "measured": _measured_rows(fits, config, engines, threads, cores),
        "projection": _projection_rows(fits, config, engines, loopback),
        "plot_projection": _projection_rows(fits, config, engines, loopback, workers=PLOT_WORKERS),
        "link_gbits": list(cost_model.LINK_GBITS),
        "assumptions": ASSUMPTIONS,
    }


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{value:+.0f}%"


def text(section: dict) -> str:
    """The scaling tables as printed on stdout (example: `analyse`)."""
    cores, threads = section["cores"], section["threads_per_process"]
    loads = ", ".join(
        f"n={entry['workers']}: {entry['workers']} processes x {threads} thread(s) = {entry['threads']} on "
        f"{cores} cores" + (f" (OVERSUBSCRIBED {entry['factor']:.2g}x)" if entry["factor"] > 1 else "")
        for entry in section["oversubscription"])
    parts = [f"scaling sweep, weak scaling at {section['per_worker_batch']} examples per worker: {loads}"]
    engines = section["engines"]
    body = []
    for backend, engine in engines.items():
        if "alpha_us" not in engine:
            body.append([backend, None, None, None, None, f"no fit: {engine['error']}", None])
            continue
        by_count = {}
        for check in engine["checks"]:
            by_count.setdefault(check["workers"], []).append(abs(check["error_percent"]))
        errors = "; ".join(f"n={n}: mean {sum(values) / len(values):.0f}%, max {max(values):.0f}%"
                           for n, values in sorted(by_count.items()))
        body.append([backend, engine["alpha_us"], engine["beta_ns"], engine["effective_gbps"],
                     ",".join(str(n) for n in engine["fitted_from"]), errors, engine["samples"]])
    if body:
        parts.append("alpha-beta fit of the all-reduce (ring: 2(n-1)·alpha + 2(n-1)/n·bytes·beta), and its "
                     "|error| on every measured all-reduce row:\n" + format_table(
                         ["backend", "alpha us", "beta ns/B", "1/beta GB/s", "fitted from n", "all-reduce |error|",
                          "rows"], body))
    measured = section["measured"]
    if measured:
        body = [[row["backend"], row["model"], row["workers"], f"{row['oversubscription']:.2g}x",
                 row["compute_ms"], row["measured_ms"], f"{100 * row['measured_efficiency']:.0f}%",
                 row.get("serial_ms"), _percent(row.get("serial_error_percent")), row.get("overlapped_ms"),
                 _percent(row.get("overlapped_error_percent")), row["form"]] for row in measured]
        parts.append(
            "measured vs the model at the measured points (compute = one process on the per-worker batch, "
            "x oversubscription; efficiency = compute / step):\n" + format_table(
                ["backend", "model", "n", "oversub", "compute ms", "step ms", "efficiency", "C+A ms", "error",
                 "max(C,A) ms", "error", "projected as"], body))
    projection = section["projection"]
    if projection:
        counts = sorted({row["workers"] for row in projection})
        groups: dict[tuple, dict[int, dict]] = {}
        for row in projection:
            groups.setdefault((row["backend"], row["model"], row["form"], row["link_gbits"]), {})[row["workers"]] = row
        body = [[backend, model, form, f"{gbits:g} Gbit/s", *(
            f"{cells[n]['step_ms']:.1f} ({100 * cells[n]['efficiency']:.0f}%)" for n in counts)]
            for (backend, model, form, gbits), cells in groups.items()]
        parts.append("projected step ms (weak-scaling efficiency), one worker per machine, ring all-reduce:\n"
                     + format_table(["backend", "model", "step", "link", *(f"n={n}" for n in counts)], body))
    parts.append(f"model: {section['assumptions']}")
    return "\n\n".join(parts)


def write_plot(section: dict, description: str, out_dir: Path) -> Path | None:
    """Writes `scaling.png`: per backend, step time and efficiency against workers; None if nothing to plot.

    Example (nothing measured, nothing drawn):

    >>> write_plot({"plot_projection": []}, "this machine", Path("."))
    """
    backends = sorted({row["backend"] for row in section["plot_projection"]},
                      key=lambda name: ("tensorflow", "jax", "torch").index(name) if name in
                      ("tensorflow", "jax", "torch") else 9)
    if not backends:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot, ticker

    figure, axes = pyplot.subplots(2, len(backends), figsize=(5 * len(backends), 9), squeeze=False)
    styles = {"mlp": ("-", "o"), "conv": ("--", "s")}
    colors = {gbits: f"C{number}" for number, gbits in enumerate(section["link_gbits"])}
    for column, backend in enumerate(backends):
        time_axis, efficiency_axis = axes[0][column], axes[1][column]
        for model in sorted({row["model"] for row in section["plot_projection"] if row["backend"] == backend}):
            line, marker = styles.get(model, (":", "^"))
            for gbits in section["link_gbits"]:
                points = [row for row in section["plot_projection"] if row["primary"]
                          and (row["backend"], row["model"], row["link_gbits"]) == (backend, model, gbits)]
                label = f"{model}, {gbits:g} Gbit/s (projected)"
                time_axis.plot([row["workers"] for row in points], [row["step_ms"] for row in points], line,
                               color=colors[gbits], label=label)
                efficiency_axis.plot([row["workers"] for row in points], [row["efficiency"] for row in points],
                                     line, color=colors[gbits], label=label)
            measured = [row for row in section["measured"] if (row["backend"], row["model"]) == (backend, model)]
            if measured:
                counts = [row["workers"] for row in measured]
                time_axis.plot(counts, [row["measured_ms"] for row in measured], marker, color="black",
                               linestyle="none", label=f"{model}, measured here")
                efficiency_axis.plot(counts, [row["measured_efficiency"] for row in measured], marker,
                                     color="black", linestyle="none", label=f"{model}, measured here")
                if all("predicted_ms" in row for row in measured):
                    time_axis.plot(counts, [row["predicted_ms"] for row in measured], line, marker="x",
                                   color="gray", label=f"{model}, model here (loopback, oversubscribed)")
                    efficiency_axis.plot(counts, [row["predicted_efficiency"] for row in measured], line,
                                         marker="x", color="gray",
                                         label=f"{model}, model here (loopback, oversubscribed)")
        form = "max(C, A)" if backend in OVERLAPPED else "C + A"
        time_axis.set_title(f"{backend}: step time = {form}", fontsize=10)
        time_axis.set_ylabel("step time (ms)")
        time_axis.set_yscale("log")
        efficiency_axis.set_ylabel("weak-scaling efficiency")
        efficiency_axis.set_ylim(0, 1.05)
        time_axis.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        time_axis.yaxis.set_minor_formatter(ticker.NullFormatter())
        for axis in (time_axis, efficiency_axis):
            axis.set_xscale("log", base=2)
            axis.set_xticks(PLOT_WORKERS, [str(count) for count in PLOT_WORKERS])
            axis.set_xlabel("workers")
            axis.grid(True, which="both", alpha=0.3)
    handles, labels = axes[1][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    figure.suptitle(f"keras_mwms scaling: alpha-beta model fitted here, projected\n(weak scaling, "
                    f"{section['per_worker_batch']} examples per worker; measured on {description})", fontsize=9)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    path = out_dir / "scaling.png"
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
