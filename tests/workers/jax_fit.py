"""JAX scenario: fit + evaluate + predict with keras_mwms, dumping what the tests assert on.

Runs in every worker of a gang, or without TF_CONFIG as the single-process reference:

    python tests/workers/jax_fit.py OUT_DIR [--optimizer adam] [--input tfdata] [--shuffle] ...

Writes `OUT_DIR/w<index>.npz` (initial and final weights) and `OUT_DIR/w<index>.json` (history,
evaluate, predict digest, replica count, timings).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KERAS_BACKEND", "jax")

import common  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
parser.add_argument("--input", default="arrays", choices=["arrays", "tfdata", "pydataset"])
parser.add_argument("--shuffle", action="store_true")
parser.add_argument("--batch-norm", action="store_true")
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, default=0, help="steps_per_epoch (0: whole data)")
parser.add_argument("--rows", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=32, help="global batch")
parser.add_argument("--seed-per-worker", action="store_true", help="seed = worker index")
parser.add_argument("--validation", action="store_true")
parser.add_argument("--die-worker", type=int, default=-1)
parser.add_argument("--die-after", type=int, default=5, help="batches before the crash")
parser.add_argument("--slow-steps", type=float, default=0.0, help="sleep per batch (fault test)")
parser.add_argument("--primitives", action="store_true", help="exercise barrier/broadcast/run/reduce")
parser.add_argument("--steps-per-execution", type=int, default=1)
arguments = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mwms  # noqa: E402

strategy = keras_mwms.MultiWorkerMirroredStrategy()
index = strategy.worker_index
keras.utils.set_random_seed(index if arguments.seed_per_worker else 0)
common.log(f"worker {index}/{strategy.num_workers}, replicas {strategy.num_replicas_in_sync}")

x, y = common.regression_data(arguments.rows)
sample_weight = None
with strategy.scope():
    # JAX runs the step SPMD over the global batch, so BatchNormalization already uses global
    # statistics; Keras accepts synchronized=True only on TensorFlow.
    model = common.mlp(batch_norm=arguments.batch_norm, dropout=arguments.dropout, synchronized=False)
    optimizer = (keras.optimizers.SGD(0.05, momentum=0.9) if arguments.optimizer == "sgd"
                 else keras.optimizers.Adam(1e-2))
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"],
                  steps_per_execution=arguments.steps_per_execution)
initial = [np.asarray(w) for w in model.get_weights()]


class Batches(keras.utils.PyDataset):
    """The data as a PyDataset of global batches."""

    def __len__(self):
        return -(-len(x) // arguments.batch_size)

    def __getitem__(self, i):
        rows = slice(i * arguments.batch_size, (i + 1) * arguments.batch_size)
        return x[rows], y[rows]


class Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if arguments.slow_steps:
            time.sleep(arguments.slow_steps)
        if index == arguments.die_worker and batch == arguments.die_after:
            common.log(f"simulating a crash at {time.time():.3f}: os._exit(9)")
            os._exit(9)


fit_kwargs = dict(epochs=arguments.epochs, verbose=0, callbacks=[Crash()],
                  steps_per_epoch=arguments.steps or None)
if arguments.validation:
    fit_kwargs["validation_data"] = (x[:64], y[:64])
start = time.time()
if arguments.input == "arrays":
    history = model.fit(x, y, batch_size=arguments.batch_size, shuffle=arguments.shuffle, **fit_kwargs)
elif arguments.input == "tfdata":
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(arguments.batch_size)
    history = model.fit(dataset, **fit_kwargs)
else:
    history = model.fit(Batches(), shuffle=arguments.shuffle, **fit_kwargs)
fit_seconds = time.time() - start
evaluation = model.evaluate(x, y, batch_size=48, verbose=0, return_dict=True)
predictions = model.predict(x, batch_size=48, verbose=0)
results = dict(history=history.history, evaluate=evaluation, fit_seconds=fit_seconds, num_weights=len(initial),
               replicas=strategy.num_replicas_in_sync, predict_shape=list(predictions.shape),
               path=strategy.backend.model_path(model),
               predict_sum=float(np.sum(predictions, dtype=np.float64)))
if arguments.primitives:
    backend = strategy.backend
    strategy.barrier("primitives")
    results["broadcast"] = backend.broadcast_object({"from": index, "tag": "hello"})
    per_replica = strategy.run(lambda v: v * 1.0, args=(np.float32(index + 1),))
    results["local_results"] = len(strategy.experimental_local_results(per_replica))
    results["reduce_sum"] = float(strategy.reduce("SUM", per_replica, axis=None))
    results["reduce_mean"] = float(strategy.reduce("MEAN", per_replica, axis=None))
    # A custom loop reduces whole nests, e.g. (loss, gradients); mixed dtypes on purpose.
    nested = strategy.run(lambda v: (v, [np.full(3, v, "float32"), np.float16(2 * v)]),
                          args=(np.float32(index + 1),))
    for op in ("SUM", "MEAN"):
        total, (vector, half) = strategy.reduce(op, nested, axis=None)
        results[f"reduce_nested_{op.lower()}"] = [float(total), vector.tolist(), float(half), str(half.dtype)]
    import tensorflow as tf

    global_batches = tf.data.Dataset.from_tensor_slices(np.arange(16, dtype="float32")).batch(8)
    distributed = strategy.experimental_distribute_dataset(global_batches)
    results["distributed_sums"] = [
        float(strategy.reduce("SUM", strategy.run(lambda b: b.sum(), args=(batch,)), axis=None))
        for batch in distributed]
np.savez(os.path.join(arguments.out, f"w{index}.npz"), *model.get_weights(),
         *[w for w in initial], predictions)
common.save_result(arguments.out, index, **results)
common.log("done", results["history"])
