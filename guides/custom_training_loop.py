"""
Title: Custom training loops with keras_mwms
Author: The keras_mwms authors
Date created: 2026/12/02
Last modified: 2026/12/02
Description: Write your own multi-worker training step with strategy.run, strategy.reduce and distribute_datasets_from_function, on TensorFlow, JAX and PyTorch.
"""

"""
## Introduction

`model.fit` does everything for you, but sometimes you want to own the training step: a GAN,
a custom regularizer, gradient surgery, or just to see what happens. This guide writes a
complete synchronous data-parallel training loop by hand with the `tf.distribute`-style API of
`keras_mwms.MultiWorkerMirroredStrategy`:

* `strategy.distribute_datasets_from_function(dataset_fn)` and the `InputContext` it passes to
  `dataset_fn` (`num_input_pipelines`, `input_pipeline_id`, `get_per_replica_batch_size`);
* `strategy.run(fn, args)` — run the step on every local replica;
* `strategy.reduce(op, value, axis)` — combine per-replica values across all workers;
* `strategy.experimental_local_results(value)` — look at this worker's per-replica parts.

Then it checks the promise of synchronous data parallelism: two workers end with **exactly
the weights of one process** that trained on the same global batches, and the two workers'
weights are bit-identical.

The step itself has to compute gradients, and autodiff is the one thing that differs between
backends, so you will see three short versions of it — TensorFlow's `GradientTape`, JAX's
`jax.value_and_grad`, PyTorch's `loss.backward()` — around a loop that is the same everywhere.

## Setup

Run with `KERAS_BACKEND=tensorflow|jax|torch python guides/custom_training_loop.py` after
`make install`. The guide writes the worker script to a temporary directory and starts the
workers; the training happens there.
"""

# ruff: noqa: E402  (keras-io layout: the prose above comes before the imports)
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

SMOKE = os.environ.get("KERAS_MWMS_GUIDE_SMOKE") == "1"  # CI runs a shorter version
EPOCHS = 2 if SMOKE else 5
WORKDIR = tempfile.mkdtemp(prefix="keras_mwms_custom_loop_guide_")
print("Working directory:", WORKDIR)

"""
## Global batch, per-replica batch

A *replica* is one model copy computing on one device: with keras_mwms that is one per worker
by default (JAX can have several with `jax_num_cpu_devices`, TensorFlow one per local GPU).
`strategy.num_replicas_in_sync` counts them across all workers.

The **global batch** is what one training step consumes, all replicas together. Each replica
computes on a **per-replica batch** of `global_batch / num_replicas_in_sync` examples. With a
global batch of 64 on 2 workers each replica sees 32 examples per step; on one process, the
single replica sees all 64. The optimizer takes one step per global batch either way.

To make the two agree, the loss each replica minimises is its examples' share of the
**global-batch mean**: the sum of its per-example losses divided by the *global* batch size
(this is what `tf.nn.compute_average_loss` does). Summing those gradients over all replicas
then gives exactly the gradient of the mean loss over the global batch:

```python
def replica_loss(labels, logits):
    per_example = loss_object(labels, logits)          # reduction=None
    return keras.ops.sum(per_example) / GLOBAL_BATCH   # not / per-replica batch!
```

Dividing by the per-replica batch instead would make the summed gradient
`num_replicas_in_sync` times too large.

## The input pipeline: `distribute_datasets_from_function`

`strategy.distribute_datasets_from_function(dataset_fn)` calls `dataset_fn(input_context)` on
every worker. The `InputContext` says which part of the input this worker builds:

* `input_context.num_input_pipelines` — how many pipelines there are (one per worker);
* `input_context.input_pipeline_id` — this worker's pipeline (its worker index);
* `input_context.get_per_replica_batch_size(GLOBAL_BATCH)` — the batch size to use, because a
  dataset from `dataset_fn` is batched **per replica** (unlike
  `experimental_distribute_dataset`, which takes a dataset batched at the global size).

Our `dataset_fn` keeps every `num_input_pipelines`-th example starting at `input_pipeline_id`
(that is `tf.data.Dataset.shard`) and batches per replica. Then step *k* of worker *i* holds
the examples `64k + i, 64k + i + 2, ...`: the two workers' batches of step *k* together are
exactly rows `64k ... 64k + 63`, the global batch one process would use. The remainder is
dropped so that every worker runs the same number of steps — a worker that runs out of data
early would leave its peers waiting in the next all-reduce.

On TensorFlow, `dataset_fn` must return a `tf.data.Dataset` (TF's `distribute_datasets_from_function`
requires one); on JAX and PyTorch any iterable of batches works, so there we avoid importing
TensorFlow and use lists of NumPy batches.

## The common part of the worker script

Everything except the training step is backend-independent. Note the order: the strategy is
created first, right after the imports — JAX must join the cluster before it computes
anything — and the model and optimizer are created inside `strategy.scope()`, so their
variables are mirrored. The optimizer is built in the scope too, before the first step.
"""

COMMON = r'''
import json, sys
import keras
import numpy as np
from sklearn.datasets import load_digits
import keras_mwms

epochs, out_prefix = int(sys.argv[1]), sys.argv[2]
GLOBAL_BATCH = 64

strategy = keras_mwms.MultiWorkerMirroredStrategy()
BACKEND = keras.backend.backend()
print(f"[{BACKEND}] worker {strategy.worker_index} of {strategy.num_workers}, "
      f"{strategy.num_replicas_in_sync} replica(s) in sync", flush=True)

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int32")
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]


def batches(features, labels, per_replica_batch):
    """One input pipeline's batches, remainder dropped so every replica runs the same steps."""
    steps = len(features) // per_replica_batch
    features, labels = features[:steps * per_replica_batch], labels[:steps * per_replica_batch]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((features, labels)).batch(per_replica_batch)
    return [(features[i:i + per_replica_batch], labels[i:i + per_replica_batch])
            for i in range(0, len(features), per_replica_batch)]


def dataset_fn_for(features, labels):
    def dataset_fn(input_context):
        per_replica_batch = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
        mine = slice(input_context.input_pipeline_id, None, input_context.num_input_pipelines)
        return batches(features[mine], labels[mine], per_replica_batch)
    return dataset_fn


train_dataset = strategy.distribute_datasets_from_function(dataset_fn_for(x_train, y_train))
test_dataset = strategy.distribute_datasets_from_function(dataset_fn_for(x_test, y_test))

# Seeded initializers: the same start in every run, so the single-process comparison below is
# exact (keras.utils.set_random_seed would do too, but it imports TensorFlow on every backend).
with strategy.scope():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu",
                           kernel_initializer=keras.initializers.GlorotUniform(seed=1)),
        keras.layers.Dense(10, kernel_initializer=keras.initializers.GlorotUniform(seed=2)),
    ])
    optimizer = keras.optimizers.SGD(learning_rate=0.2)
    optimizer.build(model.trainable_variables)

loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def replica_loss(labels, logits):
    """This replica's share of the global-batch mean loss."""
    return keras.ops.sum(loss_object(labels, logits)) / GLOBAL_BATCH
'''

"""
## The training step on TensorFlow

The TensorFlow version is the classic `tf.distribute` custom loop. `strategy.run` calls
`replica_step` on each local replica with that replica's batch. Inside it, `GradientTape`
records the forward pass, and `optimizer.apply_gradients` — called in the replica context —
all-reduces (sums) the gradients across every replica of every worker before it updates the
mirrored variables. The step runs in a `tf.function`, as `tf.distribute` expects.

`strategy.run` returns a *per-replica* value: `strategy.reduce("SUM", per_replica_loss,
axis=None)` adds the replicas' shares into the global-batch loss, identical on every worker,
and `strategy.experimental_local_results` unpacks this worker's own shares.
"""

TENSORFLOW_STEP = r'''
def make_tensorflow_steps():
    import tensorflow as tf

    def replica_step(features, labels):
        with tf.GradientTape() as tape:
            loss = replica_loss(labels, model(features, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        # In a replica context Keras' optimizer sums the gradients over all replicas first.
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(features, labels):
        per_replica_loss = strategy.run(replica_step, args=(features, labels))
        return per_replica_loss, strategy.reduce("SUM", per_replica_loss, axis=None)

    def train_step(features, labels):
        per_replica_loss, loss = distributed_train_step(features, labels)
        return strategy.experimental_local_results(per_replica_loss), loss

    return train_step, tf.function(evaluate_step)
'''

"""
## The training step on JAX

JAX has no tape: gradients are a function transformation, `jax.value_and_grad`, applied to a
*pure* function of the weights. Keras gives you that function: `model.stateless_call(
trainable_values, non_trainable_values, x)` runs the model on the values you pass instead of
the ones stored in its variables.

Under keras_mwms the mirrored variables are JAX arrays replicated over the devices of *all*
workers. The replica step takes this worker's own copy of each value
(`array.addressable_data(0)`, no communication) and differentiates the replica loss on the
replica's batch in a jitted function that runs on the local device only. The gradients come
back per replica; `strategy.reduce("SUM", ..., axis=None)` sums them across all workers —
it accepts the whole nest `(loss, gradients)` and all-reduces it in one flat collective, with
bits identical on every worker. `optimizer.apply` then updates the mirrored variables with
the same global-batch gradients everywhere.

(Do not call `model(x)` on a worker's own batch here: Keras' JAX variables span all workers,
so JAX would treat that batch as one global value — the same on every worker — which it is
not.)
"""

JAX_STEP = r'''
def make_jax_steps():
    import jax

    def local_copy(variable):
        return variable.value.addressable_data(0)   # this worker's copy of a mirrored value

    def loss_of(trainable_values, non_trainable_values, features, labels):
        logits, _ = model.stateless_call(trainable_values, non_trainable_values, features,
                                         training=True)
        return replica_loss(labels, logits)

    loss_and_gradients = jax.jit(jax.value_and_grad(loss_of))
    logits_of = jax.jit(lambda trainable, non_trainable, features:
                        model.stateless_call(trainable, non_trainable, features)[0])

    def replica_step(features, labels):
        return loss_and_gradients([local_copy(v) for v in model.trainable_variables],
                                  [local_copy(v) for v in model.non_trainable_variables],
                                  features, labels)

    def train_step(features, labels):
        per_replica = strategy.run(replica_step, args=(features, labels))  # (loss, gradients)
        loss, gradients = strategy.reduce("SUM", per_replica, axis=None)
        optimizer.apply(gradients, model.trainable_variables)
        local_losses = tuple(loss for loss, _ in strategy.experimental_local_results(per_replica))
        return local_losses, loss

    def predict(features):
        return logits_of([local_copy(v) for v in model.trainable_variables],
                         [local_copy(v) for v in model.non_trainable_variables], features)

    return train_step, lambda features, labels: evaluate_step(features, labels, predict)
'''

"""
## The training step on PyTorch

On PyTorch a Keras model is a `torch.nn.Module`: the replica step runs the forward pass,
calls `loss.backward()` and collects each variable's `.grad`. As on JAX, `strategy.reduce`
sums the `(loss, gradients)` nest across workers in one bucketed all-reduce, and
`optimizer.apply` (under `torch.no_grad()`, as Keras' own torch trainer does) applies the
global-batch gradients.

Two things `model.fit` does for you on torch that a custom loop must do itself:

* **average the gradients** — keras_mwms hooks gradient averaging into the optimizer of a
  *compiled* model when `fit` builds its train function; a hand-written loop calls
  `optimizer.apply` directly, so it reduces the gradients explicitly, as here;
* **start from identical weights** — TensorFlow and JAX broadcast the chief's initial values
  when variables are created in the scope; on torch `fit` broadcasts them at its start, so a
  custom loop broadcasts them itself with `strategy.backend.broadcast_tensors` (our seeded
  initializers make them identical anyway — the single-process comparison below needs that).
"""

TORCH_STEP = r'''
def make_torch_steps():
    import torch

    strategy.backend.broadcast_tensors([v.value.data for v in model.variables])

    def replica_step(features, labels):
        model.zero_grad()
        loss = replica_loss(labels, model(keras.ops.convert_to_tensor(features), training=True))
        loss.backward()
        return loss.detach(), [v.value.grad for v in model.trainable_variables]

    def train_step(features, labels):
        per_replica = strategy.run(replica_step, args=(features, labels))  # (loss, gradients)
        loss, gradients = strategy.reduce("SUM", per_replica, axis=None)
        with torch.no_grad():
            optimizer.apply(gradients, model.trainable_variables)
        local_losses = tuple(loss for loss, _ in strategy.experimental_local_results(per_replica))
        return local_losses, loss

    @torch.no_grad()
    def predict(features):
        return model(keras.ops.convert_to_tensor(features), training=False)

    return train_step, lambda features, labels: evaluate_step(features, labels, predict)
'''

"""
## The loop

The loop is the same on every backend: iterate the distributed dataset, one step per global
batch. Evaluation shows `reduce` along an axis: each replica returns a vector of
per-example hits on its test batch, and `strategy.reduce("MEAN", hits, axis=0)` averages over
the examples *and* the replicas of all workers — the global-batch accuracy, the same number on
every worker. (On TensorFlow the evaluation step is wrapped in `tf.function`, like the training
step.)

At the end each worker saves its weights; the guide compares them.
"""

LOOP = r'''
def evaluate_step(features, labels, predict=None):
    def replica_hits(features, labels):
        logits = predict(features) if predict is not None else model(features, training=False)
        hits = keras.ops.equal(keras.ops.argmax(logits, axis=-1),
                               keras.ops.cast(keras.ops.convert_to_tensor(labels), "int32"))
        return keras.ops.cast(hits, "float32")

    return strategy.reduce("MEAN", strategy.run(replica_hits, args=(features, labels)), axis=0)


make_steps = {"tensorflow": make_tensorflow_steps, "jax": make_jax_steps,
              "torch": make_torch_steps}[BACKEND]
train_step, accuracy_step = make_steps()

losses, accuracies = [], []
for epoch in range(epochs):
    for step, (features, labels) in enumerate(train_dataset):
        local_losses, loss = train_step(features, labels)
        losses.append(float(loss))
        if epoch == 0 and step == 0:
            print(f"worker {strategy.worker_index}: this worker's per-replica loss shares "
                  f"{[round(float(part), 4) for part in local_losses]}, global-batch loss "
                  f"{float(loss):.4f}", flush=True)
    batch_accuracies = [float(accuracy_step(features, labels)) for features, labels in test_dataset]
    accuracies.append(float(np.mean(batch_accuracies)))
    print(f"worker {strategy.worker_index}: epoch {epoch + 1}: loss {losses[-1]:.4f}, "
          f"test accuracy {accuracies[-1]:.4f}", flush=True)

np.savez(f"{out_prefix}_worker{strategy.worker_index}.npz",
         *[keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables])
with open(f"{out_prefix}_worker{strategy.worker_index}.json", "w") as handle:
    json.dump({"losses": losses, "accuracies": accuracies,
               "replicas": strategy.num_replicas_in_sync}, handle)
'''

script_path = os.path.join(WORKDIR, "custom_loop.py")
with open(script_path, "w") as handle:
    handle.write("\n".join([COMMON, TENSORFLOW_STEP, JAX_STEP, TORCH_STEP, LOOP]))

"""
## Run it: two workers, and one process for comparison

`python -m keras_mwms.launch --workers 2 custom_loop.py` starts two workers on this machine,
each with its own `TF_CONFIG`. Then we run the very same script as a plain single process
(no `TF_CONFIG`: the strategy warns that it runs one worker, and behaves like plain Keras).
"""

environment = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
# The workers run from the temporary directory: let them import this checkout's keras_mwms.
repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
environment["PYTHONPATH"] = os.pathsep.join(filter(None, [repository, environment.get("PYTHONPATH")]))
backend = environment.get("KERAS_BACKEND", "tensorflow")
print("Backend:", backend)

started = time.monotonic()
subprocess.run([sys.executable, "-m", "keras_mwms.launch", "--workers", "2", script_path,
                str(EPOCHS), os.path.join(WORKDIR, "two")],
               check=True, timeout=900, env=environment)
print(f"two workers: {time.monotonic() - started:.1f} s")

started = time.monotonic()
subprocess.run([sys.executable, script_path, str(EPOCHS), os.path.join(WORKDIR, "one")],
               check=True, timeout=900, env=environment)
print(f"one process: {time.monotonic() - started:.1f} s")

"""
## Two workers = one process

The key claim of synchronous data parallelism, checked: both workers hold bit-identical
weights, and those weights equal the single process's up to float rounding (the gradients
are summed in a different order), after every step of every epoch. The global-batch losses
and accuracies agree as well.
"""


def load_weights(path):
    with np.load(path) as data:
        return [data[key] for key in data.files]


def load_log(path):
    with open(path) as handle:
        return json.load(handle)


worker_weights = [load_weights(os.path.join(WORKDIR, f"two_worker{i}.npz")) for i in range(2)]
single_weights = load_weights(os.path.join(WORKDIR, "one_worker0.npz"))
logs = [load_log(os.path.join(WORKDIR, f"two_worker{i}.json")) for i in range(2)]
single_log = load_log(os.path.join(WORKDIR, "one_worker0.json"))

assert all(np.array_equal(a, b) for a, b in zip(*worker_weights)), "workers must be identical"
assert logs[0]["losses"] == logs[1]["losses"], "reduced losses must be the same on every worker"
difference = max(float(np.abs(a - b).max()) for a, b in zip(worker_weights[0], single_weights))
print(f"steps: {len(logs[0]['losses'])} | max |w_2_workers - w_1_process| = {difference:.2e}")
print("loss, first and last step (2 workers):", logs[0]["losses"][0], logs[0]["losses"][-1])
print("loss, first and last step (1 process):", single_log["losses"][0], single_log["losses"][-1])
print("test accuracy per epoch (2 workers):", logs[0]["accuracies"])
assert difference <= 1e-5, f"two workers drifted from one process by {difference}"
assert logs[0]["losses"][-1] < logs[0]["losses"][0], "the loop must actually train"
assert np.allclose(logs[0]["accuracies"], single_log["accuracies"], atol=1e-6)

"""
## Where to go next

* Gradient clipping: on JAX and torch, where the loop reduces the gradients itself, clip after
  `strategy.reduce`, so every worker clips the same global-batch gradients. On TensorFlow,
  Keras' optimizer applies `clipnorm` / `global_clipnorm` *before* it sums the replicas'
  gradients, that is to each replica's share.
* Metrics objects (`keras.metrics.*`) in a custom loop are per worker; reduce their result,
  or their state, with `strategy.reduce` before you log or decide anything with them.
* `guides/input_pipelines.py` — sharding policies, shuffling and uneven data in depth.
* `guides/fault_tolerance.py` — backups and restarts (for a custom loop, save and restore the
  model and optimizer variables yourself, from the chief).
"""
