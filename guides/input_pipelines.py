"""
Title: Input pipelines for multi-worker training
Author: The keras_mwms authors
Date created: 2026/12/02
Last modified: 2026/12/02
Description: The global batch, how keras_mwms splits it between workers, shuffling, sharding policies and uneven data.
"""

"""
## Introduction

Data parallelism is only correct if every step's *global batch* is split between workers
without loss, overlap or drift. keras_mwms' contract:

* The batch you give — `batch_size=` for arrays, the batch of a `tf.data.Dataset`, a
  `PyDataset`'s batches — is the **global** batch.
* Each step, worker *w* of *n* takes a contiguous slice of that global batch (the first
  `G % n` workers take one row more when `G` is not divisible by `n`).
* `shuffle=True` shuffles the global order **identically on every worker**, then slices.
* Every worker runs the **same number of steps**, also when the data does not divide evenly:
  a partial last batch is split like any other (a worker may get fewer rows, even none)
  instead of leaving one worker waiting forever in a collective.

The consequence you can check: N workers end with the weights one process gets on the same
global batches. This guide does exactly that, with a dataset of 1,000 rows and a global
batch of 64 — 15 full batches and a partial one of 40.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np

SMOKE = os.environ.get("KERAS_MWMS_GUIDE_SMOKE") == "1"
WORKDIR = tempfile.mkdtemp(prefix="keras_mwms_input_guide_")

"""
## How the split works

`keras_mwms.data.worker_row_indices` is the rule, usable on its own. Here: 10 rows, global
batch 4, 2 workers. Step 3 is the partial batch of 2 rows: both go to worker 0 (its slice of a
full batch would be 2 rows), worker 1 gets none — and still runs the step.
"""

from keras_mwms.data import worker_row_indices  # noqa: E402

for worker in range(2):
    steps = worker_row_indices(num_rows=10, global_batch_size=4, num_workers=2, worker_index=worker)
    print(f"worker {worker}:", [step.tolist() for step in steps])

"""
## The same script on 1 and on 2 workers

The script trains with `shuffle=True` on NumPy arrays, then on a `tf.data.Dataset` batched
at the global batch. Without `TF_CONFIG` it runs as one process (and warns that it is a
single worker); through the launcher as two.
"""

TRAIN_SCRIPT = r'''
import os, sys
import keras
import numpy as np
import tensorflow as tf
import keras_mwms

out_path, epochs = sys.argv[1], int(sys.argv[2])
strategy = keras_mwms.MultiWorkerMirroredStrategy()

rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 10)).astype("float32")
y = (np.sin(x @ rng.normal(size=(10, 1)))).astype("float32")

keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

# NumPy arrays: batch_size is the global batch; shuffling is identical on every worker.
model.fit(x, y, batch_size=64, epochs=epochs, shuffle=True, verbose=0)

# tf.data: batch at the global batch size; keras_mwms shards each global batch.
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
history = model.fit(dataset, epochs=epochs, verbose=0)

if strategy.is_chief:
    np.savez(out_path, *model.get_weights())
    print("steps per epoch:", len(x) // 64 + 1, "| final loss:", history.history["loss"][-1])
'''

script = os.path.join(WORKDIR, "train.py")
with open(script, "w") as handle:
    handle.write(TRAIN_SCRIPT)
epochs = "1" if SMOKE else "3"
single, multi = os.path.join(WORKDIR, "single.npz"), os.path.join(WORKDIR, "multi.npz")

environment = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
subprocess.run([sys.executable, script, single, epochs], check=True, timeout=900, env=environment)
subprocess.run([sys.executable, "-m", "keras_mwms.launch", "--workers", "2", script, multi, epochs],
               check=True, timeout=900, env=environment)

"""
## Same weights
"""


def load(path):
    with np.load(path) as data:
        return [data[key] for key in data.files]


difference = max(float(np.abs(a - b).max()) for a, b in zip(load(single), load(multi)))
print(f"max |w_2_workers - w_1_process| = {difference:.2e}")
assert difference <= 1e-5

"""
## Sharding policies for `tf.data`

For a dataset batched at the global batch, keras_mwms (like `tf.distribute`) reads the whole
dataset on every worker and keeps each worker's slice of every batch. That is
`AutoShardPolicy.DATA`, always correct. With many input *files*, `FILE` lets each worker read
only its own files — faster, but only correct when files hold similar amounts of data. `OFF`
means "my dataset already holds only this worker's part" — then each worker's own batches are
its share, and you must make sure every worker has the same number of batches. Set the policy
the `tf.data` way:

```python
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
dataset = dataset.with_options(options)
```

For full control, build each worker's pipeline yourself with
`strategy.distribute_datasets_from_function(dataset_fn)`: `dataset_fn` receives an
`InputContext` with `num_input_pipelines`, `input_pipeline_id` and
`get_per_replica_batch_size(global_batch_size)`, and must batch at the per-replica size.

## What goes wrong elsewhere

Without this care, uneven data is the classic multi-worker hang: one worker runs out of
batches and leaves the epoch while the others wait in the next all-reduce — forever on
TensorFlow, until a timeout on torch, with mis-paired collectives (silently wrong gradients)
in the worst case. keras_mwms computes the number of steps from the global data, so every
worker runs the same steps.
"""
