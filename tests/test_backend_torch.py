"""Multi-process acceptance tests of the PyTorch backend (`keras_mwms/backends/torch/`).

The scenarios of `tests/workers/fit_scenario.py` run once, in the suite's shared warm gangs of 2
and 3 torch workers and, for equivalence, its shared process without TF_CONFIG
(`tests/shared_gangs.py`); the assertions read the dumped weights and results.
Nothing here imports torch or keras in the pytest process.
"""

from __future__ import annotations

import json
import os
import shlex

import numpy as np
import pytest

from tests.multiworker import python_worker, run_one_process, watch_gang, worker_env
from tests.shared_gangs import SHARED, SINGLE, Runner, gang
from tests.workers import common

pytestmark = [pytest.mark.torch]
GANG_TIMEOUT = 420
SGD_TOLERANCE = 1e-5
ADAM_TOLERANCE = 1e-5

# This module's settings for every scenario: 256 rows in global batches of 32, SGD with momentum
# 0.9, seed 100 (worker i: 100 + i by worker), quiet; evaluate and predict on the training rows.
BASE = ["--verbose", "0", "--evaluate-on", "training", "--seed", "100"]
SCENARIOS = {
    "sgd_arrays": ["--data", "arrays", "--optimizer", "sgd", "--seed-by-worker"],
    "tfdata_adam": ["--data", "dataset", "--shuffle", "--optimizer", "adam", "--learning-rate", "0.001",
                    "--batch-norm", "local"],
    # Also the custom-loop API (run, reduce, barrier, broadcast, distributed datasets).
    "dropout": ["--data", "arrays", "--shuffle", "--dropout", "0.3", "--primitives"],
    # An ordinary BatchNormalization (global moments): its all-reduce is in the one graph too.
    "jit": ["--data", "arrays", "--jit-compile", "--epochs", "1", "--batch-norm", "local"],
    # The eager twin of "jit": the one-process reference the compiled gang must match.
    "jit_eager": ["--data", "arrays", "--epochs", "1", "--batch-norm", "local"],
    "dataloader_bn": ["--data", "dataloader", "--shuffle", "--batch-norm", "synchronized", "--batch-size", "48",
                      "--task", "classification"],
    # --shuffle: fit's default, which shuffles the order of a PyDataset's batches.
    "pydataset_adam": ["--data", "pydataset", "--shuffle", "--optimizer", "adam", "--learning-rate", "0.001",
                       "--batch-size", "40", "--rows", "280"],
}
TWO_WORKER_SCENARIOS = ("sgd_arrays", "tfdata_adam", "dropout", "jit")
THREE_WORKER_SCENARIOS = ("dataloader_bn", "pydataset_adam")
REFERENCE_SCENARIOS = ("sgd_arrays", "tfdata_adam", "dataloader_bn", "pydataset_adam", "jit_eager")


def _argv(names) -> list[str]:
    """fit_scenario.py's command line running the named scenarios one after another."""
    scenarios = [argument for name in names for argument in ("--scenario", f"{name}: {shlex.join(SCENARIOS[name])}")]
    return ["{out}", *BASE, *scenarios]


# The shared warm processes (`tests/shared_gangs.py`): the gangs of 2 and 3 and the one process
# without TF_CONFIG that runs every equivalence scenario's reference.
RUNNERS = {"two_workers": (gang("torch", 2), TWO_WORKER_SCENARIOS),
           "three_workers": (gang("torch", 3), THREE_WORKER_SCENARIOS),
           "reference": (Runner("torch", SINGLE), REFERENCE_SCENARIOS)}
for _runner, _names in RUNNERS.values():
    SHARED.add(__name__, _runner, "scenarios", "fit_scenario", _argv(_names), seconds=GANG_TIMEOUT)


class Scenario:
    """One scenario's dumps from a gang run and from the single-process reference."""

    def __init__(self, out: str, reference_out: str, name: str, workers: int):
        self.out = os.path.join(out, name)
        self.reference_out = os.path.join(reference_out, name)
        self.workers = workers
        self.name = name

    def weights(self, index: int):
        return common.load_weights(self.out, index)

    def result(self, index: int):
        return common.load_result(self.out, index)

    def reference_weights(self):
        return common.load_weights(self.reference_out, 0)

    def reference_result(self):
        return common.load_result(self.reference_out, 0)

    def predictions(self, index: int):
        return np.load(os.path.join(self.out, f"w{index}.predict.npy"))


@pytest.fixture(scope="module")
def run_dirs(shared_runs) -> dict[str, str]:
    """{"reference" | "two_workers" | "three_workers": the folder of its scenarios}."""
    return {name: shared_runs.folder(runner, __name__, "scenarios") for name, (runner, _) in RUNNERS.items()}


@pytest.fixture(scope="module")
def reference_dir(run_dirs):
    return run_dirs["reference"]


@pytest.fixture(scope="module")
def two_workers_dir(run_dirs):
    return run_dirs["two_workers"]


@pytest.fixture(scope="module")
def three_workers_dir(run_dirs):
    return run_dirs["three_workers"]


@pytest.fixture(scope="module")
def sgd_arrays(two_workers_dir, reference_dir):
    """2 workers seeded differently, arrays, no shuffle, SGD, 2 epochs."""
    return Scenario(two_workers_dir, reference_dir, "sgd_arrays", 2)


@pytest.fixture(scope="module")
def tfdata_adam(two_workers_dir, reference_dir):
    """2 workers, tf.data shuffled, Adam, 16 steps; BatchNormalization(synchronized=False)."""
    return Scenario(two_workers_dir, reference_dir, "tfdata_adam", 2)


@pytest.fixture(scope="module")
def dropout(two_workers_dir, reference_dir):
    """2 workers, arrays shuffled, Dropout (no reference: each worker masks its own rows), then
    the custom-loop API."""
    return Scenario(two_workers_dir, reference_dir, "dropout", 2)


@pytest.fixture(scope="module")
def dataloader_batchnorm(three_workers_dir, reference_dir):
    """3 workers, torch DataLoader shuffled, Dense + BatchNormalization(synchronized=True), SGD.

    256 rows in global batches of 48: the last batch (16 rows) leaves workers 1 and 2 empty.
    """
    return Scenario(three_workers_dir, reference_dir, "dataloader_bn", 3)


@pytest.fixture(scope="module")
def pydataset_adam_3(three_workers_dir, reference_dir):
    """3 workers, a PyDataset (global batch 40, not divisible by 3), Adam, 14 steps."""
    return Scenario(three_workers_dir, reference_dir, "pydataset_adam", 3)


def _assert_bit_identical(scenario):
    first = scenario.weights(0)
    for index in range(1, scenario.workers):
        assert common.max_weight_difference(first, scenario.weights(index)) == 0.0


def _assert_equivalent(scenario, tolerance):
    delta = common.max_weight_difference(scenario.weights(0), scenario.reference_weights())
    print(f"max|Δw| vs one process ({scenario.name}, {scenario.workers} workers): {delta:.3g}")
    assert delta <= tolerance


@pytest.mark.slow
def test_sgd_arrays_two_workers_match_one_process(sgd_arrays):
    _assert_bit_identical(sgd_arrays)
    _assert_equivalent(sgd_arrays, SGD_TOLERANCE)


@pytest.mark.slow
def test_differently_seeded_workers_start_identical(sgd_arrays):
    probes = {sgd_arrays.result(i)["seed_probe"] for i in range(2)}
    assert len(probes) == 2, "the scenario should seed the workers differently"
    # Already right after the scope block built the model (issue 16 item 9), not only at fit.
    before = {sgd_arrays.result(i)["weight_sum_before_fit"] for i in range(2)}
    assert before == {sgd_arrays.reference_result()["weight_sum_before_fit"]}
    at_start = {sgd_arrays.result(i)["weight_sum_at_train_begin"] for i in range(2)}
    assert at_start == {sgd_arrays.reference_result()["weight_sum_at_train_begin"]}


@pytest.mark.slow
def test_history_and_evaluate_are_global(sgd_arrays):
    results = [sgd_arrays.result(i) for i in range(2)]
    reference = sgd_arrays.reference_result()
    assert results[0]["history"] == results[1]["history"]
    assert results[0]["evaluate"] == results[1]["evaluate"]
    for key, values in reference["history"].items():
        np.testing.assert_allclose(results[0]["history"][key], values, rtol=1e-5)
    for key, value in reference["evaluate"].items():
        assert results[0]["evaluate"][key] == pytest.approx(value, rel=1e-5)


@pytest.mark.slow
def test_predict_is_full_and_ordered_on_every_worker(sgd_arrays):
    reference = np.load(os.path.join(sgd_arrays.reference_out, "w0.predict.npy"))
    for index in range(2):
        predictions = sgd_arrays.predictions(index)
        assert predictions.shape == reference.shape == (256, 1)
        np.testing.assert_allclose(predictions, reference, atol=1e-5)


@pytest.mark.slow
def test_fast_torch_optimizer_is_kept(sgd_arrays):
    assert sgd_arrays.result(0)["optimizer_class"].startswith("keras.src.backend.torch.optimizers")


@pytest.mark.slow
def test_dataloader_synchronized_batch_norm_three_workers(dataloader_batchnorm):
    _assert_bit_identical(dataloader_batchnorm)
    _assert_equivalent(dataloader_batchnorm, SGD_TOLERANCE)
    results = [dataloader_batchnorm.result(i) for i in range(3)]
    assert all(r["history"] == results[0]["history"] for r in results)
    assert results[0]["optimizer_iterations"] == 12


@pytest.mark.slow
def test_tfdata_adam_with_ordinary_batch_norm(tfdata_adam):
    """BatchNormalization left at synchronized=False normalizes over the global batch by default."""
    _assert_bit_identical(tfdata_adam)
    assert tfdata_adam.result(0)["optimizer_iterations"] == 16
    _assert_equivalent(tfdata_adam, ADAM_TOLERANCE)


@pytest.mark.slow
def test_pydataset_adam_three_workers_uneven_batches(pydataset_adam_3):
    _assert_bit_identical(pydataset_adam_3)
    _assert_equivalent(pydataset_adam_3, ADAM_TOLERANCE)
    assert pydataset_adam_3.result(0)["optimizer_iterations"] == 14


@pytest.mark.slow
def test_dropout_workers_bit_identical(dropout):
    _assert_bit_identical(dropout)
    losses = dropout.result(0)["history"]["loss"]
    assert losses[-1] < losses[0]
    assert dropout.result(0)["history"] == dropout.result(1)["history"]


@pytest.mark.slow
def test_jit_compile_workers_bit_identical_and_equal_to_eager_one_process(two_workers_dir,
                                                                          reference_dir):
    """`compile(jit_compile=True)`: torch.compile'd steps, the gradient all-reduce and the
    BatchNormalization moments' all-reduce (forward and backward) in their graph."""
    scenario = Scenario(two_workers_dir, reference_dir, "jit", 2)
    _assert_bit_identical(scenario)
    eager = common.load_weights(os.path.join(reference_dir, "jit_eager"), 0)
    delta = common.max_weight_difference(scenario.weights(0), eager)
    print(f"max|Δw| jit_compile gang vs eager one process: {delta:.3g}")
    assert delta <= SGD_TOLERANCE
    # Compiled with keras_mwms' options (`backends.torch.compile_options`: masks recomputed).
    assert [scenario.result(index)["compile_options"] for index in range(2)] == [1, 1]
    assert scenario.result(0)["history"] == scenario.result(1)["history"]


@pytest.mark.slow
def test_gradients_reduce_during_backward_in_eager_gangs_only(sgd_arrays, two_workers_dir,
                                                                reference_dir):
    assert sgd_arrays.result(0)["overlap_buckets"] >= 1
    assert sgd_arrays.reference_result()["overlap_buckets"] == 0   # one process: nothing to reduce
    jit = Scenario(two_workers_dir, reference_dir, "jit", 2)
    assert jit.result(0)["overlap_buckets"] == 0                   # torch.compile'd step: after it


# TorchDynamo's graph breaks in the "jit" scenario's fit (torch 2.13, Keras 3.15.1, SGD, an
# ordinary BatchNormalization): none, forward (with the global moments' all-reduce), backward,
# the gradient all-reduce and the update are one graph. Keras' `loss.backward()` (3 events;
# `backends.torch.compiled_step` traces `torch.autograd.grad` instead), Keras' torch SGD update
# ("Data dependent operator", `backends.torch.compiled_sgd`) and the gradient all-reduce
# (`gradients.averaged_in_graph`) were breaks (3, 9 and 8 events with them); with the
# BatchNormalization layer, its moments' eager all-reduce (`torch.compiler.disable`d) kept
# Keras' `backward()` too: 17 events, 11 graphs per fit (`gradients.synchronized_moments`).
JIT_GRAPH_BREAKS = 0
JIT_GRAPH_BREAK_REASONS: list[str] = []


@pytest.mark.slow
def test_compiled_step_graph_breaks_cannot_return(sgd_arrays, two_workers_dir, reference_dir):
    """`keras_mwms.benchmark.graph_breaks`: no new graph break in the compiled step."""
    jit = Scenario(two_workers_dir, reference_dir, "jit", 2)
    for index in range(2):
        result = jit.result(index)
        print(f"worker {index}: {result['graph_breaks']} graph breaks: {result['graph_break_reasons']}")
        assert result["graph_break_reasons"] == JIT_GRAPH_BREAK_REASONS
        assert result["graph_breaks"] <= JIT_GRAPH_BREAKS
    assert sgd_arrays.result(0)["graph_breaks"] == 0   # eager: nothing is compiled
    assert sgd_arrays.result(0)["compile_options"] == 0


@pytest.mark.slow
def test_metric_states_ride_in_the_gradient_all_reduce(sgd_arrays, dataloader_batchnorm,
                                                       two_workers_dir, reference_dir):
    """Eager gangs sum metric states with the gradients: no metric all-reduce of their own."""
    for scenario in (sgd_arrays, dataloader_batchnorm):   # the latter with empty shards
        for index in range(scenario.workers):
            result = scenario.result(index)
            assert result["metric_states_in_gradient_bucket"] == result["optimizer_iterations"]
    jit = Scenario(two_workers_dir, reference_dir, "jit", 2)
    assert jit.result(0)["metric_states_in_gradient_bucket"] == 0


@pytest.mark.slow
def test_adam_runs_fused_in_eager_steps(tfdata_adam, pydataset_adam_3):
    for scenario in (tfdata_adam, pydataset_adam_3):
        for index in range(scenario.workers):
            result = scenario.result(index)
            assert result["fused_adam_steps"] == result["optimizer_iterations"] > 0
        assert scenario.reference_result()["fused_adam_steps"] > 0   # one process in scope too


def test_fused_adam_matches_keras_adam():
    """One process: Keras' torch Adam/AdamW and the fused kernel on identical gradients."""
    output = run_one_process(python_worker("fused_adam_check.py"), GANG_TIMEOUT, env=worker_env("torch", lean=True))
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    report = json.loads(line[len("RESULT "):])
    for name in ("adam", "adam_schedule", "adamw"):
        print(f"fused vs Keras {name}: max|Δw| {report[name]['delta']:.3g} "
              f"(weights moved {report[name]['moved']:.3g})")
        assert report[name]["fused"]
        assert report[name]["moved"] > 1e-2
        assert report[name]["delta"] <= 1e-5 * max(1.0, report[name]["moved"])
    assert not report["adam_amsgrad"]["fused"]          # amsgrad keeps Keras' own update
    assert report["adam_amsgrad"]["delta"] == 0.0


@pytest.mark.slow
def test_custom_loop_surface(dropout):
    results = [dropout.result(i) for i in range(2)]
    for result in results:
        assert result["local_results"] == 1
        assert result["sum"] == [6.0, 60.0]
        assert result["mean"] == [3.0, 30.0]
        assert result["mean_axis0"] == pytest.approx(16.5)
        assert result["broadcast"] == 0
    assert results[1]["from_function"][0] == [1.0, 3.0, 5.0, 7.0]
    assert results[0]["distributed"][0] == [0.0, 1.0, 2.0, 3.0]
    assert results[1]["distributed"][0] == [4.0, 5.0, 6.0, 7.0]


def _fault_gang(out: str, mode: str, wait_for: set[int] | None = None):
    """tests/workers/torch_faults.py MODE on 2 workers, each exiting on its own (the launcher
    would stop survivors itself); those not in `wait_for` (default: all) are stopped after."""
    return watch_gang(python_worker("torch_faults.py", out, mode), 2, GANG_TIMEOUT, env=worker_env("torch", lean=True),
                      wait_for=wait_for)


def test_nccl_without_cuda_is_a_clear_error_within_5_seconds(tmp_path):
    watched = _fault_gang(str(tmp_path), "nccl")
    for index in range(2):
        assert watched.codes[index] not in (0, None), watched.lines(index)[-3000:]
        result = common.load_result(str(tmp_path), index)
        assert "NCCL" in result["error"] and "AUTO" in result["error"], result["error"]
        assert result["error_seconds"] <= 5.0


@pytest.mark.slow
def test_crashed_peer_stops_survivor_naming_it(tmp_path):
    watched = _fault_gang(str(tmp_path), "crash")
    assert watched.codes[1] == 3, watched.output[-3000:]
    assert watched.codes[0] not in (0, None), watched.output[-3000:]
    result = common.load_result(str(tmp_path), 0)
    assert "WorkerLostError" in result["error"] and "lost worker 1" in result["error"], watched.lines(0)[-3000:]
    assert result["error_seconds"] < 60


@pytest.mark.slow
def test_hung_peer_stops_survivor_within_bounded_time(tmp_path):
    watched = _fault_gang(str(tmp_path), "hang", wait_for={0})   # worker 1 sleeps on, then is stopped
    assert watched.codes[0] not in (0, None), watched.output[-3000:]
    result = common.load_result(str(tmp_path), 0)
    assert "lost worker 1" in result["error"], watched.lines(0)[-3000:]
    assert result["error_seconds"] < 60
