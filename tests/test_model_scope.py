"""A model created outside `strategy.scope()` or before the strategy (`keras_mwms.backends.model_scope`).

Real gangs of 2 workers on every backend (`tests/workers/model_outside_scope.py`), each
worker left to end by itself (`watch_gang`): `fit` of such a model must stop every worker
with one error naming where the model was created and the fix, before any collective (so no
worker waits for another); on TensorFlow and JAX a model built before the strategy already
stops the strategy's creation, with its own message. Before issue 31, torch and TensorFlow
trained each worker alone and exited 0 with different weights on each.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

import pytest

from tests.multiworker import WORKERS_DIR, concurrently, selected_params, watch_gang, worker_env

BACKENDS = ("tensorflow", "jax", "torch")
MODES = ("outside", "before")
DEADLINE = 180
TIMES: list[str] = []


def _gang(backend: str, mode: str, out: str):
    marker = f"kmwms-scope-{uuid.uuid4().hex[:12]}"
    os.makedirs(out, exist_ok=True)
    return watch_gang([sys.executable, str(WORKERS_DIR / "model_outside_scope.py"), out, mode, marker], 2,
                      deadline=DEADLINE, env=worker_env(backend, lean=True), marker=marker)


@pytest.fixture(scope="module")
def gangs(request, tmp_path_factory):
    """The selected (backend, mode) gangs, three at a time."""
    jobs = selected_params(request, "backend", "mode")
    outs = {job: str(tmp_path_factory.mktemp(f"scope_{job[0]}_{job[1]}")) for job in jobs}
    runs = {job: (run, outs[job]) for job, run in concurrently(lambda job: _gang(*job, outs[job]), jobs).items()}
    yield runs
    print("\nmodel outside the scope: seconds from fit (or the strategy) to the error, per worker:")
    for line in TIMES:
        print(f"  {line}")


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_of_a_model_created_outside_the_scope_stops_every_worker_with_the_fix(gangs, backend, mode):
    run, out = gangs[(backend, mode)]
    described = f"[{backend} {mode}] codes {run.codes}\n{run.output[-6000:]}"
    assert run.codes == {0: 1, 1: 1}, described          # every worker ended by itself, with an error
    assert not run.orphans, described
    for worker in (0, 1):
        with open(os.path.join(out, f"w{worker}.json")) as handle:
            result = json.load(handle)
        TIMES.append(f"{backend:<11} {mode:<8} worker {worker}: {result['stage']} {result['seconds']:.2f} s")
        message = result["message"]
        if mode == "before" and backend != "torch":
            assert (result["stage"], result["type"]) == ("strategy", "StrategyCreatedTooLateError"), described   # a RuntimeError
            assert "before keras_mwms.MultiWorkerMirroredStrategy() was created" in message, described
            assert "Create the strategy first" in message, described
            continue
        where = ("outside strategy.scope()" if mode == "outside"
                 else "before keras_mwms.MultiWorkerMirroredStrategy() was created")
        assert (result["stage"], result["type"]) == ("fit", "ValueError"), described
        assert message.startswith(f"keras_mwms worker {worker}: model.fit() on a model created {where}"), described
        assert "different weights on each" in message, described
        assert "Build and compile the model inside `with strategy.scope():`" in message, described
        assert result["seconds"] < 5, described           # at fit's entry: no collective, no timeout
        if mode == "outside" and worker == 0:   # evaluate and predict ran on the chief alone, warned
            assert len(result["alone"]) == 2, described
