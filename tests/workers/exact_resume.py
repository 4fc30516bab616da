"""Exact and elastic resume: shuffled fits killed at chosen steps, restarted, each step ledgered.

    python exact_resume.py --out OUT --plan JSON

`--plan` is a list of jobs run one after the other in this process, each
`{"name": ..., "variant": "arrays" | "pydataset" | "dataloader", "kills": [positions]}`.
A job builds the same model from the same seed and fits it with `shuffle=True` for
`EPOCHS` epochs with `keras_mwms.callbacks.BackupAndRestore(OUT/<name>/backup,
save_freq=SAVE_FREQ)` and `keras_mwms.example_ledger.ExampleLedger(OUT/<name>/ledger)`.
After the global step that ends at stream position `p` (global steps since the job's start)
for a `p` in `kills`, the job's last worker writes `OUT/<name>/killed-<p>` and SIGKILLs itself
(once per position: the marker survives the restart). A job every worker finished leaves
`OUT/<name>/w<index>.npz` (final weights) and `done.w<index>`; a restarted process skips its
finished jobs and resumes the unfinished one from its backup — whatever the worker count of
the new gang.

So one launcher run with `--max-restarts K` serves an uninterrupted reference job and K killed
jobs of the same model: every job's final weights must be the reference's, and every job's
ledger must show each example once per epoch.
"""

import argparse
import json
import os
import signal
import sys

import common

ROWS, GLOBAL_BATCH, EPOCHS, SAVE_FREQ, SEED = 60, 8, 2, 3, 21
STEPS_PER_EPOCH = -(-ROWS // GLOBAL_BATCH)

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--plan", required=True)
arguments = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mwms  # noqa: E402
from keras_mwms.example_ledger import ExampleLedger  # noqa: E402

strategy = keras_mwms.MultiWorkerMirroredStrategy()
index, workers = strategy.worker_index, strategy.num_workers
X, Y = common.regression_data(rows=ROWS, seed=5)


class Batches(keras.utils.PyDataset):
    """The rows in fixed batches of GLOBAL_BATCH; `shuffle=True` shuffles the batch order."""

    def __init__(self):
        super().__init__()

    def __len__(self):
        return STEPS_PER_EPOCH

    def __getitem__(self, batch):
        rows = slice(batch * GLOBAL_BATCH, (batch + 1) * GLOBAL_BATCH)
        return X[rows], Y[rows]


def fit_arguments(variant: str) -> dict:
    if variant == "arrays":
        return {"x": X, "y": Y, "batch_size": GLOBAL_BATCH}
    if variant == "pydataset":
        return {"x": Batches()}
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return {"x": DataLoader(TensorDataset(torch.from_numpy(X), torch.from_numpy(Y)),
                            batch_size=GLOBAL_BATCH, shuffle=True)}


class Killer(keras.callbacks.Callback):
    """SIGKILLs the last worker after the steps ending at the job's kill positions (once each)."""

    def __init__(self, directory: str, kills: list):
        super().__init__()
        self.directory, self.kills, self.epoch = directory, set(kills), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        position = self.epoch * STEPS_PER_EPOCH + batch + 1
        marker = os.path.join(self.directory, f"killed-{position}")
        if position in self.kills and index == workers - 1 and not os.path.exists(marker):
            with open(marker, "w") as handle:
                handle.write(json.dumps({"workers": workers}))
            common.log(f"fault injection: SIGKILL after stream position {position} "
                       f"({workers} workers)")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


for job in json.loads(arguments.plan):
    directory = os.path.join(arguments.out, job["name"])
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(os.path.join(directory, f"done.w{index}")):
        continue
    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        model = common.mlp(hidden=16)
        # A learning-rate schedule: a restored job must continue at the optimizer's step.
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=4, decay_rate=0.7)
        model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
    callbacks = [keras_mwms.callbacks.BackupAndRestore(os.path.join(directory, "backup"),
                                                       save_freq=SAVE_FREQ),
                 ExampleLedger(os.path.join(directory, "ledger")),
                 Killer(directory, job.get("kills", []))]
    model.fit(**fit_arguments(job["variant"]), epochs=EPOCHS, shuffle=True, callbacks=callbacks,
              verbose=0)
    np.savez(os.path.join(directory, f"w{index}.npz"), *model.get_weights())
    with open(os.path.join(directory, f"done.w{index}"), "w") as handle:
        handle.write(json.dumps({"workers": workers, "attempt": os.environ.get("KERAS_MWMS_ATTEMPT"),
                                 "iterations": int(keras.ops.convert_to_numpy(
                                     model.optimizer.iterations.value))}))
    common.log(f"job {job['name']} done on {workers} workers")
common.log("done")
