"""Side-by-side steps/s on one gang: keras_mwms' flat path, its DataParallel path, plain DataParallel.

    KERAS_BACKEND=jax python -m keras_mwms.launch --workers 2 tests/workers/jax_bench.py [ROUNDS]

Same model (MLP 32→128→128→10), same global batch (64), same synthetic data, interleaved round
by round so load bursts hit every variant alike. "flat" is keras_mwms' default (one flat
gradient all-reduce per step); "keras_mwms DataParallel" is the model pinned to keras_mwms'
previous path; "plain DataParallel" feeds each process its pre-cut shard through Keras' own,
unpatched fit under `keras.distribution.DataParallel`, as the probe did.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KERAS_BACKEND", "jax")

import common  # noqa: E402,F401  (puts the repo on sys.path)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mwms  # noqa: E402
from keras_mwms.data import worker_row_indices  # noqa: E402

GLOBAL_BATCH, ROWS, EPOCHS = 64, 4096, 4
strategy = keras_mwms.MultiWorkerMirroredStrategy()
rng = np.random.RandomState(123)
x = rng.randn(ROWS, 32).astype("float32")
y = (x @ rng.randn(32, 10).astype("float32")).argmax(-1).astype("int32")


ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
distribution = strategy.backend.distribution


def build(path=None):
    keras.utils.set_random_seed(0)
    with distribution.scope() if path == "plain" and distribution is not None else strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    if path is not None:
        strategy.backend.pin_path(model, "dataparallel")
    return model


class EpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter())


def steps_per_second(clock):
    steps = ROWS // GLOBAL_BATCH
    return (len(clock.times) - 1) * steps / (clock.times[-1] - clock.times[0])


rows = np.concatenate(worker_row_indices(ROWS, GLOBAL_BATCH, strategy.num_workers, strategy.worker_index))
plain_fit = strategy.backend.patch_table().original("fit-global-batches")


def fit_flat():
    model, clock = build(), EpochClock()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[clock])
    return model, clock


def fit_keras_mwms_data_parallel():
    model, clock = build("dataparallel"), EpochClock()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[clock])
    return model, clock


def fit_plain():
    model, clock = build("plain"), EpochClock()
    with distribution.scope() if distribution is not None else strategy.scope():
        plain_fit(model, x[rows], y[rows], batch_size=GLOBAL_BATCH // strategy.num_workers, epochs=EPOCHS,
                  shuffle=False, verbose=0, callbacks=[clock])
    return model, clock


VARIANTS = {"keras_mwms flat": fit_flat, "keras_mwms DataParallel": fit_keras_mwms_data_parallel,
            "plain DataParallel": fit_plain}
best = dict.fromkeys(VARIANTS, 0.0)
weights = {}
for _ in range(ROUNDS):
    for name, run in VARIANTS.items():
        model, clock = run()
        best[name] = max(best[name], steps_per_second(clock))
        weights[name] = model.get_weights()
        strategy.barrier(name)
differences = {name: max(float(np.abs(a - b).max()) for a, b in zip(weights[name], weights["plain DataParallel"]))
               for name in VARIANTS if name != "plain DataParallel"}
print(f"worker {strategy.worker_index} path={strategy.backend.path}: "
      + " | ".join(f"{name} {value:.1f} steps/s" for name, value in best.items())
      + f" | flat/plain {best['keras_mwms flat'] / best['plain DataParallel']:.2f}"
      + " | max|w - w_plain|: " + ", ".join(f"{name} {value:.2e}" for name, value in differences.items()),
      flush=True)
