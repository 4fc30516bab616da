"""`keras_mwms.backends.fit_call` alone: one process, a fake backend and fake hooks that record.

The policy's order (scope, TF_CONFIG, shuffles, row checks, Keras' input rules, prepare_fit,
feed, loop, workers-agree) and its branches (a model of no strategy, fit's validation pass,
an input already fed, a non-chief's progress) are checked here without any worker process;
the real gangs (`tests/test_user_scripts.py`, `tests/test_model_scope.py`) check the backends.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest

from keras_mwms.backends import fit_call


class FakeBackend:
    """Two workers seen from `worker_index`; every collective is recorded (the peer mirrors us)."""

    def __init__(self, log: list, worker_index: int = 0, ours: bool = True):
        self.log, self.worker_index, self.ours = log, worker_index, ours
        self.num_workers, self.is_chief = 2, worker_index == 0

    def uses(self, model):
        return self.ours

    def check_tf_config_unchanged(self, stacklevel):
        self.log.append("tf_config")

    def all_reduce(self, array, op="sum"):
        self.log.append("row check")
        return np.repeat(array[[self.worker_index]], self.num_workers, axis=0)

    def broadcast_object(self, value, root=0):
        self.log.append("broadcast")
        return value

    def check_workers_agree(self, model, where):
        self.log.append(f"agree {where}")


class RecordingHooks(fit_call.FitHooks):
    def __init__(self, log: list, fed: bool = False):
        self.log, self.is_fed = log, fed

    def fed(self, x):
        return self.is_fed

    def alone(self, call):
        self.log.append("alone")
        return call.keras()

    def align_shuffles(self, call):
        self.log.append("align")

    def feed(self, call):
        self.log.append("feed")

    @contextlib.contextmanager
    def loop(self, call):
        self.log.append("loop")
        yield

    @contextlib.contextmanager
    def guard(self, call):
        try:
            yield
        except RuntimeError as error:
            self.log.append(f"guard {error}")
            raise


class Model:
    name = "model"


def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    self.seen = dict(x=x, y=y, verbose=verbose, sample_weight=sample_weight, class_weight=class_weight,
                     validation_data=validation_data, validation_split=validation_split)
    return "history"


def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
             callbacks=None, return_dict=False, **kwargs):
    self.seen = dict(x=x, verbose=verbose)
    return "logs"


def _call(method, function, backend, hooks, *args, **kwargs):
    return fit_call.run(fit_call.FitCall(method, function, Model(), backend, args, kwargs), hooks)


def test_fit_runs_the_policy_in_one_order():
    log: list = []
    x, y = np.zeros((8, 2)), np.zeros(8)
    assert _call("fit", fit, FakeBackend(log), RecordingHooks(log), x, y, batch_size=4) == "history"
    assert log == ["tf_config", "align", "row check", "feed", "loop", "agree model.fit()"]


def test_validation_rows_are_checked_at_fit_entry_and_its_validation_pass_is_keras_own():
    log: list = []
    backend, hooks = FakeBackend(log), RecordingHooks(log)
    _call("fit", fit, backend, hooks, np.zeros((8, 2)), np.zeros(8), validation_data=(np.zeros((4, 2)), np.zeros(4)))
    assert log.count("row check") == 2
    log.clear()
    assert _call("evaluate", evaluate, backend, hooks, np.zeros((4, 2)), _use_cached_eval_dataset=True) == "logs"
    assert log == ["tf_config"]


def test_validation_split_comes_before_class_weights_as_in_keras():
    log: list = []
    model = Model()
    x, y = np.zeros((8, 2)), np.array([0, 1] * 4)
    fit_call.run(fit_call.FitCall("fit", fit, model, FakeBackend(log), (x, y),
                                  {"validation_split": 0.25, "class_weight": {1: 3.0}}), RecordingHooks(log))
    assert model.seen["sample_weight"].tolist() == [1.0, 3.0] * 3
    assert model.seen["class_weight"] is None and model.seen["validation_split"] == 0.0
    validation_x, validation_y, validation_weights = model.seen["validation_data"]
    assert validation_x.shape == (2, 2) and validation_weights is None   # Keras weighs no validation rows


def test_class_weight_with_sample_weight_is_keras_error():
    log: list = []
    with pytest.raises(ValueError, match="You cannot `class_weight` and `sample_weight` at the same time"):
        _call("fit", fit, FakeBackend(log), RecordingHooks(log), np.zeros((4, 1)), np.zeros(4),
              class_weight={0: 1.0}, sample_weight=np.ones(4))


def test_a_model_of_no_strategy_runs_alone_with_a_warning_and_no_collective():
    log: list = []
    backend = FakeBackend(log, ours=False)
    with pytest.warns(UserWarning, match="runs on this worker alone"):
        assert _call("evaluate", evaluate, backend, RecordingHooks(log), np.zeros((4, 1))) == "logs"
    assert log == ["tf_config", "alone"]


def test_fit_of_a_model_of_no_strategy_stops_before_anything():
    log: list = []
    with pytest.raises(ValueError, match="model.fit\\(\\) on a model created"):
        _call("fit", fit, FakeBackend(log, ours=False), RecordingHooks(log), np.zeros((4, 1)))
    assert log == []


def test_a_non_chief_is_quiet_and_an_input_already_fed_is_not_checked():
    log: list = []
    model = Model()
    fit_call.run(fit_call.FitCall("evaluate", evaluate, model, FakeBackend(log, worker_index=1), (object(),), {}),
                 RecordingHooks(log, fed=True))
    assert model.seen["verbose"] == 0
    assert log == ["tf_config", "loop"]


def test_the_guard_sees_errors_of_keras_loop():
    log: list = []

    def failing(self, x=None, verbose="auto"):
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError):
        _call("predict", failing, FakeBackend(log), RecordingHooks(log), np.zeros((2, 1)))
    assert log == ["tf_config", "feed", "guard peer gone"]


def test_the_wrapper_keeps_keras_signature_and_is_keras_own_without_a_strategy():
    wrapped = fit_call.replacement("fit", fit_call.FitHooks())(fit)
    assert wrapped.__wrapped__ is fit
    model = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert wrapped(model, 1, 2) == "history" and model.seen["x"] == 1
