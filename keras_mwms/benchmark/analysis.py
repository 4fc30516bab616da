"""From the workers' raw JSON to the report's rows: fits, ratios, sync overhead, all-reduce.

Definitions (also printed under the tables):

* steps/s of a variant: the best of its repeats, read on worker 0 (steps are synchronous, so
  every worker runs at the same rate); examples/s = steps/s × global batch.
* ratio = keras_mwms steps/s ÷ the native peer's steps/s, same backend, model, worker count and
  global batch; ≥ 1.0 means keras_mwms is at least as fast.
* one-process ratio: the same ratio with one process on the same global batch — what the
  frameworks cost per step before any distribution (on torch, Keras' trainer vs a bare loop).
  distribution ratio = ratio ÷ one-process ratio: how keras_mwms' distribution compares with
  the peer's once that single-process difference is divided out (≥ 1.0: ours costs no more).
* one worker of keras_mwms ÷ plain Keras, one process (`one_process_rows`): keras_mwms' fit
  with a one-worker strategy vs the same model in plain Keras 3 on the same backend, same
  process and global batch — what keras_mwms costs before there is anything to distribute.
* threads: every process, also the single one, gets cores ÷ N threads — the compute of one of
  the N workers — so one process vs N workers is a scaling comparison at equal per-process
  resources (oversubscribed or contended cores distort multi-threaded runs badly on a shared box).
* sync overhead per step = step time with N workers − step time of one process on one worker's
  share of the global batch (global batch ÷ N, same threads): what a step costs beyond the
  worker's own compute. Compared with the raw all-reduce time of the gradient bytes on the same
  engine (the "gradients:<model>" all-reduce row).
* graph breaks (torch.compile'd variants): TorchDynamo's graph breaks during the fit, the
  most of the repeats (`keras_mwms.benchmark.graph_breaks`); 0: the step compiles whole.
* start-up: from the driver launching the worker process to the end of its first training step
  (imports, cluster join, build, compile, trace, one step); only for the first variant of a
  process — variants sharing a process report their own set-up-to-first-step time instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from keras_mwms.benchmark.allreduce import summarize
from keras_mwms.benchmark.peers import JAX_DATA_PARALLEL, KERAS3_TF_DISTRIBUTE, PEERS
from keras_mwms.benchmark.torch_variants import OURS_JIT, PLAIN_KERAS

OURS = "keras_mwms"
NO_LEDGER = "keras_mwms no-ledger"


def _ok_gangs(gangs: Sequence[dict]) -> list[dict]:
    return [gang for gang in gangs if gang.get("ok") and gang.get("results")]


def _chief(gang: dict) -> dict:
    return min(gang["results"], key=lambda result: result["worker_index"])


def fit_rows(gangs: Sequence[dict]) -> list[dict]:
    """One row per (backend, model, workers, variant): best steps/s over repeats and start-up.

    Example:

    >>> fit = {"variant": "keras_mwms", "model": "mlp", "repeat": 0, "steps_per_second": 10.0,
    ...        "examples_per_second": 640.0, "first_step_seconds": 1.0, "timed_steps": 5,
    ...        "global_batch": 64, "startup_seconds": 9.0}
    >>> gang = {"ok": True, "backend": "torch", "workers": 2, "results": [
    ...     {"worker_index": 0, "threads": 1, "fits": [fit]},
    ...     {"worker_index": 1, "threads": 1, "fits": [dict(fit, startup_seconds=9.5)]}]}
    >>> row = fit_rows([gang])[0]
    >>> row["steps_per_second"], row["startup_seconds"], row["threads"]
    (10.0, 9.5, 1)
    """
    rows: dict[tuple, dict] = {}
    for gang in _ok_gangs(gangs):
        chief = _chief(gang)
        for position, fit in enumerate(chief.get("fits", [])):
            startups = [result["fits"][position].get("startup_seconds") for result in gang["results"]
                        if len(result.get("fits", [])) > position]
            startups = [value for value in startups if value is not None]
            key = (gang["backend"], fit["model"], gang["workers"], fit["variant"], fit["global_batch"])
            row = rows.setdefault(key, {
                "backend": gang["backend"], "model": fit["model"], "workers": gang["workers"],
                "variant": fit["variant"], "global_batch": fit["global_batch"], "threads": chief["threads"],
                "steps_per_second": 0.0,
                "examples_per_second": 0.0, "all_steps_per_second": [], "first_step_seconds": None,
                "startup_seconds": None, "graph_breaks": None, "recompile_limit_hits": None,
            })
            for key in ("graph_breaks", "recompile_limit_hits"):   # torch.compile'd variants
                if fit.get(key) is not None:
                    row[key] = max(row[key] or 0, fit[key])
            row["all_steps_per_second"].append(fit["steps_per_second"])
            if fit["steps_per_second"] > row["steps_per_second"]:
                row["steps_per_second"] = fit["steps_per_second"]
                row["examples_per_second"] = fit["examples_per_second"]
            if row["first_step_seconds"] is None:
                row["first_step_seconds"] = fit["first_step_seconds"]
            if startups and row["startup_seconds"] is None:
                row["startup_seconds"] = max(startups)
    return list(rows.values())


def allreduce_tables(gangs: Sequence[dict], link_bandwidth: float) -> dict[str, list[dict]]:
    """Per backend: the merged all-reduce rows of its keras_mwms multi-worker gang."""
    tables = {}
    for gang in _ok_gangs(gangs):
        if gang["workers"] < 2 or gang["role"] != OURS:
            continue
        per_worker = [result["allreduce"] for result in sorted(gang["results"], key=lambda r: r["worker_index"])
                      if result.get("allreduce")]
        if per_worker:
            tables[gang["backend"]] = summarize(per_worker, gang["workers"], link_bandwidth)
    return tables


def _index(rows: Sequence[dict]) -> dict[tuple, dict]:
    return {(row["backend"], row["model"], row["workers"], row["variant"], row["global_batch"]): row
            for row in rows}


def ratio_rows(fits: Sequence[dict], overhead: Sequence[dict] = ()) -> list[dict]:
    """keras_mwms ÷ each native peer, per backend, model and worker count.

    Each row also carries keras_mwms' graph breaks and, from `overhead` (`overhead_rows`), its
    sync overhead per step and that overhead ÷ one raw all-reduce of the gradient bytes.

    Example:

    >>> fits = [{"backend": "torch", "model": "mlp", "workers": 2, "variant": "keras_mwms",
    ...          "global_batch": 64, "steps_per_second": 30.0, "startup_seconds": 9.0,
    ...          "first_step_seconds": 1.0},
    ...         {"backend": "torch", "model": "mlp", "workers": 2, "variant": "torch DDP loop",
    ...          "global_batch": 64, "steps_per_second": 40.0, "startup_seconds": None,
    ...          "first_step_seconds": 0.1}]
    >>> [(row["peer"], row["ratio"]) for row in ratio_rows(fits)]
    [('torch DDP loop', 0.75)]
    >>> one = [dict(row, workers=1, steps_per_second=row["steps_per_second"] * 2) for row in fits]
    >>> one[1]["steps_per_second"] = 100.0
    >>> row = [row for row in ratio_rows(fits + one) if row["workers"] == 2][0]
    >>> row["one_process_ratio"], row["distribution_ratio"]
    (0.6, 1.25)
    """
    index = _index(fits)
    syncs = {(row["backend"], row["model"], row["workers"], row["variant"], row["global_batch"]): row
             for row in overhead}
    rows = []
    for (backend, model, workers, variant, batch), ours in sorted(index.items()):
        sync = syncs.get((backend, model, workers, variant, batch), {})
        if variant not in (OURS, OURS_JIT):   # keras_mwms eager, and with jit_compile (torch)
            continue
        for peer in PEERS.get(backend, ()):
            theirs = index.get((backend, model, workers, peer, batch))
            if theirs is None or (variant == OURS_JIT and peer == PLAIN_KERAS):   # eager baseline
                continue
            ours_one = index.get((backend, model, 1, variant, batch))
            theirs_one = index.get((backend, model, 1, peer, batch))
            one_process_ratio = (ours_one["steps_per_second"] / theirs_one["steps_per_second"]
                                 if workers > 1 and ours_one and theirs_one else None)
            ratio = ours["steps_per_second"] / theirs["steps_per_second"]
            rows.append({
                "backend": backend, "model": model, "workers": workers, "global_batch": batch, "peer": peer,
                "ours": variant, "keras_mwms_steps_per_second": ours["steps_per_second"],
                "peer_steps_per_second": theirs["steps_per_second"],
                "ratio": ratio,
                "one_process_ratio": one_process_ratio,
                "distribution_ratio": ratio / one_process_ratio if one_process_ratio else None,
                "keras_mwms_startup_seconds": ours.get("startup_seconds"),
                "peer_startup_seconds": theirs.get("startup_seconds"),
                "keras_mwms_first_step_seconds": ours.get("first_step_seconds"),
                "peer_first_step_seconds": theirs.get("first_step_seconds"),
                "graph_breaks": ours.get("graph_breaks"),
                "recompile_limit_hits": ours.get("recompile_limit_hits"),
                "sync_overhead_ms": sync.get("sync_overhead_ms"),
                "overhead_vs_allreduce": sync.get("overhead_vs_allreduce"),
            })
    return rows


# Plain Keras in one process, per backend: the fit keras_mwms' one worker must cost nothing over.
PLAIN_KERAS_ONE_PROCESS = {"tensorflow": KERAS3_TF_DISTRIBUTE, "jax": JAX_DATA_PARALLEL, "torch": PLAIN_KERAS}


def one_process_rows(fits: Sequence[dict]) -> list[dict]:
    """One worker of keras_mwms ÷ plain Keras, one process, per backend, model and batch.

    The plain-Keras variant of each backend with one process (no strategy, no distribution):
    TensorFlow's `keras3+tf.distribute` and JAX's `keras.DataParallel` peers, which then run
    plain Keras 3, and torch's `plain Keras`; both fits in the same process, interleaved.

    Example:

    >>> fits = [{"backend": "jax", "model": "mlp", "workers": 1, "variant": variant,
    ...          "global_batch": 64, "steps_per_second": speed}
    ...         for variant, speed in (("keras_mwms", 45.0), ("keras.DataParallel", 50.0))]
    >>> [(row["plain"], row["ratio"]) for row in one_process_rows(fits)]
    [('keras.DataParallel', 0.9)]
    """
    index = _index(fits)
    rows = []
    for (backend, model, workers, variant, batch), ours in sorted(index.items()):
        plain = index.get((backend, model, 1, PLAIN_KERAS_ONE_PROCESS.get(backend), batch))
        if variant != OURS or workers != 1 or plain is None:
            continue
        rows.append({"backend": backend, "model": model, "global_batch": batch, "plain": plain["variant"],
                     "keras_mwms_steps_per_second": ours["steps_per_second"],
                     "plain_steps_per_second": plain["steps_per_second"],
                     "ratio": ours["steps_per_second"] / plain["steps_per_second"]})
    return rows


def ledger_rows(fits: Sequence[dict]) -> list[dict]:
    """steps/s with the collective ledger on (keras_mwms) and off, per backend, model, workers.

    Example:

    >>> fits = [{"backend": "jax", "model": "mlp", "workers": 2, "variant": variant,
    ...          "global_batch": 64, "steps_per_second": speed}
    ...         for variant, speed in (("keras_mwms", 49.0), ("keras_mwms no-ledger", 50.0))]
    >>> [(row["model"], row["slower_percent"]) for row in ledger_rows(fits)]
    [('mlp', 2.0)]
    """
    index = _index(fits)
    rows = []
    for (backend, model, workers, variant, batch), on in sorted(index.items()):
        off = index.get((backend, model, workers, NO_LEDGER, batch))
        if variant != OURS or off is None:
            continue
        rows.append({"backend": backend, "model": model, "workers": workers, "global_batch": batch,
                     "ledger_on_steps_per_second": on["steps_per_second"],
                     "ledger_off_steps_per_second": off["steps_per_second"],
                     "slower_percent": round(100.0 * (1 - on["steps_per_second"] / off["steps_per_second"]), 2)})
    return rows


def overhead_rows(fits: Sequence[dict], allreduce: dict[str, list[dict]], workers: int) -> list[dict]:
    """Per backend, model and variant: sync overhead per step vs the gradient all-reduce time.

    Example:

    >>> fits = [{"backend": "torch", "model": "mlp", "workers": 1, "variant": "keras_mwms",
    ...          "global_batch": 32, "steps_per_second": 50.0},
    ...         {"backend": "torch", "model": "mlp", "workers": 2, "variant": "keras_mwms",
    ...          "global_batch": 64, "steps_per_second": 40.0}]
    >>> table = {"torch": [{"label": "gradients:mlp", "bytes": 400, "time_us": 4000.0}]}
    >>> row = overhead_rows(fits, table, 2)[0]
    >>> round(row["sync_overhead_ms"], 3), row["allreduce_ms"], round(row["overhead_vs_allreduce"], 3)
    (5.0, 4.0, 1.25)
    """
    index = _index(fits)
    rows = []
    for (backend, model, count, variant, batch), multi in sorted(index.items()):
        single = index.get((backend, model, 1, variant, batch // workers))
        if count != workers or single is None:
            continue
        gradient = next((row for row in allreduce.get(backend, []) if row["label"] == f"gradients:{model}"),
                        None)
        single_ms = 1000.0 / single["steps_per_second"]
        multi_ms = 1000.0 / multi["steps_per_second"]
        overhead = multi_ms - single_ms
        allreduce_ms = gradient["time_us"] / 1000.0 if gradient else None
        rows.append({
            "backend": backend, "model": model, "workers": count, "variant": variant,
            "global_batch": batch, "step_ms_share": single_ms, "step_ms_workers": multi_ms, "sync_overhead_ms": overhead,
            "gradient_bytes": gradient["bytes"] if gradient else None, "allreduce_ms": allreduce_ms,
            "overhead_vs_allreduce": overhead / allreduce_ms if allreduce_ms else None,
        })
    return rows
