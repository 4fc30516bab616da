"""Uses `keras_mwms.callbacks.TensorBoard` every way a job can; the test then lists `$TMPDIR`.

A non-chief worker writes its summaries into a private `keras_mwms-tensorboard-*` directory
under `$TMPDIR`. This script builds one callback it never uses, trains with another (printing
what is left right after `fit`), evaluates with it (so only the exit hook can clean up), and
finally trains with it again until a callback raises, which ends the worker with exit code 1
and, on JAX, through the backend's `os._exit`.
"""

import argparse
import os
import signal
import tempfile

import common

parser = argparse.ArgumentParser()
parser.add_argument("--log-dir", required=True)
arguments = parser.parse_args()

import keras  # noqa: E402

import keras_mwms  # noqa: E402


def scratch_dirs() -> list[str]:
    return sorted(name for name in os.listdir(tempfile.gettempdir())
                  if name.startswith("keras_mwms-tensorboard-"))


class Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("interrupted on purpose")


never_used = keras_mwms.callbacks.TensorBoard(arguments.log_dir)
strategy = keras_mwms.MultiWorkerMirroredStrategy()
x, y = common.regression_data(rows=64)
with strategy.scope():
    model = common.mlp(hidden=4)
    model.compile(optimizer="sgd", loss="mse")

tensorboard = keras_mwms.callbacks.TensorBoard(arguments.log_dir)
model.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), callbacks=[tensorboard],
          verbose=0)
common.log(f"scratch after fit: {scratch_dirs()}")
model.evaluate(x, y, batch_size=16, callbacks=[tensorboard], verbose=0)
common.log(f"scratch after evaluate: {scratch_dirs()}")
# When the other worker fails first the test's gang stops this one with SIGTERM, which would
# end it before its exit hooks run; the gang's grace period bounds the wait instead.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
model.fit(x, y, batch_size=16, epochs=2, callbacks=[tensorboard, Interrupt()], verbose=0)
