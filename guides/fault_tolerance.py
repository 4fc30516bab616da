"""
Title: Fault tolerance: BackupAndRestore, crashed workers and restarts
Author: The keras_mwms authors
Date created: 2026/12/02
Last modified: 2026/12/02
Description: Survive a killed worker: back up the training state, restart the gang, resume at the saved step.
"""

"""
## Introduction

Synchronous training is all-or-nothing: every step needs every worker, so when one worker
dies — a crash, an out-of-memory kill, a preempted machine — the step cannot finish anywhere.
keras_mwms never lets that become a hang: the surviving workers fail with an error naming the
lost worker. Recovery is by **restart**: start the whole gang again and continue from the last
backup. Two pieces make that work:

* `keras_mwms.callbacks.BackupAndRestore(backup_dir, save_freq=...)` — the chief backs up the
  weights, the optimizer state, the epoch and the step; on the next start every worker
  restores the same state and training resumes at that epoch **and step**;
* `python -m keras_mwms.launch --max-restarts K` — restarts the gang after a failure, up to K
  times (on a cluster your orchestrator does this: Kubernetes restart policies, Slurm requeue).

In this guide we kill a worker with `SIGKILL` in the middle of an epoch, let the launcher
restart the job, and check that the final weights equal those of a run that was never
interrupted.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

SMOKE = os.environ.get("KERAS_MWMS_GUIDE_SMOKE") == "1"
WORKDIR = tempfile.mkdtemp(prefix="keras_mwms_fault_guide_")

"""
## The training script

A small regression model, trained for 3 epochs of 8 steps, with a backup every 3 steps (and at
every epoch end). To simulate a crash, worker 1 kills itself after its 11th step — but only on
the first attempt: the launcher tells each worker which attempt it is in
`KERAS_MWMS_ATTEMPT`.
"""

TRAIN_SCRIPT = r'''
import os, signal, sys
import keras
import numpy as np
import keras_mwms

out_dir, backup_dir, crash = sys.argv[1], sys.argv[2], sys.argv[3] == "crash"
strategy = keras_mwms.MultiWorkerMirroredStrategy()

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

keras.utils.set_random_seed(7)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")


class CrashOnce(keras.callbacks.Callback):
    """Worker 1 dies hard after its 11th step, on the first attempt only."""

    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        first_attempt = os.environ.get("KERAS_MWMS_ATTEMPT") == "0"
        if crash and first_attempt and strategy.worker_index == 1 and self.steps == 11:
            print("worker 1: simulating a crash (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


backup = keras_mwms.callbacks.BackupAndRestore(backup_dir, save_freq=3)
# shuffle=False: see "What to know" below about shuffling and exact resumption.
model.fit(x, y, batch_size=32, epochs=3, shuffle=False, callbacks=[backup, CrashOnce()], verbose=2)
np.savez(os.path.join(out_dir, f"weights_{strategy.worker_index}.npz"), *model.get_weights())
'''

script = os.path.join(WORKDIR, "train.py")
with open(script, "w") as handle:
    handle.write(TRAIN_SCRIPT)


def launch(name, crash, max_restarts):
    out_dir = os.path.join(WORKDIR, name)
    os.makedirs(out_dir)
    completed = subprocess.run(
        [sys.executable, "-m", "keras_mwms.launch", "--workers", "2",
         "--max-restarts", str(max_restarts), script, out_dir,
         os.path.join(WORKDIR, name + "_backup"), "crash" if crash else "no-crash"],
        capture_output=True, text=True, timeout=900,
    )
    print(completed.stderr)  # the launcher's own messages
    if completed.returncode:
        print(completed.stdout[-3000:])
    return completed, out_dir


"""
## An uninterrupted run, for reference
"""

reference, reference_dir = launch("reference", crash=False, max_restarts=0)
assert reference.returncode == 0

"""
## A run that loses a worker mid-epoch

The launcher sees worker 1 die, stops worker 0, and starts both again. On the second start,
`BackupAndRestore` on the chief finds the last backup (taken right after the 11th step: the
3rd step of epoch 2), broadcasts it to every worker, and `fit` continues from epoch 2, step 3:
the steps already done are skipped, none is trained twice.
"""

crashed, crashed_dir = launch("crashed", crash=True, max_restarts=1)
assert crashed.returncode == 0
assert "restarting the gang" in crashed.stderr
resumed_lines = [line for line in crashed.stdout.splitlines() if "resuming from" in line]
print("\n".join(resumed_lines))
assert resumed_lines, "the restarted job should report where it resumed"

"""
## The result equals the uninterrupted run
"""


def weights(directory, worker):
    with np.load(os.path.join(directory, f"weights_{worker}.npz")) as data:
        return [data[key] for key in data.files]


difference = max(float(np.abs(a - b).max())
                 for a, b in zip(weights(reference_dir, 0), weights(crashed_dir, 0)))
print(f"max |w_restarted - w_reference| = {difference:.3g}")
assert difference <= 1e-6
assert not os.path.exists(os.path.join(WORKDIR, "crashed_backup")), "deleted after success"

"""
## What to know

* **Only the chief writes**, atomically (a temporary directory switched in by renaming a
  pointer file): a kill during a backup leaves the previous backup loadable. Add
  `double_checkpoint=True` to also keep the previous backup as a fallback against a corrupted
  file.
* **The chief reads and broadcasts**: the backup directory needs to exist only on the chief's
  machine. A shared file system is fine but not needed.
* **Another number of workers** can resume a backup: the weights are mirrored, and the
  position in the data is counted in global batches.
* **Preemption**: when a scheduler sends `SIGTERM` to any worker (or the launcher forwards
  one), the workers agree at the next check (every `preemption_check_steps=10` steps and at
  each epoch end), back up at that step, and all exit with code 143; a restart resumes there.
  Between checks, `save_freq` bounds the work redone after a hard crash.
* **Shuffling.** Resumption is exact — bit for bit the uninterrupted run — when the data
  order of an epoch does not depend on how many epochs this process has already run:
  `shuffle=False`, or a dataset whose order you derive from the epoch. With `shuffle=True`
  the restarted job resumes at the right epoch and step, but draws a new order for the rest
  of training, so it ends close to, not equal to, the uninterrupted run.
* The backup is deleted when `fit` completes (`delete_checkpoint=False` keeps it).
"""
print(json.dumps({"max_weight_difference": difference}))
