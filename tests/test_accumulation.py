"""Gradient accumulation (`gradient_accumulation_steps=K`) with real 2-worker gangs.

Per backend one run of `tests/workers/fit_scenario.py` as a gang of 2 on localhost serves two
scenarios in the same processes, and the same scenarios run alongside as one process without
TF_CONFIG (the reference):

* `k2`: SGD with momentum, K = 2;
* `k3`: Adam, K = 3, so accumulation windows straddle the epoch boundary;
* `k3fits`: SGD, K = 3, two `fit` calls of one epoch (7 micro-steps each): the first fit ends
  mid-window and the second goes on with it, as one process does.

Both on 200 rows in global batches of 31: full batches split 16/15 between the workers and a
short last batch of 14 rows, so the row weighting of uneven micro-batches is exercised (one
process weighs each micro-batch's mean gradient alike, `(g_1 + … + g_K) / K`). The tests assert
workers bit-identical, within 1e-5 of one process, the same optimizer step count, and, where
the backend all-reduces once per optimizer step (torch, the JAX flat path), the ledger's count
of gradient all-reduces: one per K micro-steps on every backend, beside one small all-reduce
per micro-step (on TensorFlow inside the step's graph, not counted one by one).

The JAX gang also runs two DataParallel-path scenarios (`k2_batchnorm`: BatchNormalization with
global moments; `k2_custom_step`: a custom `train_step`), K = 2: its step runs in `shard_map`,
a micro-step's program has no gradient collective and the K-th's is counted when it runs.

A TensorFlow worker with several local replicas (GPUs) is checked in one process over two
logical CPU devices (`tests/workers/tf_local_replicas.py`): TF's multi-worker strategy takes
local replicas from GPUs only, and no GPU machine here has TensorFlow.
"""

from __future__ import annotations

import json
import os
import shlex

import pytest

from keras_mwms.backends.compression import relative_rounding
from tests.multiworker import python_worker, run_one_process, worker_env
from tests.shared_gangs import SHARED, SINGLE, Runner, gang
from tests.workers.common import max_weight_difference
from tests.workers.fit_scenario import load_dump

RUN_TIMEOUT = 300          # gang + reference of one backend; ~25-45 s alone on 2 cores (k2_jit: 270 s)
TOLERANCE = 1e-5
BASE = ["--verbose", "0", "--seed", "100", "--rows", "200", "--batch-size", "31"]
SCENARIOS = {"k2": ["--accumulation", "2"], "k3": ["--accumulation", "3", "--optimizer", "adam"],
             "k3fits": ["--accumulation", "3", "--epochs", "1", "--fits", "2"]}
# JAX's DataParallel path (BatchNormalization with global moments, a custom train_step): the
# gang of the same run, the batches of 31 rows replicated over the devices, the last (14) sharded.
DATA_PARALLEL = {"k2_batchnorm": ["--accumulation", "2", "--batch-norm", "local"],
                 "k2_custom_step": ["--accumulation", "2", "--custom-train-step"]}
# torch's compiled step (`jit_compile=True`): Keras' torch.compile'd train step, the window's
# all-reduce after backward (`gradients.averaged_eagerly`), in the same gang; fit only (compiling
# the test and predict steps, twice each for the short last batch, was a quarter of its CPU).
COMPILED = {"k2_jit": ["--accumulation", "2", "--jit-compile", "--evaluate-on", "none"]}
STEPS = {"k2": 2, "k3": 3, "k3fits": 3, "k2_batchnorm": 2, "k2_custom_step": 2, "k2_jit": 2}
FITS = {"k3fits": 2}        # fit calls per scenario (default 1)
MICRO_STEPS = 14           # 2 epochs of ceil(200 / 31) = 7 batches
BACKENDS = [pytest.param("tensorflow", marks=pytest.mark.tensorflow),
            pytest.param("jax", marks=pytest.mark.jax),
            pytest.param("torch", marks=pytest.mark.torch)]


def _scenarios(backend: str) -> dict:
    return {**SCENARIOS, **{"jax": DATA_PARALLEL, "torch": COMPILED}.get(backend, {})}


def _argv(backend: str) -> list[str]:
    scenarios = [part for name, flags in _scenarios(backend).items()
                 for part in ("--scenario", f"{name}: {shlex.join(flags)}")]
    return ["{out}", *BASE, *scenarios]


# The backend's gang of 2 and its one-process reference: the shared warm processes
# (`tests/shared_gangs.py`), every scenario one after another in each.
for _backend in ("tensorflow", "jax", "torch"):
    for _runner in (gang(_backend, 2), Runner(_backend, SINGLE)):
        SHARED.add(__name__, _runner, "scenarios", "fit_scenario", _argv(_backend), seconds=RUN_TIMEOUT)


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, shared_runs):
    """The backend's folders: {"gang": ..., "reference": ...}, each with a folder per scenario."""
    backend = request.param
    return backend, {"gang": shared_runs.folder(gang(backend, 2), __name__, "scenarios"),
                     "reference": shared_runs.folder(Runner(backend, SINGLE), __name__, "scenarios")}


def _dump(folders, run: str, name: str, index: int) -> dict:
    return load_dump(os.path.join(folders[run], name), index)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS) + list(DATA_PARALLEL) + list(COMPILED))
def test_accumulating_workers_match_one_process(runs, name):
    backend, root = runs
    if name not in _scenarios(backend):
        pytest.skip(f"{name}: a JAX DataParallel or a torch compiled scenario")
    first, second = _dump(root, "gang", name, 0), _dump(root, "gang", name, 1)
    reference = _dump(root, "reference", name, 0)
    assert first["batches"] == reference["batches"] == [7, 7], (backend, name)
    assert max_weight_difference(first["final"], second["final"]) == 0.0, (backend, name)
    assert first["history"] == second["history"], (backend, name)
    assert first["optimizer_iterations"] == reference["optimizer_iterations"] == MICRO_STEPS // STEPS[name]
    delta = max_weight_difference(first["final"], reference["final"])
    print(f"{backend} {name}: max |Δw| vs one process {delta:.3g}")
    assert delta <= TOLERANCE, (backend, name, delta)
    for key, values in reference["history"].items():   # global metrics in the logs
        assert first["history"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), (backend, name, key)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS) + list(DATA_PARALLEL) + list(COMPILED))
def test_gradients_are_all_reduced_once_per_optimizer_step(runs, name):
    backend, root = runs
    if name not in _scenarios(backend):
        pytest.skip(f"{name}: a JAX DataParallel or a torch compiled scenario")
    counts = _dump(root, "gang", name, 0)["fit_collectives"]
    updates = MICRO_STEPS // STEPS[name]
    assert counts.get("gradient all-reduce") == updates, (backend, name, counts)
    if name in COMPILED:   # its logs are made global apart from the rows (`metrics.global_logs`)
        # Keras' accumulation branch stays compiled: no function left eager after recompile_limit
        # (before `torch-accumulation-cond-compiled`: Keras' `ops.cond`, at every micro-step).
        hits = [_dump(root, run, name, 0)["recompile_limit_hits"] for run in ("gang", "reference")]
        assert hits == [0, 0], (backend, name, hits)
        return
    if backend == "tensorflow" or name in DATA_PARALLEL:
        # The window all-reduce is counted when it runs (TF: from the graph; JAX DataParallel:
        # a micro-step's program has no gradient collective); the step's small collectives (row
        # count; BatchNormalization moments, metric states) live in its compiled step, where
        # the ledger sees the step only.
        assert counts.get("train step (in-graph collectives)") == MICRO_STEPS, (backend, name, counts)
        assert sum(counts.values()) <= MICRO_STEPS + updates + _set_up_collectives(name), (backend, name, counts)
        return
    # Each micro-step: one small all-reduce (rows, metric states); else only fit's own set-up.
    assert counts.get("row all-reduce") == MICRO_STEPS, (backend, name, counts)
    assert sum(counts.values()) <= MICRO_STEPS + updates + _set_up_collectives(name), (backend, name, counts)


def _set_up_collectives(name: str) -> int:
    """The bound on collectives that are not per micro-step: fit's own set-up, and two per fit:
    the end-of-fit check that the workers agree (`keras_mwms.backends.consistency`) and the
    callbacks' "does any worker save checkpoints?" (`keras_mwms.callbacks.agreement`)."""
    return 10 + 2 * FITS.get(name, 1)


@pytest.mark.tensorflow
def test_tensorflow_local_replicas_accumulate_and_compress():
    """Two local replicas (logical CPUs): K = 2 all-reduces once per window, = one device
    (≤ 1e-5); bf16 halves the window's bytes, with and without accumulation, within the
    16-bit rounding bound (`tests/test_compression.py`'s, C = 4)."""
    output = run_one_process(python_worker("tf_local_replicas.py"), RUN_TIMEOUT, env=worker_env("tensorflow", lean=True))
    report = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert report["replicas"] == 2
    micro_steps = 12                      # 2 epochs of 192 rows in global batches of 32
    for name in ("k2", "k2_bf16"):
        run = report[name]
        assert run["iterations"] == micro_steps // 2, (name, run)
        assert run["kinds"] == {"gradient all-reduce": micro_steps // 2}, (name, run)
    assert report["k2"]["delta"] <= TOLERANCE, report["k2"]
    # The window (161 float32 gradients, 644 bytes) every 2nd micro-step, and the traced row count.
    assert report["k2"]["wire"] == 644 / 2 + 4 and report["k2_bf16"]["wire"] == 322 / 2 + 4, report
    assert report["bf16"]["wire"] == 322 + 4, report["bf16"]   # every step, in 16 bits
    for name in ("k2_bf16", "bf16"):
        run, bound = report[name], 4 * 2 * relative_rounding("bf16") * report[name]["path"]
        print(f"tensorflow local replicas {name}: max |Δw| {run['delta']:.3g} vs one device, bound {bound:.3g}")
        assert 1e-5 < run["delta"] <= bound, (name, run, bound)


# -- pure rules (no processes) -----------------------------------------------------------------
def test_which_optimizers_accumulate_with_one_all_reduce_per_optimizer_step():
    import keras

    from keras_mwms.backends.policy import accumulation_steps

    assert accumulation_steps(keras.optimizers.Adam(gradient_accumulation_steps=3)) == 3
    assert accumulation_steps(keras.optimizers.Adam()) == 0
    wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))
    assert accumulation_steps(wrapped) == 0   # decides overflow on every micro-step's global gradient


def test_benchmark_accumulation_rows_and_arguments():
    from keras_mwms.benchmark import accumulation

    assert accumulation.build_parser("bench").parse_args(["--k", "4,1,4"]).k == [1, 4]
    with pytest.raises(SystemExit):
        accumulation.build_parser("bench").parse_args(["--k", "0"])
    measured = [{"k": k, "micro_steps": 8, "optimizer_steps": 8 // k, "seconds_per_micro_step": seconds,
                 "collectives": {"gradient all-reduce": 8 // k, "row all-reduce": 8},
                 "engine_bytes_per_micro_step": 400 / k, "parameters": 100}
                for k, seconds in ((1, 0.02), (4, 0.01), (1, 0.03))]   # the best repeat counts
    rows = accumulation.rows_for("jax", measured)
    assert rows == [["jax", 1, 20.0, 1.0, "1.00", 2.0, 400], ["jax", 4, 10.0, 2.0, "1.00", 1.25, 100]]
    in_graph = [dict(row, collectives={"train step (in-graph collectives)": 8}) for row in measured]
    assert accumulation.rows_for("tensorflow", in_graph)[1][4] == "in-graph"
