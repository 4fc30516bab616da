"""Private attributes keras_mwms reads, calls or sets on Keras optimizers, one named accessor each.

Gradient accumulation across workers (`keras_mwms.backends.*.accumulation`), the torch fused
Adam (`keras_mwms.backends.torch.fused_adam`) and the TensorFlow loss-scale path
(`keras_mwms.backends.tensorflow.gradients`) need optimizer state Keras keeps private: the
micro-step counter, the accumulators, Adam's slots, the steps of `apply` one by one. They are
touched here, and only here. The private *methods* are also `Target`s
(`keras_mwms.backends.keras_api.targets`), so `usability.require_usable` finds a renamed one
before the workers meet; the instance attributes exist only on built objects, and
`tests/test_keras_api.py` reads each of them on real optimizers of every backend.

Example:

>>> import keras, numpy as np
>>> optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
>>> weights = keras.Variable(np.zeros(3, "float32"))
>>> optimizer.build([weights])
>>> int(keras.ops.convert_to_numpy(iterations_variable(optimizer).value))
0
>>> accumulator_of(optimizer, weights).shape
(3,)
"""

from __future__ import annotations

from typing import Any

PRIVATE_NAMES = {
    "_iterations": "keras.optimizers.Optimizer: its micro-step counter variable",
    "_accumulated_gradients": "keras.optimizers.Optimizer: the gradient accumulators (built, accumulating)",
    "_get_variable_index": "keras.optimizers.Optimizer: a trainable variable's slot index",
    "_trainable_variables": "keras.optimizers.Optimizer and keras.layers.Layer: their own trainable variables",
    "_clip_gradients": "keras.optimizers.Optimizer: clipnorm / clipvalue / global_clipnorm",
    "_apply_weight_decay": "keras.optimizers.Optimizer: decoupled weight decay",
    "_backend_update_step": "keras.optimizers.Optimizer: the update of every variable",
    "_backend_reset_gradient_accumulators": "keras.optimizers.Optimizer: zeroes the accumulators",
    "_momentums": "keras.optimizers.Adam: first-moment slots",
    "_velocities": "keras.optimizers.Adam: second-moment slots",
    "_distribution_strategy": "keras.optimizers.Optimizer on TensorFlow: the tf.distribute strategy",
    "_stateful_handle_finite_grads": "keras.optimizers.LossScaleOptimizer: the step for finite gradients",
    "_stateful_handle_non_finite_grads": "keras.optimizers.LossScaleOptimizer: the step for inf/NaN gradients",
}
"""Private name → the Keras object that has it (the Keras firewall owns these names)."""


def iterations_variable(optimizer: Any) -> Any:
    """The optimizer's step-counter variable: it counts micro-steps under gradient accumulation
    (the public `iterations` is it divided by `gradient_accumulation_steps`)."""
    return optimizer._iterations


def accumulated_gradients(optimizer: Any) -> list:
    """The gradient accumulators of a built optimizer with `gradient_accumulation_steps` (in
    variable-index order; an entry may be None), else []."""
    if not getattr(optimizer, "gradient_accumulation_steps", None) or not getattr(optimizer, "built", False):
        return []
    return list(optimizer._accumulated_gradients)


def variable_index(optimizer: Any, variable: Any) -> int:
    """Where `variable`'s slots (accumulator, momentum, ...) sit in the optimizer's slot lists."""
    return optimizer._get_variable_index(variable)


def accumulator_of(optimizer: Any, variable: Any) -> Any:
    """The gradient accumulator of one trainable variable."""
    return optimizer._accumulated_gradients[variable_index(optimizer, variable)]


def trainable_variables(optimizer: Any) -> list:
    """The variables a built optimizer was built for, in its slot order."""
    return optimizer._trainable_variables


def clip_gradients(optimizer: Any, grads: list) -> list:
    """`grads` clipped as the optimizer's `clipnorm`, `clipvalue` and `global_clipnorm` say."""
    return optimizer._clip_gradients(grads)


def apply_weight_decay(optimizer: Any, variables: list) -> None:
    """The optimizer's decoupled weight decay, applied to `variables`."""
    optimizer._apply_weight_decay(variables)


def backend_update_step(optimizer: Any, grads: list, variables: list, learning_rate: Any) -> None:
    """The optimizer's update of every variable from its (final) gradient, on this backend."""
    optimizer._backend_update_step(grads, variables, learning_rate)


def reset_gradient_accumulators(optimizer: Any) -> None:
    """Zeroes the optimizer's gradient accumulators (the end of a window)."""
    optimizer._backend_reset_gradient_accumulators()


def adam_momentums(optimizer: Any) -> list:
    """A built Adam's first-moment slots, in variable-index order."""
    return optimizer._momentums


def adam_velocities(optimizer: Any) -> list:
    """A built Adam's second-moment slots, in variable-index order."""
    return optimizer._velocities


def distribution_strategy(optimizer: Any) -> Any:
    """The `tf.distribute` strategy a TensorFlow-backend optimizer was created under."""
    return optimizer._distribution_strategy


def handle_finite_grads(optimizer: Any, grads: list, variables: list) -> Any:
    """A LossScaleOptimizer's step for finite gradients: unscale, apply, maybe grow the scale."""
    return optimizer._stateful_handle_finite_grads(grads, variables)


def handle_non_finite_grads(optimizer: Any) -> Any:
    """A LossScaleOptimizer's step for inf/NaN gradients: skip, shrink the scale."""
    return optimizer._stateful_handle_non_finite_grads()
