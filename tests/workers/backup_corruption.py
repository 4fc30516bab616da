"""Single-process checks of BackupAndRestore's failure handling (no strategy needed).

1. Two backups kept (`double_checkpoint=True`); the latest one's state file is corrupted; the
   next fit logs a warning (logger "keras_mwms") and resumes from the previous backup.
2. The same corruption without `double_checkpoint` is a clear BackupAndRestoreError.
3. An unwritable backup directory (its parent is a file) is a clear error at the first backup.
Prints one `RESULT <name> <value>` line per check.
"""

import io
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mwms  # noqa: E402

x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)


def model():
    keras.utils.set_random_seed(0)
    built = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    built.compile(optimizer="sgd", loss="mse")
    return built


class RecordFirstEpoch(keras.callbacks.Callback):
    first = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.first is None:
            self.first = epoch


def fit(backup, epochs, **options):
    recorder = RecordFirstEpoch()
    model().fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=[
        keras_mwms.callbacks.BackupAndRestore(backup, delete_checkpoint=False, **options), recorder])
    return recorder.first


def corrupt_latest(backup):
    pointer = json.loads(Path(backup, "latest.json").read_text())
    Path(backup, pointer["current"], "state.npz").write_bytes(b"not a numpy archive")


backup = tempfile.mkdtemp()
fit(backup, 3, double_checkpoint=True)
corrupt_latest(backup)
logged = io.StringIO()
handler = logging.StreamHandler(logged)
handler.setLevel(logging.WARNING)
logging.getLogger("keras_mwms").addHandler(handler)
first = fit(backup, 4, double_checkpoint=True)
logging.getLogger("keras_mwms").removeHandler(handler)
print("RESULT fallback_first_epoch", first, flush=True)
print("RESULT fallback_warned", "previous one" in logged.getvalue(), flush=True)

backup = tempfile.mkdtemp()
fit(backup, 2)
corrupt_latest(backup)
try:
    fit(backup, 3)
    print("RESULT corrupt_error none", flush=True)
except keras_mwms.callbacks.BackupAndRestoreError as error:
    print("RESULT corrupt_error", "double_checkpoint=True" in str(error), flush=True)

blocker = os.path.join(tempfile.mkdtemp(), "a-file")
Path(blocker).write_text("a file where the backup directory's parent should be")
try:
    fit(os.path.join(blocker, "backup"), 1)
    print("RESULT unwritable none", flush=True)
except keras_mwms.callbacks.BackupAndRestoreError as error:
    print("RESULT unwritable", "could not write a backup" in str(error) and blocker in str(error),
          flush=True)
