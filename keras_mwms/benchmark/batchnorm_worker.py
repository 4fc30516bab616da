"""One worker of `python -m keras_mwms.benchmark batchnorm`: global against per-worker moments, timed.

Started by `keras_mwms.benchmark.batchnorm` with `TF_CONFIG`, `KERAS_BACKEND` and one compute
thread already set:

    python -m keras_mwms.benchmark.batchnorm_worker OUT.json SETTINGS.json

For each repeat, for each choice of `CommunicationOptions.batch_norm_statistics` in the
settings (alternating, so load drifts hit both alike): a fresh MLP with a BatchNormalization
after every hidden Dense (same seed), SGD, one fit of `warmup + steps` steps. The strategy's
options are swapped between fits (a model's moments are chosen when its step is first built);
a callback stamps every step's end, and the collective ledger counts the fit's collectives.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from keras_mwms.benchmark.compression_worker import run_gang_worker


def fit_once(strategy, settings: dict, statistics: str) -> dict:
    """One timed fit with `batch_norm_statistics=statistics`."""
    import keras
    import numpy as np

    from keras_mwms.diagnostics import LEDGER

    strategy.backend.options = dataclasses.replace(strategy.backend.options, batch_norm_statistics=statistics)
    keras.utils.set_random_seed(0)
    steps, warmup, batch = settings["steps"], settings["warmup"], settings["global_batch"]
    rows = (steps + warmup) * batch
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, settings["features"])).astype("float32")
    y = rng.integers(0, settings["classes"], rows).astype("int64")
    with strategy.scope():
        hidden = []
        for _ in range(settings["depth"]):
            hidden += [keras.layers.Dense(settings["width"], activation="relu"), keras.layers.BatchNormalization()]
        model = keras.Sequential([keras.Input((settings["features"],)), *hidden,
                                  keras.layers.Dense(settings["classes"])])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stamps: list[float] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            stamps.append(time.perf_counter())

    before = dict(LEDGER.kinds)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Stamp()])
    kinds = {kind: count - before.get(kind, 0) for kind, count in LEDGER.kinds.items()
             if count > before.get(kind, 0)}
    timed = len(stamps) - warmup
    return {"statistics": statistics, "steps": len(stamps),
            "seconds_per_step": (stamps[-1] - stamps[warmup - 1]) / timed,
            "collectives": kinds, "batch_norm_layers": settings["depth"]}


def main(argv: list[str]) -> int:
    return run_gang_worker(argv, lambda strategy, settings: [
        fit_once(strategy, settings, statistics)
        for _ in range(settings["repeats"]) for statistics in settings["statistics"]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
