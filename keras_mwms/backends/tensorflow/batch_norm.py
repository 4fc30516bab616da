"""BatchNormalization across workers on TensorFlow: one process's moments, one set of statistics.

Keras' TensorFlow BatchNormalization with `synchronized=False` normalizes each replica over its
own shard and assigns each worker's moving statistics from that shard: N workers train
differently from one process and end with different `moving_mean`/`moving_variance` (so the
chief's saved model and another worker's predictions disagree). Keras' `synchronized=True` is
global but issues three all-reduces per layer.

* `global_moments`: the mean and variance of the global batch, weighted by rows (a replica with
  an uneven or empty shard counts its own rows), in ONE differentiable all-reduce of the
  replica context (`[Σx, Σx², rows]`); TF all-reduces its gradient in the backward pass. Used
  for `synchronized=True` and, by default, for an ordinary layer
  (`policy.global_batch_norm_moments`).
* `average_moving_statistics`: with `CommunicationOptions(batch_norm_statistics="per_worker")`
  each replica normalizes over its shard (tf.distribute's behaviour; `finite_when_empty` keeps
  an empty shard from turning every weight NaN), and after the layer's own update its moving
  statistics are averaged across replicas, weighted by rows, so every worker keeps the same.

Example (outside a distribution strategy: plain moments, no collective):

>>> import tensorflow as tf
>>> mean, variance = global_moments(tf.constant([[1.0], [3.0]]), (0,))
>>> mean.numpy().tolist(), variance.numpy().tolist()
([2.0], [1.0])
"""

from __future__ import annotations

from typing import Any


def in_multi_replica_step() -> bool:
    """Whether the caller runs in the replica context of a strategy with several replicas."""
    import tensorflow as tf

    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return False
    return tf.distribute.get_replica_context().num_replicas_in_sync > 1


def global_moments(inputs: Any, axes: tuple) -> tuple:
    """Mean and variance over `axes` of the global batch, as `keras.ops.moments` computes them.

    float16/bfloat16 inputs are summed in float32 and the moments clipped to the input type's
    range, as Keras does. Outside a multi-replica step these are the local moments.
    """
    import tensorflow as tf

    x = tf.convert_to_tensor(inputs)
    dtype = x.dtype
    if dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(x, tf.float32)
    local_sum = tf.reduce_sum(x, axis=axes)
    local_squares = tf.reduce_sum(tf.square(x), axis=axes)
    # Elements per channel: rows × the other reduced dimensions (0 for an empty shard).
    count = tf.cast(tf.size(x) // tf.maximum(tf.size(local_sum), 1), x.dtype)
    channels = local_sum.shape[0]
    packed = tf.concat([local_sum, local_squares, tf.reshape(count, [1])], axis=0)
    if in_multi_replica_step():
        packed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, packed)
    total = packed[-1]
    mean = tf.math.divide_no_nan(packed[:channels], total)
    variance = tf.maximum(tf.math.divide_no_nan(packed[channels:2 * channels], total) - tf.square(mean), 0.0)
    if dtype in (tf.float16, tf.bfloat16):
        mean = tf.cast(tf.clip_by_value(mean, dtype.min, dtype.max), dtype)
        variance = tf.cast(tf.clip_by_value(variance, dtype.min, dtype.max), dtype)
    return mean, variance


def finite_when_empty(moments: tuple, inputs: Any) -> tuple:
    """Per-worker `moments`, with 0 and 1 on a replica whose shard is empty.

    Keras' moments of no rows are NaN, and the NaN reaches the gradients of gamma and beta
    (`Σ dy · mean` over no rows is 0 · NaN), so one empty shard made every weight NaN.
    """
    import tensorflow as tf

    has_rows = tf.size(inputs) > 0
    mean, variance = moments
    return (tf.where(has_rows, mean, tf.zeros_like(mean)), tf.where(has_rows, variance, tf.ones_like(variance)))


def average_moving_statistics(layer: Any, inputs: Any) -> None:
    """Replaces `layer`'s moving statistics by their row-weighted mean over replicas (one all-reduce).

    Run after the layer updated them from its own shard; a replica without rows (whose shard
    moments are NaN) weighs nothing.
    """
    import tensorflow as tf

    x = tf.convert_to_tensor(inputs)
    channels = x.shape[layer.axis]
    rows = tf.cast(tf.size(x) // channels, tf.float32)
    statistics = list(layer.non_trainable_variables)
    values = [tf.cast(tf.convert_to_tensor(variable.value), tf.float32) for variable in statistics]
    weighted = [tf.where(rows > 0, value * rows, tf.zeros_like(value)) for value in values]
    packed = tf.concat([tf.reshape(value, [-1]) for value in weighted] + [tf.reshape(rows, [1])], axis=0)
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, packed)
    offset = 0
    for variable, value in zip(statistics, values):
        size = value.shape.num_elements()
        averaged = tf.reshape(total[offset:offset + size] / total[-1], value.shape)
        variable.assign(tf.cast(averaged, variable.dtype))
        offset += size
