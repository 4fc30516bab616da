"""A layer's own `aggregation="sum"`/`"mean"` state on TensorFlow (`keras_mwms.backends.layer_state`).

`tf.distribute` merges an assignment made in a replica context by the variable's aggregation:
SUM adds every replica's *new value* (old value included, so Keras' `assign_add`, which is
`assign(self + value)`, makes a counter grow exponentially), MEAN averages the replicas alike
(and an empty shard's NaN spoils it). Inside a Keras-loop step of keras_mwms' strategy the
replacement below assigns this replica's *change* instead: SUM then gives old + every change,
and MEAN, with the change weighted by the replica's share of the global rows, the row-weighted
mean one process computes.

Example (no strategy step running: Keras' own assignment):

>>> from keras_mwms.backends.tensorflow.step import RowWeighting
>>> assign = aggregated_state_assign(RowWeighting(strategy=None))(lambda variable, value: value)
>>> assign(object(), 3.0)
3.0
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from keras_mwms.backends.keras_api import attributes


def aggregated_state_assign(weighting: Any) -> Callable[[Callable], Callable]:
    """The replacement factory of `Variable._direct_assign` for one strategy's `RowWeighting`."""
    def replacement(original: Callable) -> Callable:
        @functools.wraps(original)
        def _direct_assign(variable, value, *args, **kwargs):
            aggregation = getattr(variable, "aggregation", None)
            if aggregation not in ("sum", "mean") or not weighting.loops_running:
                return original(variable, value, *args, **kwargs)
            import tensorflow as tf

            context = tf.distribute.get_replica_context()
            if (getattr(variable, "synchronization", None) == "on_read"
                    or context is None or context.num_replicas_in_sync == 1
                    or tf.distribute.get_strategy() is not weighting.strategy):
                return original(variable, value, *args, **kwargs)
            stored = attributes.variable_value(variable)   # the tf.Variable Keras' own assignment writes
            change = tf.cast(value, stored.dtype) - stored
            if aggregation == "mean":
                change = tf.math.multiply_no_nan(change, tf.cast(weighting.row_share(context), stored.dtype))
            stored.assign_add(change)

        return _direct_assign

    return replacement
