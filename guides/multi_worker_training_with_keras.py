"""
Title: Multi-worker training with Keras
Author: The keras_mwms authors
Date created: 2026/12/02
Last modified: 2026/12/06
Description: Train one Keras model on several workers with keras_mwms.MultiWorkerMirroredStrategy, on any backend.
"""

"""
## Introduction

This guide is TensorFlow's "Multi-worker training with Keras" tutorial, working again under
Keras 3 — on TensorFlow, JAX and PyTorch alike. You will:

1. write an ordinary Keras training script;
2. add three lines so it trains on several *workers* (processes, usually on several machines);
3. launch two workers on this machine and watch them train one model together;
4. save checkpoints from the chief only.

Synchronous data parallelism in one paragraph: every worker holds a full copy of the model
(*mirrored variables*). Each step, the *global batch* is split across workers; each computes
gradients on its slice; the gradients are averaged across workers (an *all-reduce*); every
worker applies the same update. So the workers stay identical, and N workers on the same
global batches end with the weights one process would get.

## Setup

Run this guide with `python guides/multi_worker_training_with_keras.py` after `make install`.
Choose the backend with `KERAS_BACKEND=tensorflow|jax|torch` — the guide itself only writes
files and starts processes, the training happens in the workers.
"""

import json
import os
import subprocess
import sys
import tempfile

SMOKE = os.environ.get("KERAS_MWMS_GUIDE_SMOKE") == "1"  # CI runs a shorter version
EPOCHS = 2 if SMOKE else 5
WORKDIR = tempfile.mkdtemp(prefix="keras_mwms_guide_")
print("Working directory:", WORKDIR)

"""
## The training script

Below is the whole script each worker runs. Compared with single-process Keras there are
exactly three changes, marked `# (1)`, `# (2)`, `# (3)`:

1. create a `keras_mwms.MultiWorkerMirroredStrategy` — it reads `TF_CONFIG`, meets the other
   workers and starts the backend's collective engine;
2. build and compile the model inside `strategy.scope()`, so its variables are mirrored;
3. use `keras_mwms.callbacks.ModelCheckpoint`, so only the chief writes the checkpoint
   (`keras.callbacks.ModelCheckpoint` would do the same: while the strategy is active,
   keras_mwms runs Keras' own file-writing callbacks as its chief-aware ones).

The dataset is scikit-learn's bundled handwritten digits (offline, 1,797 8×8 images).
`batch_size=64` is the **global** batch: with two workers each computes on 32 examples per
step, and the result is the same as one process on 64.
"""

TRAIN_SCRIPT = r'''
import json, os, sys
import keras
import numpy as np
from sklearn.datasets import load_digits
import keras_mwms

epochs, out_dir = int(sys.argv[1]), sys.argv[2]

strategy = keras_mwms.MultiWorkerMirroredStrategy()                     # (1)
print(f"worker {strategy.worker_index} of {strategy.num_workers}, chief={strategy.is_chief}, "
      f"{strategy.num_replicas_in_sync} replicas", flush=True)

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

keras.utils.set_random_seed(42)
with strategy.scope():                                                   # (2)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(2e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

checkpoint = keras_mwms.callbacks.ModelCheckpoint(                       # (3)
    os.path.join(out_dir, "best.keras"), monitor="val_accuracy", mode="max",
    save_best_only=True)
history = model.fit(x_train, y_train, batch_size=64, epochs=epochs,
                    validation_data=(x_test, y_test), callbacks=[checkpoint], verbose=2)

# The logs are global: every worker sees the same numbers.
summary = {"worker": strategy.worker_index,
           "val_accuracy": [round(v, 6) for v in history.history["val_accuracy"]],
           "first_kernel_sum": float(np.sum(keras.ops.convert_to_numpy(model.layers[0].kernel)))}
with open(os.path.join(out_dir, f"summary_{strategy.worker_index}.json"), "w") as f:
    json.dump(summary, f)
'''

script_path = os.path.join(WORKDIR, "train.py")
with open(script_path, "w") as handle:
    handle.write(TRAIN_SCRIPT)

"""
## How a worker knows who it is: `TF_CONFIG`

Each worker reads the `TF_CONFIG` environment variable, a JSON object with the whole cluster
and this worker's place in it:

```json
{"cluster": {"worker": ["host0:12345", "host1:23456"]},
 "task": {"type": "worker", "index": 0}}
```

The worker list is identical on every worker; its order is the identity, and worker 0 is the
*chief*, the worker that writes checkpoints and logs. `keras-mwms tf-config` prints one for
you:
"""

print(subprocess.run([sys.executable, "-m", "keras_mwms.cli", "tf-config",
                      "--workers", "host0:12345,host1:23456", "--index", "0"],
                     capture_output=True, text=True, check=True).stdout)

"""
## Launch two workers on this machine

`python -m keras_mwms.launch --workers 2 train.py` sets a `TF_CONFIG` for each worker on free
localhost ports, starts them, prefixes their output with `[worker i]` and stops them all if
one fails. On several machines you set `TF_CONFIG` yourself and run `python train.py` on each
(see `guides/running_on_a_cluster.md`).
"""

subprocess.run(
    [sys.executable, "-m", "keras_mwms.launch", "--workers", "2", script_path, str(EPOCHS), WORKDIR],
    check=True, timeout=900,
)

"""
## What happened

Both workers trained one model. They saw the same global metrics, ended with identical
weights, and only the chief wrote `best.keras`:
"""

summaries = [json.load(open(os.path.join(WORKDIR, f"summary_{i}.json"))) for i in range(2)]
for summary in summaries:
    print(summary)
assert summaries[0]["val_accuracy"] == summaries[1]["val_accuracy"], "logs must be global"
assert summaries[0]["first_kernel_sum"] == summaries[1]["first_kernel_sum"], "weights must be mirrored"
assert os.listdir(WORKDIR).count("best.keras") == 1
print("validation accuracy per epoch:", summaries[0]["val_accuracy"])

"""
## Loading the checkpoint

The chief's file is an ordinary Keras model: load it anywhere, no strategy needed.
"""

import keras  # noqa: E402  (imported late: the guide's own process needs no backend before here)

restored = keras.models.load_model(os.path.join(WORKDIR, "best.keras"))
print("restored model with", restored.count_params(), "parameters")

"""
## Where to go next

* `guides/custom_training_loop.py` — `strategy.run`, `reduce` and per-replica batches.
* `guides/fault_tolerance.py` — `BackupAndRestore` and restarting a crashed job.
* `guides/input_pipelines.py` — how data is split between workers.
* `guides/running_on_a_cluster.md` — Kubernetes, Slurm, ssh; ports; troubleshooting.
"""
