"""Full-disk scenario: train with BackupAndRestore or ModelCheckpoint writing to a full file system.

Run by `tests/test_checkpoint_disk.py` as a 2-worker gang whose backup (or checkpoint)
directory is a tiny tmpfs that is (nearly) full, so the chief's write fails with ENOSPC:

    python tests/workers/full_disk.py OUT_DIR --marker M (--backup DIR | --checkpoint PATH)

`--marker` only tags the command line, so the test can look for orphan processes. The epochs
each worker completes go to `OUT_DIR/epochs.w<index>.jsonl`; a worker that finishes (it
should not) writes `OUT_DIR/w<index>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--marker", default="")
parser.add_argument("--backup", default=None, help="BackupAndRestore directory")
parser.add_argument("--checkpoint", default=None, help="ModelCheckpoint file path")
parser.add_argument("--epochs", type=int, default=4)
arguments = parser.parse_args()

import keras  # noqa: E402

import keras_mwms  # noqa: E402

strategy = keras_mwms.MultiWorkerMirroredStrategy()
index = strategy.worker_index
os.makedirs(arguments.out, exist_ok=True)
keras.utils.set_random_seed(3)
x, y = common.regression_data(rows=128)
with strategy.scope():
    model = common.mlp(hidden=16)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")


class EpochLog(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        with open(os.path.join(arguments.out, f"epochs.w{index}.jsonl"), "a") as handle:
            handle.write(json.dumps({"epoch": epoch}) + "\n")


callbacks = [EpochLog()]
if arguments.backup:
    callbacks.insert(0, keras_mwms.callbacks.BackupAndRestore(arguments.backup, delete_checkpoint=False))
if arguments.checkpoint:
    callbacks.insert(0, keras_mwms.callbacks.ModelCheckpoint(
        arguments.checkpoint, monitor="loss", save_weights_only=True))
common.log(f"worker {index}: training")
model.fit(x, y, batch_size=32, epochs=arguments.epochs, shuffle=False, callbacks=callbacks, verbose=0)
common.save_result(arguments.out, index, model)
common.log("done")
