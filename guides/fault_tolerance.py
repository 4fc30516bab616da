"""
Title: Fault tolerance: BackupAndRestore, crashed workers and restarts
Author: The keras_mwms authors
Date created: 2026/12/02
Last modified: 2026/12/05
Description: Survive a killed worker or a lost machine: back up the training state, restart the gang (on fewer workers if need be), resume at the saved example.
"""

"""
## Introduction

Synchronous training is all-or-nothing: every step needs every worker, so when one worker
dies — a crash, an out-of-memory kill, a preempted machine — the step cannot finish anywhere.
keras_mwms never lets that become a hang: the surviving workers fail with an error naming the
lost worker. Recovery is by **restart**: start the whole gang again and continue from the last
backup. Two pieces make that work:

* `keras_mwms.callbacks.BackupAndRestore(backup_dir, save_freq=...)` — the chief backs up the
  weights, the optimizer state, the epoch, the step and the data order's seed; on the next
  start every worker restores the same state and training resumes at that epoch **and step**,
  reading the same shuffled order on from the same global example;
* `python -m keras_mwms.launch --max-restarts K` — restarts the gang after a failure, up to K
  times (on a cluster your orchestrator does this: Kubernetes restart policies, Slurm requeue);
  with `--min-workers M`, a gang that keeps losing the same worker (a lost machine) restarts
  with one worker fewer, and the backup restores on the smaller gang.

In this guide we kill a worker with `SIGKILL` in the middle of an epoch of a **shuffled** fit,
let the launcher restart the job, and check that the final weights equal, bit for bit, those
of a run that was never interrupted. Then we lose a machine for good and finish on fewer
workers.
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

A small regression model, trained with `shuffle=True` for 3 epochs of 8 steps, with a backup
every 3 steps (and at every epoch end). To simulate a crash, worker 1 kills itself after its
11th step — but only on the first attempt: the launcher tells each worker which attempt it is
in `KERAS_MWMS_ATTEMPT`. To simulate a lost machine, worker 2 dies after its 11th step on
every attempt it is part of.
"""

TRAIN_SCRIPT = r'''
import os, signal, sys
import keras
import numpy as np
import keras_mwms

out_dir, backup_dir, fault = sys.argv[1], sys.argv[2], sys.argv[3]
strategy = keras_mwms.MultiWorkerMirroredStrategy()

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")

keras.utils.set_random_seed(7)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")


class Crash(keras.callbacks.Callback):
    """Worker 1 dies hard after its 11th step on the first attempt ("crash"); worker 2 after
    its 11th step on every attempt ("lost-machine")."""

    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        first_attempt = os.environ.get("KERAS_MWMS_ATTEMPT") == "0"
        crash = fault == "crash" and first_attempt and strategy.worker_index == 1
        lost = fault == "lost-machine" and strategy.worker_index == 2
        if (crash or lost) and self.steps == 11:
            print(f"worker {strategy.worker_index}: simulating a crash (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


backup = keras_mwms.callbacks.BackupAndRestore(backup_dir, save_freq=3)
model.fit(x, y, batch_size=32, epochs=3, shuffle=True, callbacks=[backup, Crash()], verbose=2)
np.savez(os.path.join(out_dir, f"weights_{strategy.worker_index}.npz"), *model.get_weights())
'''

script = os.path.join(WORKDIR, "train.py")
with open(script, "w") as handle:
    handle.write(TRAIN_SCRIPT)


def launch(name, fault, *launcher_flags):
    out_dir = os.path.join(WORKDIR, name)
    os.makedirs(out_dir)
    completed = subprocess.run(
        [sys.executable, "-m", "keras_mwms.launch", *launcher_flags, script, out_dir,
         os.path.join(WORKDIR, name + "_backup"), fault],
        capture_output=True, text=True, timeout=900,
    )
    print(completed.stderr)  # the launcher's own messages
    if completed.returncode:
        print(completed.stdout[-3000:])
    return completed, out_dir


"""
## An uninterrupted run, for reference
"""

reference, reference_dir = launch("reference", "none", "--workers", "2")
assert reference.returncode == 0

"""
## A run that loses a worker mid-epoch

The launcher sees worker 1 die, stops worker 0, and starts both again. On the second start,
`BackupAndRestore` on the chief finds the last backup (taken right after the 11th step: the
3rd step of epoch 2), broadcasts it to every worker, and `fit` continues from epoch 2, step 3:
the steps already done are skipped, none is trained twice.

With `shuffle=True` and this callback, keras_mwms draws each epoch's order itself, as a pure
function of a job seed and the epoch (the chief draws the seed from NumPy's global state, so
`keras.utils.set_random_seed` fixes it); the backup keeps the seed, so the restarted job reads
the rest of epoch 2 in the same order, from the same global example. The same holds for a
`keras.utils.PyDataset` (its batch order) and a shuffling torch `DataLoader`.
"""

crashed, crashed_dir = launch("crashed", "crash", "--workers", "2", "--max-restarts", "1")
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
assert difference == 0.0, "a shuffled fit resumes bit for bit"
assert not os.path.exists(os.path.join(WORKDIR, "crashed_backup")), "deleted after success"

"""
## Losing a machine: finish on fewer workers

Now worker 2 of a 3-worker gang dies after its 11th step every time it runs, as a machine that
is gone would. With `--min-workers 2 --shrink-after 1`, the launcher restarts the gang with one
worker fewer after the first such failure (the default `--shrink-after 2` waits for a second
one), and the 2 workers restore the backup the 3 wrote: the same weights and optimizer state,
the same global batch of 32 (each worker now takes 16 rows instead of 11 or 10), the same
position in the same shuffled order, the same learning-rate step. The restore says so in one
line. The result equals the uninterrupted run up to the order in which workers add gradients.

(CI runs this guide on every backend in smoke mode; there, this section runs on torch only.)
"""

if not SMOKE or os.environ.get("KERAS_BACKEND") == "torch":
    elastic, elastic_dir = launch("elastic", "lost-machine", "--workers", "3", "--min-workers", "2",
                                  "--shrink-after", "1", "--max-restarts", "1")
    assert elastic.returncode == 0
    assert "with one worker fewer (3 -> 2" in elastic.stderr
    changed = [line for line in elastic.stdout.splitlines() if "this job has 2" in line]
    print("\n".join(changed))
    assert changed, "the restore says that the worker count changed"
    elastic_difference = max(float(np.abs(a - b).max())
                             for a, b in zip(weights(reference_dir, 0), weights(elastic_dir, 0)))
    print(f"3 workers -> 2: max |w - w_reference| = {elastic_difference:.3g}")
    assert elastic_difference <= 1e-5

"""
## What to know

* **Only the chief writes**, atomically (a temporary directory switched in by renaming a
  pointer file): a kill during a backup leaves the previous backup loadable. Add
  `double_checkpoint=True` to also keep the previous backup as a fallback against a corrupted
  file.
* **The chief reads and broadcasts**: the backup directory needs to exist only on the chief's
  machine. A shared file system is fine but not needed.
* **Another number of workers** can resume a backup, more or fewer: the weights are
  mirrored, and the position in the data is counted in global batches of an order that does
  not depend on the worker count. A different global batch (`batch_size`) is your choice: the
  restore then says where in the epoch it resumes.
* **Preemption**: when a scheduler sends `SIGTERM` to any worker (or the launcher forwards
  one), the workers agree at the next check (every `preemption_check_steps=10` steps and at
  each epoch end), back up at that step, and all exit with code 143; a restart resumes there.
  Between checks, `save_freq` bounds the work redone after a hard crash.
* **Shuffling.** Resumption is exact for arrays, `keras.utils.PyDataset`s and torch
  `DataLoader`s, shuffled or not. A `tf.data` pipeline that reshuffles every epoch (or
  shuffles without a seed) keeps its order inside TensorFlow's iterator, which a new process
  starts over: the restore then warns once that the resumed epoch is approximate. Seed the
  shuffle and set `reshuffle_each_iteration=False`, or feed arrays, for exact resumption.
* **Proving it.** `keras_mwms.example_ledger.ExampleLedger(directory)` records, per worker,
  the global example ids every step trained; `effective_steps` replays a ledger across
  restarts, so a test can assert every example exactly once per epoch.
* The backup is deleted when `fit` completes (`delete_checkpoint=False` keeps it).
"""
print(json.dumps({"max_weight_difference": difference}))
