"""Steps/s of one fit, through keras_mwms or through plain patched tf.distribute (the baseline).

    python -m keras_mwms.launch --workers 2 tests/workers/tensorflow_throughput.py keras_mwms
    python -m keras_mwms.launch --workers 2 tests/workers/tensorflow_throughput.py raw

`raw` builds `tf.distribute.MultiWorkerMirroredStrategy()` itself and applies only the two
Keras 3.15.1 crash fixes; `keras_mwms` uses `keras_mwms.MultiWorkerMirroredStrategy()`. Same
model, data and global batch; steps/s is measured over the epochs after the first.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

mode = sys.argv[1]
timeout_seconds = float(sys.argv[2]) if len(sys.argv) > 2 else None
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

if mode == "raw":
    from keras_mwms.backends import backend_class

    backend_class("tensorflow").crash_repairs().install()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    import keras_mwms

    options = keras_mwms.CommunicationOptions(timeout_seconds=timeout_seconds)
    strategy = keras_mwms.MultiWorkerMirroredStrategy(communication_options=options)

BATCH, ROWS, EPOCHS = 64, 64 * 100, 4
x, y = common.regression_data(ROWS)
keras.utils.set_random_seed(1)
with strategy.scope():
    model = common.mlp(hidden=64)
    model.compile(optimizer="adam", loss="mse")


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds.append(time.perf_counter() - self.started)


seconds: list[float] = []
model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[EpochTimer()])
steps_per_second = (ROWS // BATCH) * (EPOCHS - 1) / sum(seconds[1:])
with open("/proc/self/status") as status:
    threads = next(line.split()[1] for line in status if line.startswith("Threads:"))
common.log(f"RESULT mode={mode} timeout={timeout_seconds} steps/s={steps_per_second:.1f} "
           f"threads={threads} epochs_s={[round(s, 2) for s in seconds]}")
