"""Timing `model.fit` of the benchmark models through keras_mwms (and any Keras-style fit).

`timed_keras_fit` works for Keras 3 and for Keras 2 (`tf_keras`): it builds the model, runs one
epoch of `config.steps` global batches with a step clock callback, and returns a `FitTiming`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from keras_mwms.benchmark.config import BenchmarkConfig
from keras_mwms.benchmark.models import build_keras_model
from keras_mwms.benchmark.timing import FitTiming


def step_clock(keras_module, step_ends: list[float]):
    """A `keras_module` callback appending `time.perf_counter()` at every training step's end."""

    class StepClock(keras_module.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step_ends.append(time.perf_counter())

    return StepClock()


def timed_keras_fit(keras_module, variant: str, model_name: str, repeat: int, config: BenchmarkConfig,
                    build_model: Callable[[], object], fit: Callable[[object, list], object]) -> FitTiming:
    """Builds with `build_model()`, runs `fit(model, callbacks)` and times every step."""
    step_ends: list[float] = []
    setup_started = time.perf_counter()
    model = build_model()
    fit(model, [step_clock(keras_module, step_ends)])
    finished = time.perf_counter()
    return FitTiming.from_times(variant, model_name, repeat, step_ends, finished, setup_started,
                                config.warmup_steps, config.global_batch)


NO_LEDGER = "keras_mwms no-ledger"


def keras_mwms_fit(strategy, config: BenchmarkConfig, model_name: str, repeat: int, x, y,
                   variant: str = "keras_mwms") -> FitTiming:
    """`model.fit` of the global arrays through `strategy` (a keras_mwms strategy), timed."""
    import keras

    def build():
        with strategy.scope():
            return build_keras_model(keras, config, model_name)

    def fit(model, callbacks):
        model.fit(x, y, batch_size=config.global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)

    timing = timed_keras_fit(keras, variant, model_name, repeat, config, build, fit)
    strategy.barrier(f"{variant} fit {model_name} {repeat} done")
    return timing


def keras_mwms_fit_without_ledger(strategy, config: BenchmarkConfig, model_name: str, repeat: int,
                                  x, y) -> FitTiming:
    """`keras_mwms_fit` with the collective ledger and its timers off (every worker alike)."""
    from keras_mwms.diagnostics import LEDGER

    LEDGER.enabled = False
    try:
        return keras_mwms_fit(strategy, config, model_name, repeat, x, y, variant=NO_LEDGER)
    finally:
        LEDGER.enabled = True
