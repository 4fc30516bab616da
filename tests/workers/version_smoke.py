"""Version smoke worker: 2 epochs of SGD on a small MLP, as a worker or as plain Keras.

Runs in each worker of a gang (`keras_mwms.MultiWorkerMirroredStrategy`) and, with
`--reference`, as one process of plain Keras (no keras_mwms) — whatever Keras release the
environment carries (`scripts/version_smoke.py` puts an overlay first on PYTHONPATH).

With `--backup DIR --kill-at-step K`, worker 1 SIGKILLs itself after global step K on the
launcher's first attempt; `keras_mwms.callbacks.BackupAndRestore(DIR, save_freq=4)` makes the
restarted gang resume at the saved step, so its final weights must equal the reference's.

Writes `<out>/w<index>.npz` (final weights) and `<out>/w<index>.json` (Keras version, history,
evaluate loss).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import common

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--reference", action="store_true", help="one process of plain Keras")
parser.add_argument("--backup", default=None)
parser.add_argument("--kill-at-step", type=int, default=-1)
arguments = parser.parse_args()

import keras  # noqa: E402

EPOCHS, GLOBAL_BATCH = 2, 32
x, y = common.regression_data(rows=256)


def build():
    keras.utils.set_random_seed(5)
    model = common.mlp(hidden=16)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


class KillWorkerOne(keras.callbacks.Callback):
    """SIGKILLs worker 1 after global step `step`, on the launcher's first attempt only."""

    def __init__(self, index: int, step: int):
        super().__init__()
        self.index, self.step, self.steps = index, step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if (self.index == 1 and self.steps == self.step
                and os.environ.get("KERAS_MWMS_ATTEMPT", "0") == "0"):
            common.log(f"fault injection: SIGKILL after step {self.steps}")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


if arguments.reference:
    index, model, callbacks = 0, build(), []
else:
    import keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    index = strategy.worker_index
    with strategy.scope():
        model = build()
    callbacks = []
    if arguments.backup:
        callbacks = [keras_mwms.callbacks.BackupAndRestore(arguments.backup, save_freq=4),
                     KillWorkerOne(index, arguments.kill_at_step)]

history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                    callbacks=callbacks)
loss = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)["loss"]
common.save_result(arguments.out, index, model, keras=keras.__version__, backend=keras.backend.backend(),
                   history=history.history, evaluate_loss=loss)
common.log("done", keras.__version__)
