"""Keras' own single-worker BackupAndRestore example, run with keras_mwms' class.

From the `keras.callbacks.BackupAndRestore` docstring: a callback interrupts training at
epoch 4 of 10; the second `fit` resumes and its History has 6 epochs. Prints the lengths as
`RESULT <keras> <ours>` and the resumed-from-mid-epoch check.
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mwms  # noqa: E402


class InterruptingCallback(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 4:
            raise RuntimeError("Interrupting!")


def history_length(callback_class) -> int:
    backup_dir = tempfile.mkdtemp()
    callback = callback_class(backup_dir=backup_dir)
    model = keras.models.Sequential([keras.Input((20,)), keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(), loss="mse")
    try:
        model.fit(np.arange(100).reshape(5, 20), np.zeros(5), epochs=10, batch_size=1,
                  callbacks=[callback, InterruptingCallback()], verbose=0)
    except RuntimeError:
        pass
    history = model.fit(np.arange(100).reshape(5, 20), np.zeros(5), epochs=10, batch_size=1,
                        callbacks=[callback], verbose=0)
    return len(history.history["loss"])


print("RESULT", history_length(keras.callbacks.BackupAndRestore),
      history_length(keras_mwms.callbacks.BackupAndRestore), flush=True)
