"""Scenario worker (TensorFlow backend): fit, evaluate and predict with one global batch stream.

Runs in every worker of a gang and, without TF_CONFIG, as the single-process reference.
Writes `<out>/w<index>.npz` (final weights), `<out>/w<index>.init.npz` (weights before fit),
`<out>/w<index>.predict.npy` and `<out>/w<index>.json` (history, evaluate, step counts).

    python tests/workers/tensorflow_fit.py OUT --data arrays --optimizer sgd --epochs 2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--data", default="arrays", choices=["arrays", "dataset", "pydataset", "dataset_off"])
parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
parser.add_argument("--model", default="plain", choices=["plain", "batchnorm", "batchnorm_local", "dropout"])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--rows", type=int, default=192)
parser.add_argument("--batch", type=int, default=48, help="global batch size")
parser.add_argument("--shuffle", action="store_true")
parser.add_argument("--seed-by-worker", action="store_true", help="seed worker i with 1 + i")
parser.add_argument("--validation", default="none", choices=["none", "data", "split"])
parser.add_argument("--steps-per-epoch", type=int, default=None)
parser.add_argument("--steps-per-execution", type=int, default=1)
parser.add_argument("--jit-compile", action="store_true", help="compile(jit_compile=True)")
arguments = parser.parse_args()

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_mwms  # noqa: E402

index = common.worker_index()
strategy = keras_mwms.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(1 + (index if arguments.seed_by_worker else 0))

x, y = common.regression_data(arguments.rows)
with strategy.scope():
    if arguments.model == "plain":
        model = common.mlp()
    elif arguments.model == "dropout":
        model = common.mlp(dropout=0.3)
    else:
        model = common.mlp(batch_norm=True, synchronized=arguments.model == "batchnorm")
    optimizer = keras.optimizers.SGD(0.05) if arguments.optimizer == "sgd" else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"],
                  steps_per_execution=arguments.steps_per_execution,
                  jit_compile=True if arguments.jit_compile else "auto")
os.makedirs(arguments.out, exist_ok=True)
np.savez(os.path.join(arguments.out, f"w{index}.init.npz"), *model.get_weights())


class StepCounter(keras.callbacks.Callback):
    """Counts the train batches each epoch ran (to catch silently short epochs)."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.batches[-1] += 1


class RowsDataset(keras.utils.PyDataset):
    """The arrays as a PyDataset of global batches."""

    def __len__(self):
        return -(-len(x) // arguments.batch)

    def __getitem__(self, item):
        rows = slice(item * arguments.batch, (item + 1) * arguments.batch)
        return x[rows], y[rows]


fit_kwargs = {}
if arguments.data == "arrays":
    fit_kwargs.update(x=x, y=y, batch_size=arguments.batch, shuffle=arguments.shuffle)
elif arguments.data == "dataset":
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if arguments.shuffle:
        dataset = dataset.shuffle(len(x), seed=5, reshuffle_each_iteration=True)
    fit_kwargs.update(x=dataset.batch(arguments.batch))
elif arguments.data == "dataset_off":
    # Each worker reads its own half of the rows: the input is pre-sharded, so sharding is OFF.
    own = slice(index, None, strategy.num_workers)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    fit_kwargs.update(x=tf.data.Dataset.from_tensor_slices((x[own], y[own]))
                      .batch(arguments.batch).with_options(options))
else:
    fit_kwargs.update(x=RowsDataset())
if arguments.validation == "data":
    fit_kwargs.update(validation_data=common.regression_data(96, seed=3))
elif arguments.validation == "split":
    fit_kwargs.update(validation_split=0.25)
counter = StepCounter()
history = model.fit(**fit_kwargs, epochs=arguments.epochs, steps_per_epoch=arguments.steps_per_epoch,
                    callbacks=[counter])

x_eval, y_eval = common.regression_data(100, seed=9)
weights = np.linspace(0.5, 2.0, len(x_eval)).astype("float32")
evaluation = model.evaluate(x_eval, y_eval, sample_weight=weights, batch_size=arguments.batch,
                            return_dict=True)
prediction = model.predict(x_eval, batch_size=arguments.batch)
np.save(os.path.join(arguments.out, f"w{index}.predict.npy"), prediction)
common.save_result(arguments.out, index, model, history=history.history, evaluate=evaluation,
                   batches=counter.batches, replicas=strategy.num_replicas_in_sync,
                   is_chief=strategy.is_chief)
common.log("done", evaluation)
