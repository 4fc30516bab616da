"""A layer's own state across workers: what `add_weight(aggregation=...)` means for it.

A custom layer may keep non-trainable state it updates in `call()` (keras.io's "examples seen"
counter, a running mean), declaring how replicas combine it with `aggregation`. keras_mwms gives
each declaration one process's meaning after every train step:

* `"sum"`: the old value plus every worker's change (a counter counts the global batch's
  rows once);
* `"mean"`: the workers' new values averaged, weighted by their rows (a running mean of the
  global batch's rows, as one process computes it for a linear update);
* `"none"` / `"only_first_replica"` (Keras' default is `"none"`): untouched; a value that then
  differs between workers is caught by the workers-agree check at the end of `fit`.

TensorFlow merges replicas itself (`tf.distribute`'s mirrored variables): keras_mwms makes an
assignment in a step add this replica's change there, weighted by its row share for `"mean"`
(`backends/tensorflow/layer_state.aggregated_state_assign`). JAX's DataParallel path computes
the step on the global batch, so the state is one process's already. The torch step and JAX's
flat step combine the variables this module lists: averaged ones ride with the
BatchNormalization statistics (row-weighted), summed ones in one collective of their changes
after the step (torch: an all-reduce; JAX: an all-gather summed in worker order).

Example:

>>> import keras
>>> class Counting(keras.layers.Layer):
...     def build(self, shape):
...         self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation="sum",
...                                     name="seen")
...         self.mean = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation="mean",
...                                     name="mean")
>>> model = keras.Sequential([keras.Input((2,)), Counting(), keras.layers.Dense(1)])
>>> summed, averaged = aggregated_state(model)
>>> [variable.name for variable in summed], [variable.name for variable in averaged]
(['seen'], ['mean'])
"""

from __future__ import annotations

from typing import Any

from keras_mwms.backends.keras_api import attributes


def aggregated_state(model: Any) -> tuple[list, list]:
    """The model's non-trainable layer variables declared `aggregation="sum"` and `"mean"`."""
    summed, averaged = [], []
    seen = set()
    for layer in attributes.flatten_layers(model):
        for variable in getattr(layer, "non_trainable_variables", []):
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            aggregation = getattr(variable, "aggregation", None)
            if aggregation == "sum":
                summed.append(variable)
            elif aggregation == "mean":
                averaged.append(variable)
    return summed, averaged
