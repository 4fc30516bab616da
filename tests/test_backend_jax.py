"""Multi-process acceptance tests of the JAX backend (`keras_mwms/backends/jax/`).

Each scenario runs `tests/workers/fit_scenario.py` once (fit + evaluate + predict + dumps) in the
suite's shared warm gang of its size and environment, and the shared process without TF_CONFIG
runs every scenario's single-process reference (`tests/shared_gangs.py`). The tests
compare the dumps with numpy only, so this pytest process never imports JAX or Keras.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

import numpy as np
import pytest

from tests.multiworker import python_worker, run_gang, watch_gang, worker_env
from tests.shared_gangs import SHARED, SINGLE, Runner, gang
from tests.workers.common import load_result
from tests.workers.fit_scenario import load_dump

pytestmark = [pytest.mark.jax, pytest.mark.slow]

GANG_TIMEOUT = 400
REFERENCE_TIMEOUT = 300

# This module's settings for every scenario: 256 rows, SGD with momentum 0.9, seed 0 (worker i:
# i by worker), quiet; evaluate and predict on the training rows in batches of 48 (a partial
# last batch of 16 rows).
BASE = ["--verbose", "0", "--evaluate-on", "training", "--evaluate-batch-size", "48"]
SCENARIOS = {
    # 2 workers, arrays, SGD, no shuffle, BatchNormalization, workers seeded differently,
    # validation data, a partial last batch (256 = 5 × 48 + 16), the custom-loop primitives.
    # BatchNormalization sends the model to the DataParallel path (global batch statistics).
    "sgd_batchnorm": dict(workers=2, path="dataparallel",
                          args=["--batch-norm", "local", "--seed-by-worker", "--validation", "data", "--primitives",
                                "--batch-size", "48"]),
    # 2 workers × 2 CPU devices = 4 replicas (DataParallel), arrays, Adam (16 steps), shuffle, Dropout.
    "adam_shuffle_dropout_4replicas": dict(workers=2, path="dataparallel",
                                           args=["--optimizer", "adam", "--shuffle", "--dropout", "0.2"],
                                           env={"JAX_NUM_CPU_DEVICES": "2"}),
    # The flat path (the default): 3 workers, tf.data at the global batch, Adam (12 steps),
    # seeded differently, validation; the 16-row last batch fills worker 0 (16/0/0 rows, as
    # keras_mwms.data.replica_slices says; workers 1 and 2 step on a zero-weight row); two steps per
    # execution (Keras loops the flat step in Python: 6 steps an epoch = 3 executions).
    "tfdata_adam_3workers_flat": dict(workers=3, path="flat",
                                      args=["--data", "dataset", "--optimizer", "adam", "--seed-by-worker",
                                            "--validation", "data", "--batch-size", "48",
                                            "--steps-per-execution", "2"]),
    # The flat path forced on BatchNormalization + Dropout + shuffle: per-worker batch statistics
    # and masks, so no single-process reference; workers must stay bit-identical (moving
    # statistics averaged) and evaluate/predict global.
    "forced_flat_batchnorm_dropout": dict(workers=2, path="flat", reference=None,
                                          args=["--batch-norm", "local", "--dropout", "0.2", "--shuffle",
                                                "--seed-by-worker", "--batch-size", "48"],
                                          env={"KERAS_MWMS_JAX_PATH": "flat"}),
}


def _fit_scenario(out: str, *flags: str) -> list[str]:
    return python_worker("fit_scenario.py", out, *BASE, *flags)


def max_difference(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


# The scenarios compared with one process, and that process's command: one device (no
# JAX_NUM_CPU_DEVICES), the scenarios' own environments otherwise (none sets another variable).
REFERENCED = [name for name, spec in SCENARIOS.items() if "reference" not in spec]
assert all(set(SCENARIOS[name].get("env", {})) <= {"JAX_NUM_CPU_DEVICES"} for name in REFERENCED)


def _runner(name: str) -> Runner:
    """The shared warm gang (`tests/shared_gangs.py`) of the scenario's size and environment."""
    spec = SCENARIOS[name]
    if "env" not in spec:
        return gang("jax", spec["workers"])
    return Runner("jax", spec["workers"], env=tuple(sorted(spec["env"].items())))


REFERENCE = Runner("jax", SINGLE)
for _name, _spec in SCENARIOS.items():
    SHARED.add(__name__, _runner(_name), _name, "fit_scenario", ["{out}", *BASE, *_spec["args"]],
               seconds=GANG_TIMEOUT)
SHARED.add(__name__, REFERENCE, "references", "fit_scenario",
           ["{out}", *BASE, *(part for name in REFERENCED
                              for part in ("--scenario", f"{name}: {shlex.join(SCENARIOS[name]['args'])}"))],
           seconds=REFERENCE_TIMEOUT * len(REFERENCED))


@pytest.fixture(scope="module")
def scenario_runs(shared_runs):
    """{name: (reference dump or None, [worker dumps])} from the shared gangs and reference."""
    references = shared_runs.folder(REFERENCE, __name__, "references")
    runs = {}
    for name, spec in SCENARIOS.items():
        folder = shared_runs.folder(_runner(name), __name__, name)
        runs[name] = (load_dump(os.path.join(references, name), 0) if name in REFERENCED else None,
                      [load_dump(folder, index) for index in range(spec["workers"])])
    return runs


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_workers_bit_identical_and_equal_to_one_process(scenario_runs, name):
    reference, workers = scenario_runs[name]
    probes = {worker["seed_probe"] for worker in workers}
    assert len(probes) == (len(workers) if "--seed-by-worker" in SCENARIOS[name]["args"] else 1), probes
    for worker in workers[1:]:
        assert max_difference(worker["initial"], workers[0]["initial"]) == 0.0
        assert max_difference(worker["final"], workers[0]["final"]) == 0.0
        assert worker["history"] == workers[0]["history"]
    assert workers[0]["path"] == SCENARIOS[name]["path"]
    if reference is None:
        return
    assert max_difference(workers[0]["initial"], reference["initial"]) == 0.0
    delta = max_difference(workers[0]["final"], reference["final"])
    print(f"max|Δw| vs one process ({name}): {delta:.3g}")
    assert delta <= 1e-5
    for key, values in reference["history"].items():
        np.testing.assert_allclose(workers[0]["history"][key], values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_evaluate_global_and_predict_full_ordered(scenario_runs, name):
    reference, workers = scenario_runs[name]
    for worker in workers:
        assert worker["evaluate"] == workers[0]["evaluate"]
        assert worker["predict_shape"] == [256, 1]
        np.testing.assert_array_equal(worker["predictions"], workers[0]["predictions"])
    if reference is None:
        return
    for key, value in reference["evaluate"].items():
        assert abs(workers[0]["evaluate"][key] - value) <= 1e-5
    assert np.abs(workers[0]["predictions"] - reference["predictions"]).max() <= 1e-5


def test_replicas_count_local_devices(scenario_runs):
    assert scenario_runs["adam_shuffle_dropout_4replicas"][1][0]["replicas"] == 4
    assert scenario_runs["tfdata_adam_3workers_flat"][1][0]["replicas"] == 3
    assert scenario_runs["sgd_batchnorm"][0]["replicas"] == 1


def test_custom_loop_primitives(scenario_runs):
    _, workers = scenario_runs["sgd_batchnorm"]
    for worker in workers:
        assert worker["broadcast"] == {"from": 0, "tag": "hello"}
        assert worker["local_results"] == 1
        assert worker["reduce_sum"] == 3.0          # (0 + 1) + (1 + 1)
        assert worker["reduce_mean"] == 1.5
        assert worker["reduce_nested_sum"] == [3.0, [3.0, 3.0, 3.0], 6.0, "float16"]
        assert worker["reduce_nested_mean"] == [1.5, [1.5, 1.5, 1.5], 3.0, "float16"]
        assert worker["distributed_sums"] == [28.0, 92.0]   # sum(0..7), sum(8..15)


def test_peer_killed_mid_epoch_survivors_name_it(tmp_path):
    # Each worker exits on its own: the launcher would stop the survivors itself.
    watched = watch_gang(_fit_scenario(str(tmp_path), "--kill-worker", "1", "--kill-after-batch", "3",
                                       "--seconds-per-batch", "0.2"), 3, GANG_TIMEOUT, env=worker_env("jax", lean=True))
    outputs = {index: watched.lines(index) for index in range(3)}
    log = "\n".join(f"--- worker {i}\n{text[-3000:]}" for i, text in outputs.items())
    assert None not in watched.codes.values(), log
    crash = re.search(r"simulating a crash at ([0-9.]+)", outputs[1])
    assert crash and watched.codes[1] == 9, log
    for survivor in (0, 2):
        assert watched.codes[survivor] != 0, log
        assert watched.exit_times[survivor] - float(crash.group(1)) <= 60, log
        assert f"lost worker 1 (worker:1 at {watched.addresses[1]})" in outputs[survivor], log
        assert "worker 0 (" not in outputs[survivor].split("lost ", 1)[1].split(" during")[0], log
        assert "worker 2 (" not in outputs[survivor].split("lost ", 1)[1].split(" during")[0], log


def test_a_remote_peer_is_named_lost_only_when_jax_knows_it(tmp_path):
    """`JaxFaults.gone` on the real coordination service, each worker taking its peer for a
    remote one (`tests/workers/jax_remote_peers.py`): a living remote peer is never named (the
    chief used to be, whenever it had not checked in yet), and asking costs no wait."""
    gang = run_gang(python_worker("jax_remote_peers.py", str(tmp_path)), 2, 120, env=worker_env("jax", lean=True))
    assert gang.returncode == 0, gang.output[-5000:]
    chief, worker = (load_result(str(tmp_path), index) for index in (0, 1))
    log = f"{chief}\n{worker}\n{gang.output[-3000:]}"
    assert "error" not in chief and "error" not in worker, log
    assert chief["answers"]["remote worker 1 alive"][0] == [], log
    assert worker["answers"]["remote chief alive"][0] == [], log
    assert chief["answers"]["remote worker 1 alive"][1] < 1.0, log   # no barrier, no wait
    assert worker["answers"]["remote chief alive"][1] < 5.0, log     # one read of the service


def test_a_chief_working_on_after_the_last_collective_ends_cleanly(tmp_path):
    """The chief works alone for longer than JAX's shutdown barrier waits (as when it saves a large
    model) while worker 1's script ends: both exit 0 and the chief finishes its work; worker 1
    says whom it waits for (`JaxFaults.leave_together`). Before, the chief was aborted mid-work."""
    from keras_mwms.backends.jax.engine import SHUTDOWN_TIMEOUT_SECONDS
    from keras_mwms.backends.jax.faults import LEAVING_NOTICE_SECONDS

    seconds = max(SHUTDOWN_TIMEOUT_SECONDS, LEAVING_NOTICE_SECONDS) + 10   # worker 1 may start waiting late
    gang = run_gang(python_worker("jax_leaving.py", str(tmp_path), str(seconds)), 2, GANG_TIMEOUT,
                    env=worker_env("jax", lean=True))
    log = gang.output[-5000:]
    assert gang.returncode == 0, log
    assert all(load_result(str(tmp_path), index)["completed"] for index in (0, 1)), log
    assert "worker 1 finished its script and waits for worker 0 to finish its own" in log, log


def test_a_script_that_catches_our_error_ends_with_its_own_exit_status(tmp_path):
    """Every worker's last `fit` raises (targets of another length); the script catches it and
    calls `sys.exit(7)`: the job ends with status 7 on every worker, as on TensorFlow and torch
    (before: 1, each worker leaving without JAX's shutdown barrier as if the error were fatal)."""
    gang = run_gang(python_worker("jax_leaving.py", str(tmp_path), "0", "7"), 2, GANG_TIMEOUT,
                    env=worker_env("jax", lean=True))
    log = gang.output[-5000:]
    assert gang.returncode == 7, log
    assert all("caught" in load_result(str(tmp_path), index) for index in (0, 1)), log
    assert "exits without JAX's shutdown barrier" not in log, log


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
