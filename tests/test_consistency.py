"""The safety net's rule (`keras_mwms.backends.consistency`) on thread-workers meeting at real
collectives (`tests/test_policy.py`'s `ThreadBackend`); the real gangs are in
`tests/test_user_scripts.py` (`one_worker_nudges_state`, and every healthy variant)."""

from __future__ import annotations

import numpy as np

from keras_mwms import WorkersDifferError
from keras_mwms.backends import consistency
from tests.test_policy import on_workers


def _state(backend, nudge_worker: int | None = None, extra_on: int | None = None):
    state = [("dense/kernel", np.arange(6, dtype=np.float32).reshape(2, 3)),
             ("batch_normalization/moving_mean", np.zeros(3, np.float32)),
             ("adam/iteration", np.array(7, np.int64))]
    if backend.worker_index == nudge_worker:
        state[1] = (state[1][0], state[1][1] + np.float32(1e-3))
    if backend.worker_index == extra_on:
        state.append(("extra/bias", np.zeros(2, np.float32)))
    return state


def test_workers_that_agree_pass_silently():
    assert on_workers(3, lambda backend: consistency.check_workers_agree(
        backend, _state(backend), "model.fit()")) == [None] * 3


def test_one_differing_worker_makes_every_worker_raise_naming_the_variable():
    results = on_workers(3, lambda backend: consistency.check_workers_agree(
        backend, _state(backend, nudge_worker=2), "model.fit()"))
    assert all(isinstance(error, WorkersDifferError) for error in results), results
    for index, error in enumerate(results):
        assert error.variable == "batch_normalization/moving_mean" and error.workers == [2]
        assert str(error).startswith(f"keras_mwms worker {index}: the workers' variables differ after model.fit()")
        assert "worker(s) 2 hold values different from the chief's" in str(error)


def test_a_variable_only_one_worker_has_is_a_difference_too():
    results = on_workers(2, lambda backend: consistency.check_workers_agree(
        backend, _state(backend, extra_on=1), "ModelCheckpoint at epoch 1"))
    assert all(isinstance(error, WorkersDifferError) for error in results), results
    assert all(error.workers == [1] and "variable #4 (the chief has 3)" in str(error) for error in results)


def test_the_switch_turns_the_check_off(monkeypatch):
    monkeypatch.setenv(consistency.ENABLE_ENV, "0")
    assert on_workers(2, lambda backend: consistency.check_workers_agree(
        backend, _state(backend, nudge_worker=1), "model.fit()")) == [None, None]


def test_any_changed_word_changes_the_fingerprint():
    for value in (np.linspace(0, 1, 7, dtype=np.float16), np.array([True, False, True]),
                  np.arange(12, dtype=np.float64).reshape(3, 4)):
        before = consistency.fingerprint("v", value)[2]
        for position in range(value.size):
            changed = value.copy().reshape(-1)
            changed[position] = ~changed[position] if changed.dtype == bool else changed[position] + 1
            assert consistency.fingerprint("v", changed.reshape(value.shape))[2] != before, (value, position)
    assert consistency.fingerprint("a", np.zeros(2))[2] != consistency.fingerprint("a", np.zeros((2, 1)))[2]


def test_names_are_not_compared():
    """Keras numbers names per process: a chief that reloaded a model (one more `sequential_N`)
    names later models differently from the other workers; their values still agree."""
    def state(backend):
        return [(f"sequential_{20 + 2 * backend.worker_index}/dense/kernel", np.ones((2, 2), np.float32))]

    assert on_workers(2, lambda backend: consistency.check_workers_agree(backend, state(backend), "x")) == [None] * 2
