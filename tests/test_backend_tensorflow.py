"""keras_mwms on the TensorFlow backend, with real worker processes (tests/workers/tensorflow_*.py).

Each scenario runs once (module-scoped fixtures) as a gang of workers and, where equivalence is
checked, once more as the single-process reference without TF_CONFIG; the tests read the dumps.
Nothing here imports TensorFlow or Keras: the pytest process stays backend-free.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest

from keras_mwms.launch import find_free_ports
from tests.multiworker import REPO, python_worker, run_gang, worker_env
from tests.workers.common import load_result, load_weights, max_weight_difference

pytestmark = pytest.mark.tensorflow

GANG_TIMEOUT = 420.0
EQUIVALENCE_TOLERANCE = 1e-5

# name: (workers, scenario arguments). Global batch 48 splits evenly over 2 and 3 workers.
SCENARIOS = {
    "arrays_shuffled_sgd": (2, ["--data", "arrays", "--shuffle", "--optimizer", "sgd", "--seed-by-worker",
                                "--validation", "split"]),
    # jit_compile=True: TF's XLA has no CPU collectives, so keras_mwms warns and trains unjitted.
    "dataset_shuffled_sgd": (2, ["--data", "dataset", "--shuffle", "--optimizer", "sgd", "--jit-compile"]),
    "arrays_batchnorm_adam": (3, ["--data", "arrays", "--model", "batchnorm", "--optimizer", "adam",
                                  "--seed-by-worker"]),
}


def _reference_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    env.update(worker_env("tensorflow"))
    return env


def _run_reference(script: str, out: str, *arguments: str) -> str:
    completed = subprocess.run(python_worker(script, out, *arguments), env=_reference_env(), cwd=REPO,
                               capture_output=True, text=True, timeout=GANG_TIMEOUT)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    return completed.stdout + completed.stderr


def _run_workers(script: str, workers: int, out: str, *arguments: str):
    result = run_gang(python_worker(script, out, *arguments), workers, GANG_TIMEOUT,
                      env=worker_env("tensorflow"))
    assert result.returncode == 0, result.output[-8000:]
    return result


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def equivalence_run(request, tmp_path_factory):
    workers, arguments = SCENARIOS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    gang = _run_workers("tensorflow_fit.py", workers, str(root / "gang"), *arguments)
    reference_output = _run_reference("tensorflow_fit.py", str(root / "single"),
                                      *[a for a in arguments if a not in ("--seed-by-worker", "--jit-compile")])
    return {"name": request.param, "workers": workers, "gang": str(root / "gang"), "single": str(root / "single"),
            "gang_result": gang, "reference_output": reference_output}


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
    initial = [np.load(os.path.join(gang, f"w{index}.init.npz")) for index in range(workers)]
    for weights in initial[1:]:
        assert all(np.array_equal(weights[key], initial[0][key]) for key in initial[0].files)


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
    assert equivalence_run["reference_output"].count("is running a single worker") == 1


@pytest.fixture(scope="module")
def dropout_pydataset_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dropout") / "gang")
    _run_workers("tensorflow_fit.py", 2, out, "--data", "pydataset", "--model", "dropout",
                 "--validation", "data", "--seed-by-worker")
    return out


@pytest.mark.slow
def test_dropout_on_pydataset_with_validation_stays_bit_identical(dropout_pydataset_run):
    out = dropout_pydataset_run
    assert max_weight_difference(load_weights(out, 0), load_weights(out, 1)) == 0.0
    results = [load_result(out, index) for index in (0, 1)]
    assert results[0]["history"] == results[1]["history"]
    assert "val_loss" in results[0]["history"]
    assert results[0]["batches"] == [4, 4]


@pytest.fixture(scope="module")
def unsharded_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("shard_off") / "gang")
    result = _run_workers("tensorflow_fit.py", 2, out, "--data", "dataset_off", "--rows", "220")
    return out, result


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
    _run_workers("tensorflow_seed.py", 2, str(root / "gang"))
    _run_reference("tensorflow_seed.py", str(root / "single"))
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
    env = _reference_env()
    env.update(TF_CONFIG=tf_config, KERAS_MWMS_RENDEZVOUS_TIMEOUT="8")
    started = time.monotonic()
    completed = subprocess.run(python_worker("tensorflow_fit.py", str(tmp_path)), env=env, cwd=REPO,
                               capture_output=True, text=True, timeout=GANG_TIMEOUT)
    elapsed = time.monotonic() - started
    assert completed.returncode != 0
    assert "RendezvousError" in completed.stderr and "worker:1" in completed.stderr, completed.stderr[-3000:]
    assert elapsed < 8 + 60, f"took {elapsed:.0f} s"   # 8 s rendezvous timeout + imports

