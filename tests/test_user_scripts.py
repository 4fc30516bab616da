"""Scripts written the way Keras users write them: 2 workers vs one process of plain Keras.

`tests/workers/user_scripts.py` runs every variant (functional dict inputs, sample and class
weights, validation split, EarlyStopping + ReduceLROnPlateau, chief-only save and reload,
Embedding + LSTM, clipnorm / clipvalue / global_clipnorm, weight decay, EMA, gradient
accumulation, loss scaling, the custom `train_step` of each backend's Keras guide, generators,
shuffled PyDatasets, evaluate/predict on sizes that do not divide the batch, ...) in one gang
of 2 workers per backend, and once more with `--plain` in one process of plain Keras (no
keras_mwms imported), and once as one keras_mwms worker without TF_CONFIG (which must behave
like plain Keras). Every assertion reads the dumps of those three runs.

Tolerance: every variant trains at most 24 steps, where the reduction-order noise of a 2-worker
all-reduce stays below 1e-6 even under Adam (4e-8 measured after 20 steps);
`WEIGHT_TOLERANCE` leaves a margin of 10×.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.multiworker import REPO, python_worker, run_gang, worker_env

sys.path.insert(0, str(REPO / "tests" / "workers"))
import common  # noqa: E402

GANG_TIMEOUT = 600
WEIGHT_TOLERANCE = 1e-5
HISTORY_TOLERANCE = 1e-5
# Variants whose reference is not one process of the same script, by construction.
NOT_COMPARED_WITH_ONE_PROCESS = {
    # Each worker shuffles with its own seed: one process cannot do that; a warning is the contract.
    "tfdata_worker_seeds",
    # float16 at the edge of overflow: a worker's shard rounds differently from one process's
    # whole batch, so a step one process finds inf may be finite on workers (or the reverse),
    # measured on all three backends. Workers still agree (weights, loss scale, logs).
    "mixed_float16_overflow",
}
# float16/bfloat16 compute: weights and logs differ from one process by float16 rounding of
# shard-sized sums (measured: mixed_float16 ≤ 4e-5, mixed_bfloat16 ≤ 3e-3).
MIXED_PRECISION_TOLERANCE = {"mixed_float16": 5e-4, "mixed_bfloat16": 2e-2}
# Known, open: on TensorFlow an infinite Python generator read by TF's prefetching iterators
# sometimes loses batches under the multi-worker strategy: 0.08–0.10 from plain Keras in 3 of
# about 10 runs of this script, never when the variant runs alone (the row ledger's finite
# generator has always been exact). Workers still agree; README "Known gaps" says so.
RACY_WITH_ONE_PROCESS = {("tensorflow", "generator")}
# Logs a custom train_step updates once per step (Keras' guide: `loss_tracker.update_state(loss)`)
# weigh each torch worker's value equally on steps whose global batch splits unevenly, where one
# process weighs rows: known, warned, and checked by the strict xfail below. (TF scales each
# replica's loss so that they agree; torch does not yet.)
KNOWN_LOG_DIFFERENCES = {("torch", "custom_train_step"): {"loss"}}
# Variants run a second time on a gang of 3 workers (a global batch of 16 splits 6/5/5).
THREE_WORKER_VARIANTS = ["sgd_arrays"]
BACKENDS = [pytest.param(name, marks=getattr(pytest.mark, name)) for name in ("tensorflow", "jax", "torch")]


def _variants() -> list[str]:
    source = (REPO / "tests" / "workers" / "user_scripts.py").read_text()
    return sorted(line[len("def variant_"):line.index("(")] for line in source.splitlines()
                  if line.startswith("def variant_"))


VARIANTS = _variants()


class Runs:
    """One backend's gang (2 workers), single-worker and plain-Keras reference dumps."""

    def __init__(self, backend: str, gang_dir: str, reference_dir: str, single_dir: str, output: str):
        self.backend, self.gang_dir, self.reference_dir, self.output = backend, gang_dir, reference_dir, output
        self.single_dir = single_dir

    def result(self, variant: str, worker: int) -> dict:
        return common.load_result(os.path.join(self.gang_dir, variant), worker)

    def reference(self, variant: str) -> dict:
        return common.load_result(os.path.join(self.reference_dir, variant), 0)

    def weights(self, variant: str, worker: int) -> list:
        return common.load_weights(os.path.join(self.gang_dir, variant), worker)

    def reference_weights(self, variant: str) -> list:
        return common.load_weights(os.path.join(self.reference_dir, variant), 0)

    def single(self, variant: str) -> dict:
        return common.load_result(os.path.join(self.single_dir, variant), 0)

    def single_weights(self, variant: str) -> list:
        return common.load_weights(os.path.join(self.single_dir, variant), 0)


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory) -> Runs:
    backend = request.param
    gang_dir = str(tmp_path_factory.mktemp(f"{backend}_gang"))
    reference_dir = str(tmp_path_factory.mktemp(f"{backend}_plain"))
    single_dir = str(tmp_path_factory.mktemp(f"{backend}_single"))
    env = dict(os.environ, **worker_env(backend))
    env.pop("TF_CONFIG", None)
    for out, flags in ((reference_dir, ["--plain"]), (single_dir, [])):
        alone = subprocess.run(python_worker("user_scripts.py", out, *flags), env=env,
                               capture_output=True, text=True, timeout=GANG_TIMEOUT)
        assert alone.returncode == 0, alone.stdout[-4000:] + alone.stderr[-4000:]
    gang = run_gang(python_worker("user_scripts.py", gang_dir), 2, GANG_TIMEOUT, env=worker_env(backend))
    assert gang.returncode == 0, gang.output[-8000:]
    return Runs(backend, gang_dir, reference_dir, single_dir, gang.output)


@pytest.fixture(scope="module")
def three_workers(runs, tmp_path_factory) -> Runs:
    """A second gang, of 3 workers, running only `THREE_WORKER_VARIANTS` (uneven splits)."""
    gang_dir = str(tmp_path_factory.mktemp(f"{runs.backend}_gang3"))
    command = python_worker("user_scripts.py", gang_dir, "--only", ",".join(THREE_WORKER_VARIANTS))
    gang = run_gang(command, 3, GANG_TIMEOUT, env=worker_env(runs.backend))
    assert gang.returncode == 0, gang.output[-8000:]
    return Runs(runs.backend, gang_dir, runs.reference_dir, runs.single_dir, gang.output)


def _no_error(result: dict, who: str) -> None:
    assert "error" not in result, f"{who} raised {result['error']}\n{result.get('traceback', '')[-3000:]}"


def _assert_matches_plain_keras(runs: Runs, variant: str, workers: int) -> None:
    """No error; workers bit-identical; weights and logs equal plain Keras' within tolerance."""
    _no_error(runs.reference(variant), f"plain Keras ({runs.backend}) {variant}")
    for worker in range(workers):
        _no_error(runs.result(variant, worker), f"worker {worker} ({runs.backend}) {variant}")
    first = runs.weights(variant, 0)
    for worker in range(1, workers):
        spread = common.max_weight_difference(first, runs.weights(variant, worker))
        assert spread == 0.0, f"{runs.backend} {variant}: workers 0 and {worker} differ by {spread:.3g}"
    histories = [runs.result(variant, worker).get("history") for worker in range(workers)]
    assert all(history == histories[0] for history in histories), \
        f"{runs.backend} {variant}: logs are not global: {histories}"
    if variant in NOT_COMPARED_WITH_ONE_PROCESS or (runs.backend, variant) in RACY_WITH_ONE_PROCESS:
        return
    delta = common.max_weight_difference(first, runs.reference_weights(variant))
    print(f"{runs.backend} {variant}, {workers} workers: max|Δw| vs one process of plain Keras = {delta:.3g}")
    tolerance = MIXED_PRECISION_TOLERANCE.get(variant, WEIGHT_TOLERANCE)
    assert delta <= tolerance, f"{runs.backend} {variant}: max|Δw| = {delta:.3g} vs plain Keras"
    expected = runs.reference(variant).get("history") or {}
    for key, values in expected.items():
        if key in KNOWN_LOG_DIFFERENCES.get((runs.backend, variant), ()):
            continue
        got = histories[0].get(key)
        assert got is not None and len(got) == len(values), f"{variant}: {key} {got} vs {values}"
        history_tolerance = MIXED_PRECISION_TOLERANCE.get(variant, HISTORY_TOLERANCE)
        np.testing.assert_allclose(got, values, rtol=history_tolerance, atol=history_tolerance,
                                   err_msg=f"{runs.backend} {variant}: history[{key!r}]")


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_one_process_of_plain_keras(runs, variant):
    """2 workers: no error; workers bit-identical; weights and logs equal plain Keras'."""
    _assert_matches_plain_keras(runs, variant, workers=2)


@pytest.mark.slow
@pytest.mark.parametrize("variant", THREE_WORKER_VARIANTS)
def test_three_workers_match_one_process_of_plain_keras(three_workers, variant):
    """3 workers, where a global batch of 16 splits 6/5/5: the same checks as with 2."""
    _assert_matches_plain_keras(three_workers, variant, workers=3)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_worker_without_tf_config_is_plain_keras(runs, variant):
    """The same script on one keras_mwms worker (no TF_CONFIG) trains like plain Keras."""
    _no_error(runs.single(variant), f"one worker ({runs.backend}) {variant}")
    delta = common.max_weight_difference(runs.single_weights(variant), runs.reference_weights(variant))
    print(f"{runs.backend} {variant}: one keras_mwms worker vs plain Keras: max|Δw| = {delta:.3g}")
    assert delta <= WEIGHT_TOLERANCE, f"{runs.backend} {variant}: max|Δw| = {delta:.3g} vs plain Keras"


@pytest.mark.slow
def test_predictions_and_evaluation_on_uneven_sizes_equal_plain_keras(runs):
    result, reference = runs.result("evaluate_predict_uneven", 1), runs.reference("evaluate_predict_uneven")
    _no_error(result, "worker 1")
    np.testing.assert_allclose(result["predict"], reference["predict"], atol=1e-5)
    for key, value in reference["evaluate"].items():
        assert abs(result["evaluate"][key] - value) <= 1e-5, (key, result["evaluate"], reference["evaluate"])


@pytest.mark.slow
def test_chief_alone_saves_reloads_and_predicts(runs):
    """`if strategy.is_chief: model.save(...)` (TF's tutorial idiom) enters no collective."""
    result = runs.result("save_on_chief", 0)
    _no_error(result, "chief")
    assert result["reloaded_max_difference"] == 0.0
    assert result["weights_file_max_difference"] == 0.0
    assert len(result["chief_predict"]) == 5


@pytest.mark.slow
def test_workers_shuffling_tf_data_differently_are_warned(runs):
    for worker in range(2):
        warnings = runs.result("tfdata_worker_seeds", worker)["warnings"]
        assert any("start with different global batches" in text for text in warnings), (worker, warnings)
    clean = runs.result("sgd_arrays", 0)["warnings"] + runs.result("generator", 0)["warnings"]
    assert not any("different global batches" in text for text in clean), clean


@pytest.mark.slow
def test_only_the_chief_prints_epoch_lines(runs):
    printed = [runs.result("verbose2", worker)["printed"] for worker in range(2)]
    assert "Epoch 1/2" in printed[0] and "loss" in printed[0], printed[0]
    assert printed[1] == "", f"worker 1 printed: {printed[1]!r}"


@pytest.mark.slow
def test_callbacks_stop_every_worker_at_the_same_epoch(runs):
    epochs = [runs.result("early_stopping_reduce_lr", worker)["epochs_run"] for worker in range(2)]
    assert epochs[0] == epochs[1] == runs.reference("early_stopping_reduce_lr")["epochs_run"]


@pytest.mark.slow
def test_no_eager_collective_warning(runs):
    """TF's "Using CollectiveAllReduceStrategy eagerly" warning used to repeat every epoch."""
    assert "eagerly has significant overhead" not in runs.output


@pytest.mark.slow
def test_known_log_differences_are_warned_and_small(runs):
    """Where a log may differ from one process (KNOWN_LOG_DIFFERENCES), every worker says so.

    The same variant on another backend, which has no such difference, warns on no worker.
    """
    for (backend, variant), keys in KNOWN_LOG_DIFFERENCES.items():
        for worker in range(2):
            warnings = runs.result(variant, worker)["warnings"]
            warned = any("weigh each worker's value equally" in text for text in warnings)
            assert warned == (backend == runs.backend), (runs.backend, variant, worker, warnings)
        if backend != runs.backend:
            continue
        expected, got = runs.reference(variant)["history"], runs.result(variant, 0)["history"]
        for key in keys:
            difference = float(np.max(np.abs(np.subtract(got[key], expected[key]))))
            print(f"{backend} {variant}: logged {key} differs from one process by {difference:.3g}")
            assert difference <= 0.05, (key, got[key], expected[key])


@pytest.mark.slow
def test_racy_inputs_are_warned(runs):
    """Where the one-process comparison is known racy (RACY_WITH_ONE_PROCESS), every worker says so.

    The same variant on another backend, which is exact, warns on no worker.
    """
    for backend, variant in RACY_WITH_ONE_PROCESS:
        for worker in range(2):
            warnings = runs.result(variant, worker)["warnings"]
            warned = any("Python generator" in text for text in warnings)
            assert warned == (backend == runs.backend), (runs.backend, variant, worker, warnings)


@pytest.mark.slow
def test_mixed_float16_keeps_one_loss_scale_history(runs):
    """mixed_float16 (Keras wraps the optimizer in a LossScaleOptimizer): every worker applies
    the steps one process applies, with one process's dynamic loss scale after every batch
    (before the fix: a hang on TensorFlow, 11 of 23 steps on torch). Near overflow the workers
    still skip the same steps together."""
    for variant in ("mixed_float16", "mixed_float16_overflow"):
        histories = [runs.result(variant, worker).get("loss_scale") for worker in range(2)]
        assert histories[0] and histories[0] == histories[1], (runs.backend, variant, histories)
    overflow = runs.result("mixed_float16_overflow", 0)["loss_scale"]
    assert overflow[0][1] == 0 and overflow[-1][0] < 2.0 ** 20, f"no step overflowed: {overflow}"
    assert runs.result("mixed_float16", 0)["loss_scale"] == runs.reference("mixed_float16")["loss_scale"]


def test_one_worker_changing_state_makes_every_worker_raise(runs):
    """The safety net (`keras_mwms.backends.consistency`): worker 1 alone nudges a BatchNorm
    moving mean at the end of a fit, then before a ModelCheckpoint save; every worker raises
    `WorkersDifferError` naming that variable, at the end of fit and at the checkpoint. The
    healthy fits of every other variant pass the same check silently."""
    variant = "one_worker_nudges_state"
    assert runs.reference(variant)["caught"] == []
    for worker in range(2):
        result = runs.result(variant, worker)
        caught, path = result["caught"], result["moving_mean_path"]
        assert [entry["type"] for entry in caught] == ["WorkersDifferError"] * 2, caught
        assert "after model.fit()" in caught[0]["message"], caught[0]["message"]
        assert "after ModelCheckpoint at epoch 1" in caught[1]["message"], caught[1]["message"]
        for entry in caught:
            assert entry["variable"] == path and entry["workers"] == [1], entry
            assert f"worker {worker}: " in entry["message"] and path in entry["message"], entry["message"]

