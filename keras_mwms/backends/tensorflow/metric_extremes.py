"""Metric states combined by maximum or minimum on TensorFlow (`policy.metric_reduction`).

tf.distribute keeps a metric's state in sync-on-read variables and, read outside a replica
(the logs at an epoch's end, `evaluate`'s result), combines the replicas' values by the
variable's aggregation: SUM (Keras' default for metric states) or MEAN. A running maximum read
that way is the sum of the workers' maxima; inside a step each replica sees only its own.
Under keras_mwms' strategy a state variable that `policy.metric_reduction` combines by max or
min (a name with the word max/min, or the metric's `keras_mwms_reductions`) is created with
ONLY_FIRST_REPLICA aggregation instead (a read is this replica's own value), and before Keras
reads the metrics' results (`get_metrics_result`: in every train and test step, and after an
epoch or an `evaluate`) every replica's value becomes the maximum (minimum) over all replicas:
one all-gather per such variable, in the step's graph or, outside a replica, in one cached
`tf.function` running `strategy.run`. Models without such a state pay nothing. torch and JAX combine the same
variables in their own step payloads.

Example (outside a strategy step: Keras' own results):

>>> import keras
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> extreme_states(model)
[]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from keras_mwms.backends import policy

_EXTREMES = ("max", "min")


def extreme_states(model: Any) -> list[tuple[Any, str]]:
    """The model's metric state variables combined by max or min: `(variable, "max" | "min")`."""
    return [(variable, operation) for metric in getattr(model, "metrics", [])
            for variable in metric.variables
            if (operation := policy.metric_reduction(metric, variable)) in _EXTREMES
            and getattr(variable, "aggregation", None) == "only_first_replica"]


def first_replica_extremes(strategy: Any) -> Callable[[Callable], Callable]:
    """The replacement factory of `keras.metrics.Metric.add_variable`: a max/min state made under
    `strategy` is read per replica (ONLY_FIRST_REPLICA) rather than summed across them."""
    def replacement(original: Callable) -> Callable:
        @functools.wraps(original)
        def add_variable(self, shape, initializer, dtype=None, aggregation="sum", name=None):
            import tensorflow as tf

            declared = SimpleNamespace(name=name or "", aggregation=aggregation)
            if (tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy
                    and policy.metric_reduction(self, declared) in _EXTREMES):
                aggregation = "only_first_replica"
            return original(self, shape, initializer, dtype=dtype, aggregation=aggregation, name=name)

        return add_variable

    return replacement


def _combine_in_replica(context: Any, states: list[tuple[Any, str]]) -> None:
    import tensorflow as tf

    for variable, operation in states:
        value = tf.convert_to_tensor(variable.value)
        gathered = context.all_gather(tf.expand_dims(value, 0), axis=0)
        variable.assign(tf.reduce_max(gathered, axis=0) if operation == "max" else tf.reduce_min(gathered, axis=0))


def combined_results(strategy: Any) -> Callable[[Callable], Callable]:
    """The replacement factory of the trainer's `get_metrics_result`: max/min states combined
    across every replica of `strategy` first (see the module docstring)."""
    # Outside a replica the combination runs as one tf.function per set of states (an eager
    # `strategy.run` warns of its overhead; a new function per call would retrace every epoch).
    functions: dict[tuple[int, ...], Callable] = {}

    def outside_a_replica(states: list[tuple[Any, str]]) -> None:
        import tensorflow as tf

        key = tuple(id(variable) for variable, _ in states)
        if key not in functions:
            functions.clear()   # the model's metrics changed (a new compile): the old ones go
            functions[key] = tf.function(
                lambda: strategy.run(lambda: _combine_in_replica(tf.distribute.get_replica_context(), states)))
        with strategy.scope():
            functions[key]()

    def replacement(original: Callable) -> Callable:
        @functools.wraps(original)
        def get_metrics_result(self, *args, **kwargs):
            import tensorflow as tf

            states = extreme_states(self)
            if states and strategy.num_replicas_in_sync > 1:
                context = tf.distribute.get_replica_context()
                if context is not None and context.strategy is strategy:   # in a step's replica
                    _combine_in_replica(context, states)
                else:   # outside a replica (an epoch's end, evaluate's result): every worker is here
                    outside_a_replica(states)
            return original(self, *args, **kwargs)

        return get_metrics_result

    return replacement
