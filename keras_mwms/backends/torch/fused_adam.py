"""Keras' Adam and AdamW update on torch without its temporaries: the same operations, bit for bit.

Keras' torch Adam (what `keras.optimizers.Adam` is on torch) updates the weights with ten
`torch._foreach_*` calls, five of which allocate a temporary as large as the model. On a CPU a
fresh large allocation is fresh pages from the kernel (page faults on first touch), every step.
`update` runs the same ten operations, in the same order, on the same operands, but writes the
temporaries into two scratch buffers the optimizer keeps between steps: the rounding of every
element is unchanged, so the weights are **bit-identical** to Keras' update (tested: Δ = 0
after 220 training steps of the benchmark MLP, and on random gradients for Adam, AdamW and
learning-rate schedules). On the 64→3×512→10 MLP of the benchmark (2.2 MiB of weights,
1 thread) one update takes 5.4 ms in Keras' form and 1.9 ms here; the price is two scratch
copies of the trainable weights in memory.

torch also ships the whole update as one kernel (`torch._fused_adam_`, what
`torch.optim.Adam(fused=True)` runs): 0.5 ms on the same MLP, but it orders the arithmetic
differently (`m.lerp_`, `ε/√(1−β2^t)` folded into ε). The difference is rounding only, about
2e-7 per step, yet Adam amplifies it: on the benchmark MLP one process with it ends 6e-3 from
plain Keras after 20 steps and 0.07 after 220 steps, where two workers with Keras' own rounding
stay within 4.5e-8 of one process after 20 steps (and drift, chaotically, to the same 0.06 after
220). It is therefore opt-in: `CommunicationOptions(torch_fused_adam=True)`, or
`KERAS_MWMS_TORCH_FUSED_ADAM=1`.

Used for models built in `strategy.scope()` on the torch backend (the `torch-adam-update` row
of `keras_mwms.backends.torch.patches`), when the
optimizer is Keras' torch Adam or AdamW without `amsgrad`, every weight and gradient is a dense
CPU tensor of one floating dtype and the step is not `torch.compile`d; anything else keeps Keras'
own update. Weight decay (AdamW), gradient clipping and gradient accumulation stay in Keras'
`apply`, around the update, as they always were.

Example:

>>> import os
>>> os.environ["KERAS_BACKEND"] = "torch"
>>> import keras, numpy as np
>>> from keras_mwms.backends.torch import fused_adam
>>> weights = [keras.Variable(np.ones((2, 2), "float32"))]
>>> adam = keras.optimizers.Adam(0.1)
>>> adam.build(weights)
>>> fused_adam.eligible(adam, [weights[0].value], weights)
True
>>> fused_adam.update(adam, [weights[0].value * 0 + 1], weights, 0.1)
>>> round(float(weights[0].numpy()[0, 0]), 4)   # the first Adam step moves by lr
0.9
"""

from __future__ import annotations

import math

import torch

from keras_mwms.backends.keras_api import internals, optimizer_attributes
from keras_mwms.backends.torch.state import STATE

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def applies_to(optimizer_class) -> bool:
    """Whether `optimizer_class` is (a subclass of) Keras' torch Adam, AdamW included."""
    return issubclass(optimizer_class, internals.torch_adam_class())


def eligible(optimizer, grads, keras_variables, fused_kernel: bool = False) -> bool:
    """Whether this step can run here: no amsgrad; dense CPU tensors of one floating dtype.

    `fused_kernel`: torch's fused kernel is asked for (`CommunicationOptions.torch_fused_adam`).
    """
    if getattr(optimizer, "amsgrad", False) or not keras_variables:
        return False
    if fused_kernel and not hasattr(torch, "_fused_adam_"):
        return False
    dtype = keras_variables[0].value.dtype
    if dtype not in _FLOATS:
        return False
    for grad, variable in zip(grads, keras_variables):
        value = variable.value
        if (grad is None or value.device.type != "cpu" or grad.device.type != "cpu"
                or value.dtype != dtype or grad.dtype != dtype or grad.is_sparse
                or value.is_sparse or grad.shape != value.shape or not value.is_contiguous()):
            return False
    return True


def update(optimizer, grads, keras_variables, learning_rate, fused_kernel: bool = False) -> None:
    """One Adam step of `optimizer` on `keras_variables`: Keras' arithmetic, or torch's fused kernel.

    Reads and writes the optimizer's own momentum and velocity variables, so saving,
    restoring and switching back to Keras' update all see the usual state. The caller
    (Keras' `apply`) increments `optimizer.iterations` afterwards, as for Keras' update.
    `fused_kernel` selects torch's kernel (`CommunicationOptions.torch_fused_adam`).
    """
    if fused_kernel:
        _fused_kernel_update(optimizer, grads, keras_variables, learning_rate)
    else:
        _in_place_update(optimizer, grads, keras_variables, learning_rate)


def _adam_slots(optimizer, keras_variables: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Adam's first- and second-moment tensors of `keras_variables`, in their order."""
    momentums = optimizer_attributes.adam_momentums(optimizer)
    velocities = optimizer_attributes.adam_velocities(optimizer)
    slots = [optimizer_attributes.variable_index(optimizer, variable) for variable in keras_variables]
    return [momentums[slot].value for slot in slots], [velocities[slot].value for slot in slots]


def _scratch(optimizer, variables: list[torch.Tensor]) -> tuple[list, list]:
    """Two buffers shaped like `variables`, kept on the optimizer while the variables stay the same."""
    key = tuple(id(variable) for variable in variables)
    cached = STATE.get(optimizer, "adam_scratch")
    if cached is None or cached[0] != key:
        cached = (key, [torch.empty_like(variable) for variable in variables],
                  [torch.empty_like(variable) for variable in variables])
        STATE.of(optimizer).adam_scratch = cached
    return cached[1], cached[2]


@torch._dynamo.disable
@torch.no_grad()
def _in_place_update(optimizer, grads, keras_variables, learning_rate) -> None:
    """Keras 3.15.1's `torch_adam.Adam._parallel_update_step` (amsgrad off), temporaries reused.

    Each line below is Keras' operation with its result written into a scratch buffer instead
    of a new tensor: `torch.mul(a, b, out=s)` rounds exactly as `a * b`.
    """
    from keras import ops

    variables = [variable.value for variable in keras_variables]
    dtype = variables[0].dtype
    lr = ops.cast(learning_rate, dtype)
    local_step = ops.cast(optimizer.iterations + 1, dtype)
    beta_1_power = ops.power(ops.cast(optimizer.beta_1, dtype), local_step)
    beta_2_power = ops.power(ops.cast(optimizer.beta_2, dtype), local_step)
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)

    momentums, velocities = _adam_slots(optimizer, keras_variables)
    first, second = _scratch(optimizer, variables)

    torch._foreach_mul_(momentums, optimizer.beta_1)
    torch._foreach_add_(momentums, grads, alpha=1 - optimizer.beta_1)
    torch._foreach_mul_(velocities, optimizer.beta_2)
    for grad, squared in zip(grads, first):
        torch.mul(grad, grad, out=squared)
    torch._foreach_add_(velocities, first, alpha=1 - optimizer.beta_2)
    for momentum, step in zip(momentums, first):
        torch.mul(momentum, alpha, out=step)
    for velocity, denominator in zip(velocities, second):
        torch.sqrt(velocity, out=denominator)
    torch._foreach_add_(second, optimizer.epsilon)
    torch._foreach_div_(first, second)
    torch._foreach_add_(variables, first, alpha=-1)


@torch._dynamo.disable
@torch.no_grad()
def _fused_kernel_update(optimizer, grads, keras_variables, learning_rate) -> None:
    """Keras' Adam formula in `torch._fused_adam_` (opt-in: rounds differently, see above).

    Keras, at step t:

        m ← β1·m + (1−β1)·g        v ← β2·v + (1−β2)·g²
        w ← w − lr·√(1−β2^t)/(1−β1^t) · m / (√v + ε)

    torch's kernel divides √v by √(1−β2^t) before adding its own ε; passing ε/√(1−β2^t) as that
    ε gives Keras' formula up to rounding.
    """
    from keras import ops

    params = [variable.value for variable in keras_variables]
    momentums, velocities = _adam_slots(optimizer, keras_variables)
    # `iterations` is a Variable, or a tensor (iterations // steps) with gradient accumulation.
    step = float(ops.convert_to_numpy(optimizer.iterations)) + 1.0
    beta_1, beta_2 = float(optimizer.beta_1), float(optimizer.beta_2)
    bias_correction_2 = 1.0 - beta_2 ** step
    step_tensor = torch.tensor(step, dtype=torch.float32)
    torch._fused_adam_(
        params, [grad.contiguous() for grad in grads], momentums, velocities, [],
        [step_tensor] * len(params), amsgrad=False, lr=float(learning_rate), beta1=beta_1,
        beta2=beta_2, weight_decay=0.0, eps=float(optimizer.epsilon) / math.sqrt(bias_correction_2),
        maximize=False, grad_scale=None, found_inf=None)
