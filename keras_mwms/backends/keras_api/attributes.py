"""Private attributes keras_mwms reads or sets on Keras objects, one named accessor each.

Keras keeps some state keras_mwms needs only in private attributes (a model's distribution
strategy, a BatchNormalization's reduction axes, ...). They are read here, and only here, so
a Keras release that renames one changes this file alone; `tests/test_keras_api.py` builds
the objects and reads every accessor on the installed Keras.

Example:

>>> import keras
>>> layer = keras.layers.BatchNormalization()
>>> layer.build((None, 3))
>>> batch_norm_reduction_axes(layer)
[0]
"""

from __future__ import annotations

from typing import Any


def distribute_strategy(model_or_iterator: Any) -> Any:
    """The `tf.distribute` strategy a TensorFlow model (or Keras epoch iterator) runs under."""
    return model_or_iterator._distribute_strategy


def set_distribute_strategy(model_or_iterator: Any, strategy: Any) -> None:
    model_or_iterator._distribute_strategy = strategy


def symbolic_build(model: Any, data_batch: Any) -> None:
    """Keras' build of a model's (and its optimizer's and metrics') state from one batch."""
    model._symbolic_build(data_batch=data_batch)


def batch_norm_reduction_axes(layer: Any) -> list[int]:
    """The axes a built BatchNormalization normalizes over."""
    return layer._reduction_axes


def flatten_layers(model: Any, include_self: bool = False) -> list:
    """Every layer of `model`, nested ones included (Keras' own traversal)."""
    return list(model._flatten_layers(include_self=include_self))


def variable_value(variable: Any) -> Any:
    """The backend array a Keras variable holds, without Keras' read hooks."""
    return variable._value


def set_variable_value(variable: Any, value: Any) -> None:
    """Replaces the array a Keras variable holds (JAX: a re-placed global array)."""
    variable._value = value
