"""TensorFlow accumulation and compression with several local replicas (one process, 2 logical CPUs).

    KERAS_BACKEND=tensorflow python tests/workers/tf_local_replicas.py

A worker with several local GPUs trains under `tf.distribute` with one replica per GPU. TF's
MultiWorkerMirroredStrategy takes local replicas from GPUs only, so this runs the same code
(`keras_mwms.backends.tensorflow.step.RowWeighting`'s patch rows, `accumulation`) under a
`tf.distribute.MirroredStrategy` over two logical CPU devices: the replicas of one worker.
Per scenario (K = 2; K = 2 with bf16; bf16 alone) it trains the same model as plain Keras on
one device, and prints one JSON line: max |Δw| vs one device, the reference's path length
(Σ over steps of the largest weight move), the ledger's window all-reduces, the bytes per
micro-step handed to the collectives, and the optimizer's iterations.
"""

from __future__ import annotations

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (puts the repository on sys.path)
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_mwms.backends.compression import WIRE  # noqa: E402
from keras_mwms.backends.patches import PatchTable  # noqa: E402
from keras_mwms.backends.tensorflow import patches  # noqa: E402
from keras_mwms.backends.tensorflow.step import RowWeighting  # noqa: E402
from keras_mwms.diagnostics import LEDGER  # noqa: E402

WANTED = ("tf-row-weighted-steps", "tf-row-weighted-loss-scale", "tf-row-weighted-loss-unscale",
          "tf-merge-call-in-cross-replica-context", "tf-all-reduce-before-update")
x = np.random.default_rng(0).normal(size=(192, 8)).astype("float32")
y = (x @ np.arange(1, 9, dtype="float32") / 8)[:, None]


def build(steps):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=steps), loss="mse")
    return model


def fit(model, callbacks=()):
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model.get_weights()


class PathLength(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.last, self.length = self.model.get_weights(), 0.0

    def on_train_batch_end(self, batch, logs=None):
        now = self.model.get_weights()
        self.length = max(self.length, max(float(np.abs(a - b).max()) for a, b in zip(now, self.last)) + self.length)
        self.last = now


strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
out = {"replicas": strategy.num_replicas_in_sync}
for name, steps, compression in (("k2", 2, None), ("k2_bf16", 2, "bf16"), ("bf16", None, "bf16")):
    path = PathLength()
    reference = fit(build(steps), [path])
    weighting = RowWeighting(strategy, compression=lambda compression=compression: compression)
    table = PatchTable("local-replicas", [row for row in patches.patch_table(
        types.SimpleNamespace(row_weighting=weighting, strategy=strategy)) if row.name in WANTED])
    table.install()
    try:
        with strategy.scope():
            model = build(steps)
        LEDGER.kinds.clear()
        WIRE.reset()
        with weighting.keras_loop(model):
            weights = fit(model)
    finally:
        table.uninstall()
    out[name] = {"delta": max(float(np.abs(a - b).max()) for a, b in zip(weights, reference)),
                 "path": path.length, "kinds": dict(LEDGER.kinds), "wire": WIRE.per_step(12),
                 "iterations": int(model.optimizer.iterations.numpy())}
print("RESULT " + json.dumps(out))
