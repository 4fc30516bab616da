"""Fault-tolerance scenario: train with keras_mwms callbacks, optionally die, resume on restart.

`--keras-callbacks` uses Keras' own `BackupAndRestore` instead, unchanged: keras_mwms runs it as
its own while the strategy is active.

Run through the launcher (`--max-restarts`) so a killed gang is restarted and resumes from
the backup. Faults happen only on the first attempt (`KERAS_MWMS_ATTEMPT == 0`):

* `--kill-at-step K --kill-worker W`: worker W SIGKILLs itself after global training step K;
* `--kill-during-save N`: the chief dies (SIGKILL) half-way through writing its N-th backup;
* `--sigterm-at-step K --sigterm-worker W`: worker W receives SIGTERM (a preemption) after
  global step K; every worker must back up at the next check and exit with code 143.

Every worker appends the epochs it completes to `<out>/epochs.w<index>.jsonl`; at the end it
saves its final weights (`w<index>.npz`) and History (`w<index>.json`). ModelCheckpoint and
TensorBoard write under `<out>/ckpt_w<index>` and `<out>/tb_w<index>` so a non-chief write
would be visible.
"""

import argparse
import io as _io
import json
import os
import signal
import sys

import common

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--backup", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save-freq", default="epoch")
parser.add_argument("--kill-at-step", type=int, default=-1)
parser.add_argument("--kill-worker", type=int, default=1)
parser.add_argument("--kill-during-save", type=int, default=-1)
parser.add_argument("--double-checkpoint", action="store_true")
parser.add_argument("--sigterm-at-step", type=int, default=-1)
parser.add_argument("--sigterm-worker", type=int, default=1)
parser.add_argument("--preemption-check-steps", type=int, default=10)
parser.add_argument("--checkpoints", action="store_true", help="add ModelCheckpoint + TensorBoard")
parser.add_argument("--keras-callbacks", action="store_true",
                    help="Keras' own BackupAndRestore (run as keras_mwms' while the strategy is active)")
arguments = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mwms  # noqa: E402

strategy = keras_mwms.MultiWorkerMirroredStrategy()
index = strategy.worker_index
first_attempt = os.environ.get("KERAS_MWMS_ATTEMPT", "0") == "0"
os.makedirs(arguments.out, exist_ok=True)


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if first_attempt and arguments.kill_during_save >= 0 and strategy.is_chief:
    real_savez = np.savez
    saves = {"count": 0}

    def savez_then_die(handle, **arrays):
        saves["count"] += 1
        if saves["count"] < arguments.kill_during_save:
            return real_savez(handle, **arrays)
        buffer = _io.BytesIO()
        real_savez(buffer, **arrays)
        handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        handle.flush()
        common.log("fault injection: dying half-way through a backup write")
        die()

    np.savez = savez_then_die


class Faults(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if first_attempt and self.steps == arguments.kill_at_step and index == arguments.kill_worker:
            common.log(f"fault injection: SIGKILL after step {self.steps}")
            die()
        if first_attempt and self.steps == arguments.sigterm_at_step and index == arguments.sigterm_worker:
            common.log(f"fault injection: SIGTERM after step {self.steps}")
            os.kill(os.getpid(), signal.SIGTERM)


class EpochLog(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        with open(os.path.join(arguments.out, f"epochs.w{index}.jsonl"), "a") as handle:
            handle.write(json.dumps({"epoch": epoch, "attempt": os.environ.get("KERAS_MWMS_ATTEMPT"),
                                     **{k: float(v) for k, v in (logs or {}).items()}}) + "\n")


x, y = common.regression_data(rows=256)
x, y, x_val, y_val = x[:192], y[:192], x[192:], y[192:]
keras.utils.set_random_seed(3)
with strategy.scope():
    model = common.mlp(hidden=16)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])

save_freq = arguments.save_freq if arguments.save_freq == "epoch" else int(arguments.save_freq)
if arguments.keras_callbacks:
    backup = keras.callbacks.BackupAndRestore(arguments.backup, save_freq=save_freq,
                                              double_checkpoint=arguments.double_checkpoint)
else:
    backup = keras_mwms.callbacks.BackupAndRestore(arguments.backup, save_freq=save_freq,
                                                   double_checkpoint=arguments.double_checkpoint,
                                                   preemption_check_steps=arguments.preemption_check_steps)
callbacks = [backup, Faults(), EpochLog()]
if arguments.checkpoints:
    callbacks += [
        keras_mwms.callbacks.ModelCheckpoint(
            os.path.join(arguments.out, f"ckpt_w{index}", "model-{epoch:02d}.weights.h5"),
            monitor="val_loss", save_best_only=True, save_weights_only=True),
        keras_mwms.callbacks.TensorBoard(os.path.join(arguments.out, f"tb_w{index}")),
    ]
history = model.fit(x, y, batch_size=32, epochs=arguments.epochs, shuffle=False,
                    validation_data=(x_val, y_val), callbacks=callbacks, verbose=0)
common.save_result(arguments.out, index, model, history=history.history,
                   backup_exists_after_fit=os.path.exists(arguments.backup))
common.log("done")
