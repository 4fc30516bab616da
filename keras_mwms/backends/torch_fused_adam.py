"""Keras' Adam and AdamW update in one fused torch kernel on the CPU: the same math, fewer passes.

Keras' torch Adam (`keras.src.backend.torch.optimizers.torch_adam`) updates the weights with ten
`torch._foreach_*` calls, four of which allocate a temporary as large as the model; on a CPU each
call is one more pass over memory. torch ships the whole update as one kernel
(`torch._fused_adam_`, what `torch.optim.Adam(fused=True)` runs). On the 64→3×512→10 MLP of the
benchmark (2.2 MiB of weights, 1 thread) one `optimizer.apply` takes 8.2 ms in Keras' form and
1.9 ms fused.

The two forms are the same update, written differently. Keras, at step t:

    m ← β1·m + (1−β1)·g        v ← β2·v + (1−β2)·g²
    w ← w − lr·√(1−β2^t)/(1−β1^t) · m / (√v + ε)

torch's kernel divides √v by √(1−β2^t) before adding its own ε; passing ε/√(1−β2^t) as that ε
gives Keras' formula exactly. Only the rounding differs: 1.3e-7 after 20 steps of random
gradients, far below the 1e-5 the equivalence tests allow. Weight decay (AdamW) stays in Keras'
`apply`, before the update, as it always was.

Used for models built in `strategy.scope()` on the torch backend (`torch_training`), when the
optimizer is Keras' torch Adam or AdamW without `amsgrad`, every weight and gradient is a dense
CPU tensor of one floating dtype and the step is not `torch.compile`d; anything else keeps Keras'
own update. `KERAS_MWMS_TORCH_FUSED_ADAM=0` turns it off.

Example:

>>> import os
>>> os.environ["KERAS_BACKEND"] = "torch"
>>> import keras, numpy as np
>>> from keras_mwms.backends import torch_fused_adam
>>> weights = [keras.Variable(np.ones((2, 2), "float32"))]
>>> adam = keras.optimizers.Adam(0.1)
>>> adam.build(weights)
>>> torch_fused_adam.eligible(adam, [weights[0].value], weights)
True
>>> torch_fused_adam.update(adam, [weights[0].value * 0 + 1], weights, 0.1)
>>> round(float(weights[0].numpy()[0, 0]), 4)   # the first Adam step moves by lr
0.9
"""

from __future__ import annotations

import math
import os

import torch

FUSED_ADAM_ENV = "KERAS_MWMS_TORCH_FUSED_ADAM"
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def enabled() -> bool:
    """False when `KERAS_MWMS_TORCH_FUSED_ADAM` is 0, false, no or off."""
    value = os.environ.get(FUSED_ADAM_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def applies_to(optimizer_class) -> bool:
    """Whether `optimizer_class` is (a subclass of) Keras' torch Adam, AdamW included."""
    if not hasattr(torch, "_fused_adam_"):
        return False
    from keras.src.backend.torch.optimizers.torch_adam import Adam as TorchAdam

    return issubclass(optimizer_class, TorchAdam)


def eligible(optimizer, grads, keras_variables) -> bool:
    """Whether this step can run fused: no amsgrad; dense CPU tensors of one floating dtype."""
    if getattr(optimizer, "amsgrad", False) or not keras_variables:
        return False
    dtype = keras_variables[0].value.dtype
    if dtype not in _FLOATS:
        return False
    for grad, variable in zip(grads, keras_variables):
        value = variable.value
        if (grad is None or value.device.type != "cpu" or value.dtype != dtype
                or grad.dtype != dtype or grad.is_sparse or value.is_sparse
                or not value.is_contiguous()):
            return False
    return True


@torch._dynamo.disable
@torch.no_grad()
def update(optimizer, grads, keras_variables, learning_rate) -> None:
    """One Adam step of `optimizer` on `keras_variables` in `torch._fused_adam_`.

    Reads and writes the optimizer's own momentum and velocity variables, so saving,
    restoring and switching back to Keras' update all see the usual state. The caller
    (Keras' `apply`) increments `optimizer.iterations` afterwards, as for Keras' update.
    """
    index = optimizer._get_variable_index
    params = [variable.value for variable in keras_variables]
    momentums = [optimizer._momentums[index(variable)].value for variable in keras_variables]
    velocities = [optimizer._velocities[index(variable)].value for variable in keras_variables]
    step = float(optimizer.iterations.value) + 1.0
    beta_1, beta_2 = float(optimizer.beta_1), float(optimizer.beta_2)
    bias_correction_2 = 1.0 - beta_2 ** step
    step_tensor = torch.tensor(step, dtype=torch.float32)
    torch._fused_adam_(
        params, [grad.contiguous() for grad in grads], momentums, velocities, [],
        [step_tensor] * len(params), amsgrad=False, lr=float(learning_rate), beta1=beta_1,
        beta2=beta_2, weight_decay=0.0, eps=float(optimizer.epsilon) / math.sqrt(bias_correction_2),
        maximize=False, grad_scale=None, found_inf=None)
