"""compat.v1 methods and known multi-worker pitfalls (a partial batch's MEAN, `task_type` branching,
a strategy created after the backend ran) on 2 real workers per backend: the surface in the
suite's shared warm gangs, the late strategy in fresh gangs (a fresh process is its point)."""

from __future__ import annotations

import json

import pytest

from keras_mwms.startup.cluster import TFConfigClusterResolver
from tests.multiworker import python_worker, watch_gang, worker_env
from tests.shared_gangs import SHARED, gang
from tests.workers.common import load_result

BACKENDS = ["tensorflow", "jax", "torch"]


# In the suite's shared warm gang of 2 of each backend (`tests/shared_gangs.py`).
for _backend in BACKENDS:
    SHARED.add(__name__, gang(_backend, 2), "compat", "compat_scenario", ["{out}"], seconds=300)


@pytest.fixture(scope="module", params=BACKENDS)
def results(request, shared_runs):
    out = shared_runs.folder(gang(request.param, 2), __name__, "compat")
    return request.param, [load_result(out, index) for index in range(2)]


def test_partial_batch_reduce_uses_the_global_denominator(results):
    _, (chief, worker) = results
    for observed in (chief, worker):
        assert observed["reduce_sum_axis0"] == pytest.approx(15.0)
        assert observed["reduce_mean_axis0"] == pytest.approx(2.5)  # 15 / 6 rows, not / 2 replicas
        assert observed["reduce_mean_none"] == pytest.approx([1.5, 3.0])
        assert observed["reduce_sum_none"] == pytest.approx([3.0, 6.0])


def test_dataset_and_input_fn_iterators(results):
    _, (chief, worker) = results
    assert chief["dataset_iterator_first"] == [[[0.0, 1.0], [2.0, 3.0]]]
    assert worker["dataset_iterator_first"] == [[[4.0, 5.0], [6.0, 7.0]]]
    assert chief["input_fn_first"] == [[0, 2]] and worker["input_fn_first"] == [[1, 3]]
    assert "PER_WORKER" in chief["bad_mode"]


def test_update_config_proto_is_tensorflow_only(results):
    backend, (chief, _) = results
    if backend == "tensorflow":
        assert chief["update_config_proto"] == "ConfigProto"
    else:
        assert chief["update_config_proto"].startswith("NotImplementedError")
        assert "KERAS_BACKEND=tensorflow" in chief["update_config_proto"]


def test_task_type_branching_and_accelerators(results):
    _, (chief, worker) = results
    assert (chief["task_type"], chief["task_id"], worker["task_id"]) == ("worker", 0, 1)
    assert chief["branch"] == "worker 0" and worker["branch"] == "worker 1"
    assert chief["num_accelerators"] == {}


def test_ps_tasks_are_ignored_with_a_warning():
    config = json.dumps({"cluster": {"worker": ["a:1", "b:1"], "ps": ["p:1"]},
                         "task": {"type": "worker", "index": 0}})
    with pytest.warns(UserWarning, match="never waited for"):
        resolver = TFConfigClusterResolver(tf_config=config)
    assert resolver.worker_addresses == ["a:1", "b:1"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_strategy_after_the_backend_ran_is_handled_or_explained(backend):
    # Each worker ends on its own: a failed chief must not stop the other before it reports.
    gang = watch_gang(python_worker("late_strategy.py"), 2, deadline=300, env=worker_env(backend, lean=True))
    outcomes = [line for worker in (0, 1) for line in gang.lines(worker).splitlines() if line.startswith("RESULT")]
    assert len(outcomes) == 2, gang.output[-6000:]
    if backend == "torch":  # torch needs no start-up configuration: it simply works
        assert all(line == "RESULT ok 2" for line in outcomes), outcomes
    else:
        for line in outcomes:
            assert "Create the strategy first, right after the imports" in line, line


def test_a_torch_process_group_that_contradicts_tf_config_is_a_clear_error():
    gang = watch_gang(python_worker("late_strategy.py", "--own-process-group"), 2, deadline=300,
                      env=worker_env("torch", lean=True))
    outcomes = [line for worker in (0, 1) for line in gang.lines(worker).splitlines() if line.startswith("RESULT")]
    assert len(outcomes) == 2, gang.output[-6000:]
    for line in outcomes:
        assert line.startswith("RESULT error RuntimeError"), line
        assert "already initialised" in line and "with 1 process(es), this one at index 0" in line, line
        assert "TF_CONFIG describes 2 worker(s)" in line, line

