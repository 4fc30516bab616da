"""Side-by-side steps/s on one gang: keras_mwms `fit` vs plain Keras `DataParallel` fit.

    KERAS_BACKEND=jax python -m keras_mwms.launch --workers 2 tests/workers/jax_bench.py

Same model (MLP 32→128→128→10), same global batch (64), same synthetic data; the plain run
feeds each process its pre-cut shard through Keras' own (unpatched) fit, as the probe did.
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
from keras_mwms.backends import jax_patches  # noqa: E402
from keras_mwms.data import worker_row_indices  # noqa: E402

GLOBAL_BATCH, ROWS, EPOCHS = 64, 4096, 4
strategy = keras_mwms.MultiWorkerMirroredStrategy()
rng = np.random.RandomState(123)
x = rng.randn(ROWS, 32).astype("float32")
y = (x @ rng.randn(32, 10).astype("float32")).argmax(-1).astype("int32")


def build():
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
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


ours, ours_clock = build(), EpochClock()
ours.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[ours_clock])
plain, plain_clock = build(), EpochClock()
rows = np.concatenate(worker_row_indices(ROWS, GLOBAL_BATCH, strategy.num_workers, strategy.worker_index))
plain_fit = jax_patches._state["originals"].get("fit") or type(plain).fit
plain_fit(plain, x[rows], y[rows], batch_size=GLOBAL_BATCH // strategy.num_workers, epochs=EPOCHS,
          shuffle=False, verbose=0, callbacks=[plain_clock])
difference = max(float(np.abs(a - b).max()) for a, b in zip(ours.get_weights(), plain.get_weights()))
print(f"worker {strategy.worker_index}: keras_mwms fit {steps_per_second(ours_clock):.1f} steps/s | plain "
      f"keras.distribution.DataParallel fit {steps_per_second(plain_clock):.1f} steps/s | "
      f"max|w_keras_mwms - w_plain| = {difference:.2e}", flush=True)
