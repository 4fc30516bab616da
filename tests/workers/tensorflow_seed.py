"""Scenario worker (TensorFlow backend): the seed docs' examples and the strategy primitives.

1. the custom training loop (GradientTape + `strategy.run` + `optimizer.apply_gradients`) on a
   dataset distributed with `experimental_distribute_dataset` (global batches);
2. the Keras example: Dense(2) on 5 features, `distribute_datasets_from_function`,
   `model.fit(dist_dataset)`;
3. `barrier`, `broadcast_object`, nested `reduce`, the steps_per_execution error, and the
   TF_CONFIG-changed warning;
4. a fit on a PyDataset with a process pool, whose children must let the worker exit.

Writes `<out>/w<index>.npz` (the custom loop's weights) and `<out>/w<index>.json`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

out = sys.argv[1]
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_mwms  # noqa: E402

index = common.worker_index()
strategy = keras_mwms.MultiWorkerMirroredStrategy()
keras.utils.set_random_seed(1 + index)   # seeded differently: the strategy must align them
results = {"num_replicas_in_sync": strategy.num_replicas_in_sync,
           "task": [strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id]}

# 1. Custom training loop on global batches.
GLOBAL_BATCH = 32
x, y = common.regression_data(128)
with strategy.scope():
    model = common.mlp()
    optimizer = keras.optimizers.SGD(0.05)
dataset = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))


@tf.function
def train_step(batch):
    def step_fn(features, labels):
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            per_example = tf.reduce_mean(tf.square(labels - predictions), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    per_replica_loss = strategy.run(step_fn, args=batch)
    return strategy.reduce("SUM", per_replica_loss, axis=None)


losses = []
for _ in range(2):
    for batch in dataset:
        losses.append(float(train_step(batch)))
results["custom_loop_losses"] = losses
per_replica = strategy.run(lambda: (tf.constant(1.0), tf.constant([2.0, 3.0])))
results["local_results"] = len(strategy.experimental_local_results(per_replica[0]))
total, vector = strategy.reduce("SUM", per_replica, axis=None)
results["reduce_nested"] = [float(total), np.asarray(vector).tolist()]
results["reduce_mean_axis0"] = float(strategy.reduce("MEAN", per_replica[1], axis=0))

# 2. The seed's Keras example.
with strategy.scope():
    seed_model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    seed_model.compile(optimizer="sgd", loss="mse")


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(64)
    features = np.random.default_rng(0).normal(size=(256, 5)).astype("float32")
    labels = features[:, :2] * 2.0
    return (tf.data.Dataset.from_tensor_slices((features, labels))
            .shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            .batch(batch_size).repeat())


dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
history = seed_model.fit(dist_dataset, epochs=3, steps_per_epoch=4)
results["seed_example_loss"] = history.history["loss"]
results["seed_example_weights"] = [w.tolist() for w in seed_model.get_weights()]

# 3. Primitives and guards.
strategy.barrier("after-fit")
results["broadcast_from_0"] = strategy.backend.broadcast_object({"from": index, "text": "é" * 5})
results["broadcast_from_last"] = strategy.backend.broadcast_object(
    list(range(index * 3)), root=strategy.num_workers - 1)
with strategy.scope():
    multi_step = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    multi_step.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
try:
    multi_step.fit(np.zeros((8, 5)), np.zeros((8, 1)), batch_size=4, verbose=0)
    results["steps_per_execution_error"] = None
except NotImplementedError as error:
    results["steps_per_execution_error"] = str(error)
os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["localhost:1"]},
                                      "task": {"type": "worker", "index": 0}})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    seed_model.fit(dist_dataset, epochs=1, steps_per_epoch=1, verbose=0)
results["tf_config_warning"] = [str(w.message) for w in caught if "TF_CONFIG" in str(w.message)]
common.fit_on_a_process_pool(strategy)
common.save_result(out, index, model, **results)
common.log("done")
