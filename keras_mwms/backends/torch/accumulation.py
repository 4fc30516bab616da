"""Gradient accumulation on torch: one gradient all-reduce per optimizer step, not per micro-step.

With `optimizer = keras.optimizers.SGD(..., gradient_accumulation_steps=K)` one process adds
each micro-step's mean gradient `g_k` to Keras' accumulators and, every K-th micro-step,
applies `(g_1 + … + g_K) / K`. Across workers `g_k = Σ_w rows_wk · g_wk / R_k` (`R_k`: the
micro-step's global rows), so each worker adds its own share `rows_wk · g_wk / R_k` to its
accumulators (`local_share`) and only the K-th micro-step all-reduces the accumulated
gradient (`accumulated_sum`): `Σ_w (acc_w + share_w) = g_1 + … + g_K` exactly as one process
weighs its micro-batches, uneven and empty shards included. Keras then divides by K, clips and
applies as usual; its accumulators are zeroed first, so `(sum + 0) / K` is the same float on
every worker and workers stay bit-identical.

Every micro-step still all-reduces its row count and unsynchronized BatchNormalization moving
statistics (a few floats: `R_k` is needed before the share can be added) and, in the same small
all-reduce, its metric states (updated before backward, `step.train_step_metrics_first`),
so batch logs stay global at one small collective per micro-step. Between optimizer steps the
accumulators are per worker (each holds its share), as DDP's `no_sync` leaves `.grad`.

Not on this path (every micro-step all-reduces the gradient, still exact): a
`LossScaleOptimizer` (it skips steps on the all-reduced gradient's overflow) and Keras'
`MultiOptimizer`.

`keras_mwms.backends.policy.accumulation_steps` says whether an optimizer takes this path.

Example (what one worker adds for a micro-step: its rows' share of the global gradient):

>>> import torch
>>> local_share([torch.tensor([4.0, 8.0])], row_scale=1.0, total_weight=32.0)[0].tolist()
[0.125, 0.25]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from keras_mwms.backends.compression import WIRE
from keras_mwms.backends.keras_api import optimizer_attributes
from keras_mwms.backends.policy import accumulation_steps

if TYPE_CHECKING:
    from keras_mwms.backends.torch.engine import TorchEngine


def is_update_step(optimizer: Any, steps: int) -> bool:
    """Whether this micro-step applies the accumulated gradient (Keras' own test)."""
    return (int(optimizer_attributes.iterations_variable(optimizer).value.item()) + 1) % steps == 0


def local_share(grads: list, row_scale: float, total_weight: float) -> list:
    """This worker's share of the micro-step's global gradient: `grad · row_scale / total_weight`."""
    return [None if grad is None else grad * (row_scale / total_weight) for grad in grads]


@torch.no_grad()
def accumulate(backend: TorchEngine, optimizer: Any, steps: int, grads: list, variables: list | None,
               statistics: list, reduce_gradients: Callable[[TorchEngine, list], list],
               riders: Sequence[torch.Tensor] = (), on_riders: Callable[[list], None] | None = None) -> list:
    """The gradients Keras' accumulating `apply` should see on this worker (module docstring).

    A micro-step before the K-th returns this worker's share (Keras adds it to its
    accumulators); the K-th returns `Σ_w (acc_w + share_w)` after one all-reduce and zeroes
    the accumulators. `reduce_gradients(backend, tensors)` sums gradients across workers
    (`gradients.reduce_gradients`: compressed when the options say so). `riders` (the step's
    metric states, already updated) are summed in the same small all-reduce as the row count and
    handed to `on_riders`, so the batch logs need no collective of their own.
    """
    rows = float(backend.rows.local)
    has_rows = rows > 0
    loss_weight = backend.rows.take_loss_weight()
    row_scale = 1.0 if loss_weight is not None else rows
    weight = loss_weight if loss_weight is not None else rows
    present = [grad for grad in grads if grad is not None]
    reference = present[0] if present else torch.zeros(())
    small = [variable.value.data * rows if has_rows else torch.zeros_like(variable.value.data)
             for variable in statistics]
    small.append(torch.tensor([weight, rows], dtype=reference.dtype, device=reference.device))
    count = len(small)
    reduced = backend.all_reduce_flat(small + list(riders), what="row all-reduce")
    WIRE.add(sum(tensor.numel() * tensor.element_size() for tensor in small + list(riders)))
    total_weight, total_rows = float(reduced[count - 1][0]), reduced[count - 1][1]
    for variable, total in zip(statistics, reduced[:count - 1]):
        variable.value.data.copy_(total / total_rows)
    if on_riders is not None:
        on_riders(reduced[count:])
    if not has_rows:
        grads = [None if grad is None else torch.zeros_like(grad) for grad in grads]
    shares = local_share(grads, row_scale, total_weight or 1.0)
    if not is_update_step(optimizer, steps):
        return shares
    if variables is None:
        variables = optimizer_attributes.trainable_variables(optimizer)
    accumulators = [optimizer_attributes.accumulator_of(optimizer, variable) for variable in variables]
    present_slots = [i for i, share in enumerate(shares) if share is not None]
    payload = [shares[i] + accumulators[i].value.data for i in present_slots]
    summed = reduce_gradients(backend, payload)
    for accumulator in accumulators:
        accumulator.value.data.zero_()
    result = list(shares)
    for slot, i in enumerate(present_slots):
        result[i] = summed[slot]
    return result


@torch.no_grad()
def settle_window(backend: TorchEngine, optimizer: Any, broadcast: Callable[[], None]) -> None:
    """Runs `broadcast` (the chief's state to every worker, at `fit`'s start) keeping an open window.

    A fit that ended mid-window (micro-steps not a multiple of K) left each worker its own share
    in its accumulators: they are summed first (one all-reduce, only then), the chief keeps the
    sum through the broadcast and the others restart from zero, so the window goes on as in
    one process. Accumulators saved mid-window hold the saving worker's share only: resume
    from a checkpoint written at a window boundary (`save_freq` a multiple of K).
    """
    steps = accumulation_steps(optimizer)
    if not steps or not getattr(optimizer, "built", False) or not backend.distributed \
            or int(optimizer_attributes.iterations_variable(optimizer).value.item()) % steps == 0:
        broadcast()
        return
    accumulators = [accumulator for accumulator in optimizer_attributes.accumulated_gradients(optimizer)
                    if accumulator is not None]
    summed = backend.all_reduce_flat([accumulator.value.data for accumulator in accumulators],
                                     what="accumulator all-reduce")
    for accumulator, total in zip(accumulators, summed):
        accumulator.value.data.copy_(total)
    broadcast()
    if backend.worker_index != 0:   # the broadcast's source keeps the sum
        for accumulator in accumulators:
            accumulator.value.data.zero_()
