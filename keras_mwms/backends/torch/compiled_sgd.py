"""Keras' torch SGD update inside a `torch.compile`d step: one opaque op, no graph break.

Keras' torch SGD (`keras.optimizers.SGD` on torch) updates the weights with
`torch._foreach_add_(variables, grads, alpha=-learning_rate)`: `alpha` is a Python number, so
the learning-rate tensor is read as one (`aten._local_scalar_dense`). TorchDynamo cannot trace
that read ("Data dependent operator") and, the read sitting inside Keras' `name_scope`, it runs
the rest of `optimizer.apply` eagerly: a graph break in plain Keras with `jit_compile=True` too
(torch 2.13, Keras 3.15.1), one more per traced frame.

`update` runs Keras' update with each `alpha=-learning_rate` addition as one custom op
(`keras_mwms::add_scaled_`, `torch.library.custom_op`): Dynamo puts a call to it in the graph
and the op runs Keras' eager addition when the graph runs. That matters for the bits: on CPU
the eager `add_(alpha=)` is a fused multiply-add (`fma(g, -lr, w)`), while Inductor lowers
`w + g * -lr` to a multiply and an add (fused only on CUDA), one more rounding. Plain Keras
runs exactly those additions eagerly (at its breaks) and traces the rest (the momentum
multiply, Nesterov's `alpha=momentum` addition, in the frames Dynamo resumes), so the
weights stay **bit-identical** to one process of plain Keras with `jit_compile=True`, with and
without momentum and Nesterov.

Used for models built in `strategy.scope()` on the torch backend (the `torch-sgd-update` row
of `keras_mwms.backends.torch.patches`) while their step is being compiled; eager steps keep
Keras' own update.

Example:

>>> import torch
>>> weights = [torch.ones(2)]
>>> add_scaled_(weights, [torch.ones(2)], torch.tensor(0.5))
>>> weights[0].tolist()
[0.5, 0.5]
"""

from __future__ import annotations

import torch

from keras_mwms.backends.keras_api import optimizer_attributes


@torch.library.custom_op("keras_mwms::add_scaled_", mutates_args=("tensors",))
def add_scaled_(tensors: list[torch.Tensor], others: list[torch.Tensor], learning_rate: torch.Tensor) -> None:
    """`torch._foreach_add_(tensors, others, alpha=-learning_rate)`, the number read when it runs."""
    torch._foreach_add_(tensors, others, alpha=-learning_rate.item())


@add_scaled_.register_fake
def _add_scaled_traced(tensors, others, learning_rate) -> None:
    return None


def applies(optimizer, learning_rate) -> bool:
    """Whether `update` serves this update: a step being compiled, a tensor learning rate (a
    Keras variable or a schedule's value; a Python number is no graph break)."""
    return torch.compiler.is_compiling() and _tensor(learning_rate) is not None


def _tensor(learning_rate) -> torch.Tensor | None:
    value = learning_rate if torch.is_tensor(learning_rate) else getattr(learning_rate, "value", None)
    return value if torch.is_tensor(value) else None


def update(optimizer, grads: list, variables: list, learning_rate) -> None:
    """Keras' torch `SGD._parallel_update_step` (the `torch-sgd-update` patch row)
    operation for operation, its two `alpha=-learning_rate` additions as `add_scaled_`."""
    weights = [variable.value for variable in variables]
    grads = list(grads)
    learning_rate = _tensor(learning_rate)
    if optimizer.momentum != 0:
        buffers = [optimizer.momentums[optimizer_attributes.variable_index(optimizer, variable)].value
                   for variable in variables]
        torch._foreach_mul_(buffers, optimizer.momentum)
        add_scaled_(buffers, grads, learning_rate)
        if optimizer.nesterov:
            add_scaled_(weights, grads, learning_rate)
            torch._foreach_add_(weights, buffers, alpha=optimizer.momentum)
        else:
            torch._foreach_add_(weights, buffers)
    else:
        add_scaled_(weights, grads, learning_rate)
