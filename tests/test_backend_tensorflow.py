"""keras_mwms on the TensorFlow backend, with real worker processes.

Each scenario of `tests/workers/fit_scenario.py` runs once in the suite's shared warm gang of its
size and, where equivalence is checked, once more in the shared single-process reference
without TF_CONFIG (`tests/shared_gangs.py`); the tests read the dumps. Nothing here imports TensorFlow or Keras: the pytest process stays backend-free.
"""

from __future__ import annotations

import json
import os
import shlex

import numpy as np
import pytest

from keras_mwms.launch import find_free_ports
from tests.multiworker import Spawn, python_worker, run_gang, run_processes, start_processes, worker_env
from tests.shared_gangs import SHARED, SINGLE, Runner, gang
from tests.workers.common import load_result, load_weights, max_weight_difference

pytestmark = pytest.mark.tensorflow

GANG_TIMEOUT = 420.0
EQUIVALENCE_TOLERANCE = 1e-5

# This module's settings for every scenario: 192 rows in global batches of 48 (even over 2 and
# 3 workers, a partial last evaluate batch), plain SGD, seed 1 (worker i: 1 + i by worker).
BASE = ["--rows", "192", "--batch-size", "48", "--momentum", "0", "--seed", "1"]
# name: (workers, scenario flags).
SCENARIOS = {
    "arrays_shuffled_sgd": (2, ["--data", "arrays", "--shuffle", "--optimizer", "sgd", "--seed-by-worker",
                                "--validation", "split"]),
    # jit_compile=True: TF's XLA has no CPU collectives, so keras_mwms warns and trains unjitted.
    "dataset_shuffled_sgd": (2, ["--data", "dataset", "--shuffle", "--optimizer", "sgd", "--jit-compile"]),
    "arrays_batchnorm_adam": (3, ["--data", "arrays", "--batch-norm", "synchronized", "--optimizer", "adam",
                                  "--seed-by-worker"]),
}


def _fit_scenario(out: str, *flags: str) -> list[str]:
    return python_worker("fit_scenario.py", out, *BASE, *flags)


# The suite's shared warm processes (`tests/shared_gangs.py`): each scenario in the gang of its
# size; every scenario's reference in the one process without TF_CONFIG (the flags less the
# gang-only ones).
REFERENCE = Runner("tensorflow", SINGLE)
GANG_ONLY = ("--seed-by-worker", "--jit-compile")
for _name, (_workers, _flags) in SCENARIOS.items():
    SHARED.add(__name__, gang("tensorflow", _workers), _name, "fit_scenario", ["{out}", *BASE, *_flags],
               seconds=GANG_TIMEOUT)
SHARED.add(__name__, REFERENCE, "references", "fit_scenario",
           ["{out}", *BASE, *(part for name in sorted(SCENARIOS) for part in (
               "--scenario", f"{name}: {shlex.join(a for a in SCENARIOS[name][1] if a not in GANG_ONLY)}"))],
           seconds=GANG_TIMEOUT)
# --shuffle: fit's default, which shuffles the order of a PyDataset's batches.
SHARED.add(__name__, gang("tensorflow", 2), "dropout_pydataset", "fit_scenario",
           ["{out}", *BASE, "--data", "pydataset", "--shuffle", "--dropout", "0.3", "--validation", "data",
            "--seed-by-worker"], seconds=GANG_TIMEOUT)
SHARED.add(__name__, gang("tensorflow", 2), "shard_off", "fit_scenario",
           ["{out}", *BASE, "--data", "dataset_off", "--rows", "220"], seconds=GANG_TIMEOUT)


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def equivalence_run(request, shared_runs):
    workers, _ = SCENARIOS[request.param]
    runner = gang("tensorflow", workers)
    return {"name": request.param, "workers": workers,
            "gang": shared_runs.folder(runner, __name__, request.param),
            "single": os.path.join(shared_runs.folder(REFERENCE, __name__, "references"), request.param),
            "gang_result": shared_runs.output(runner, __name__, request.param),
            "reference_output": shared_runs.output(REFERENCE).output,
            "reference_job_output": shared_runs.output(REFERENCE, __name__, "references").output}


@pytest.mark.slow
def test_workers_end_bit_identical_and_equal_one_process(equivalence_run):
    gang, workers = equivalence_run["gang"], equivalence_run["workers"]
    first = load_weights(gang, 0)
    for index in range(1, workers):
        assert max_weight_difference(load_weights(gang, index), first) == 0.0
    delta = max_weight_difference(first, load_weights(equivalence_run["single"], 0))
    print(f"max|Δw| vs one process ({equivalence_run['name']}, {workers} workers): {delta:.3g}")
    assert delta <= EQUIVALENCE_TOLERANCE


@pytest.mark.slow
def test_jit_compile_on_cpu_workers_warns_and_trains_unjitted(equivalence_run):
    output = equivalence_run["gang_result"].output
    jit_requested = "--jit-compile" in SCENARIOS[equivalence_run["name"]][1]
    assert ("jit_compile=True is ignored" in output) == jit_requested
    assert "Collectives are not yet implemented" not in output


@pytest.mark.slow
def test_workers_seeded_differently_start_identical(equivalence_run):
    gang, workers = equivalence_run["gang"], equivalence_run["workers"]
    probes = [load_result(gang, index)["seed_probe"] for index in range(workers)]
    seeded_by_worker = "--seed-by-worker" in SCENARIOS[equivalence_run["name"]][1]
    assert len(set(probes)) == (workers if seeded_by_worker else 1), probes
    # Right after the scope built the model, every worker holds the chief's initial weights,
    # which are the one process's (same seed as the chief).
    reference = _initial_weights(equivalence_run["single"], 0)
    for index in range(workers):
        assert max_weight_difference(_initial_weights(gang, index), reference) == 0.0


def _initial_weights(out: str, index: int) -> list:
    with np.load(os.path.join(out, f"w{index}.init.npz")) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.mark.slow
def test_history_and_evaluate_are_global_and_identical(equivalence_run):
    gang, workers = equivalence_run["gang"], equivalence_run["workers"]
    reference = load_result(equivalence_run["single"], 0)
    results = [load_result(gang, index) for index in range(workers)]
    for result in results:
        assert result["history"] == results[0]["history"]
        assert result["evaluate"] == results[0]["evaluate"]
        assert result["batches"] == reference["batches"]
    for name, value in reference["evaluate"].items():
        assert results[0]["evaluate"][name] == pytest.approx(value, rel=1e-5)
    for name, values in reference["history"].items():
        assert results[0]["history"][name] == pytest.approx(values, rel=1e-5)


@pytest.mark.slow
def test_predict_returns_full_ordered_output_everywhere(equivalence_run):
    gang, workers = equivalence_run["gang"], equivalence_run["workers"]
    reference = np.load(os.path.join(equivalence_run["single"], "w0.predict.npy"))
    for index in range(workers):
        prediction = np.load(os.path.join(gang, f"w{index}.predict.npy"))
        assert prediction.shape == reference.shape == (100, 1)
        assert np.abs(prediction - reference).max() <= 1e-5


@pytest.mark.slow
def test_only_the_chief_shows_a_progress_bar(equivalence_run):
    result = equivalence_run["gang_result"]
    # verbose="auto" prints "Epoch 1/2" and a progress bar; verbose=0 prints neither.
    assert any(line.startswith("Epoch 1/") for line in result.lines(0))
    for index in range(1, equivalence_run["workers"]):
        assert not any(line.startswith("Epoch 1/") for line in result.lines(index))


@pytest.mark.slow
def test_single_worker_warns_once(equivalence_run):
    """When the strategy starts without a cluster (the shared reference process, before its first
    job), and not again at any fit."""
    before_jobs, _, jobs = equivalence_run["reference_output"].partition("=== job ")
    assert before_jobs.count("is running a single worker") == 1, before_jobs[-3000:]
    assert "is running a single worker" not in equivalence_run["reference_job_output"]


@pytest.fixture(scope="module")
def dropout_pydataset_run(shared_runs):
    return shared_runs.folder(gang("tensorflow", 2), __name__, "dropout_pydataset")


@pytest.mark.slow
def test_dropout_on_pydataset_with_validation_stays_bit_identical(dropout_pydataset_run):
    out = dropout_pydataset_run
    assert max_weight_difference(load_weights(out, 0), load_weights(out, 1)) == 0.0
    results = [load_result(out, index) for index in (0, 1)]
    assert results[0]["history"] == results[1]["history"]
    assert "val_loss" in results[0]["history"]
    assert results[0]["batches"] == [4, 4]


@pytest.fixture(scope="module")
def unsharded_run(shared_runs):
    runner = gang("tensorflow", 2)
    return shared_runs.folder(runner, __name__, "shard_off"), shared_runs.output(runner, __name__, "shard_off")


@pytest.mark.slow
def test_autoshard_off_uses_every_row_of_each_worker(unsharded_run):
    out, result = unsharded_run
    # 110 rows per worker, global batch 48: each batch is split into two pieces of 24, the last
    # batch (14 rows) into one: 5 steps, and Keras must not stop at its cardinality (3).
    for index in (0, 1):
        assert load_result(out, index)["batches"] == [5, 5]
    assert "ran out of data" not in result.output
    assert max_weight_difference(load_weights(out, 0), load_weights(out, 1)) == 0.0


@pytest.fixture(scope="module")
def seed_examples(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed")
    with start_processes([Spawn(python_worker("tensorflow_seed.py", str(root / "single")), worker_env("tensorflow", lean=True))],
                         GANG_TIMEOUT) as single:
        result = run_gang(python_worker("tensorflow_seed.py", str(root / "gang")), 2, GANG_TIMEOUT,
                          env=worker_env("tensorflow", lean=True))
        assert result.returncode == 0, result.output[-8000:]
        reference = single.result()
        assert reference.codes == [0], reference.log()
    return str(root / "gang"), str(root / "single")


@pytest.mark.slow
def test_seed_custom_training_loop_trains_like_one_process(seed_examples):
    gang, single = seed_examples
    assert max_weight_difference(load_weights(gang, 0), load_weights(gang, 1)) == 0.0
    assert max_weight_difference(load_weights(gang, 0), load_weights(single, 0)) <= EQUIVALENCE_TOLERANCE
    results = [load_result(gang, index) for index in (0, 1)]
    assert results[0]["custom_loop_losses"] == pytest.approx(
        load_result(single, 0)["custom_loop_losses"], rel=1e-5)
    assert results[0]["num_replicas_in_sync"] == 2
    assert [result["task"] for result in results] == [["worker", 0], ["worker", 1]]


@pytest.mark.slow
def test_seed_keras_example_fits_a_distributed_dataset(seed_examples):
    gang, _ = seed_examples
    results = [load_result(gang, index) for index in (0, 1)]
    assert results[0]["seed_example_weights"] == results[1]["seed_example_weights"]
    losses = results[0]["seed_example_loss"]
    assert losses == results[1]["seed_example_loss"] and losses[-1] < losses[0]


@pytest.mark.slow
def test_strategy_primitives_and_guards(seed_examples):
    gang, _ = seed_examples
    for index in (0, 1):
        result = load_result(gang, index)
        assert result["local_results"] == 1
        assert result["reduce_nested"] == [2.0, [4.0, 6.0]]
        assert result["reduce_mean_axis0"] == 2.5
        assert result["broadcast_from_0"] == {"from": 0, "text": "ééééé"}
        assert result["broadcast_from_last"] == [0, 1, 2]
        assert "steps_per_execution=2" in result["steps_per_execution_error"]
        assert len(result["tf_config_warning"]) == 1 and "changed" in result["tf_config_warning"][0]


@pytest.mark.slow
def test_missing_worker_is_named_within_the_rendezvous_timeout(tmp_path):
    ports = find_free_ports(2)
    tf_config = json.dumps({"cluster": {"worker": [f"localhost:{port}" for port in ports]},
                            "task": {"type": "worker", "index": 0}})
    env = worker_env("tensorflow", lean=True, TF_CONFIG=tf_config, KERAS_MWMS_RENDEZVOUS_TIMEOUT="8")
    result = run_processes([Spawn(_fit_scenario(str(tmp_path)), env)], GANG_TIMEOUT)
    output, elapsed = result.outputs[0], result.seconds[0]
    assert result.codes[0] != 0, output[-3000:]
    assert "RendezvousError" in output and "worker:1" in output, output[-3000:]
    assert elapsed < 8 + 60, f"took {elapsed:.0f} s"   # 8 s rendezvous timeout + imports
