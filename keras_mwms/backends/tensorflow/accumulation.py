"""Gradient accumulation on TensorFlow with one gradient all-reduce per optimizer step.

With `gradient_accumulation_steps=K` Keras adds each micro-step's gradient to the optimizer's
accumulators and applies `(gradient + accumulated) / K` every K-th micro-step. Under
`keras_mwms.backends.tensorflow.step.RowWeighting` every micro-step's gradient was
all-reduced before that (exact, but K collectives of the whole gradient per update). Here each
worker keeps its own share of the window instead:

* every micro-step the replica's *share* of the global mean gradient (its row-weighted gradient
  ÷ replicas; the row counts are summed first, in the step's small scalar all-reduce) is added
  to the optimizer's accumulators. A worker with several local replicas (GPUs) first adds its
  replicas' shares on the worker, in replica order (`worker_share`): a mirrored variable's
  copies on this worker all hold the worker's partial window, the copies on other workers
  theirs;
* on the K-th micro-step the window (accumulators + this share) is summed across workers in
  one all-reduce (`sum_across_workers`; with several local replicas the window rides on the
  first one and the others send zeros, which add exactly), divided by K, clipped, and applied
  by Keras' own update; the accumulators are zeroed.

The sum of the shares over workers and micro-steps is the sum of K global mean gradients, the
`(gradient + accumulated)` one process divides by K. Both branches live in one `tf.cond` in the
cross-replica context, where TensorFlow allows the collective (a `merge_call` inside a replica
`tf.cond` is refused). Each window all-reduce that runs is counted (`count_window_all_reduce`).

Limits: no EMA (`use_ema`), no `LossScaleOptimizer` (it decides overflow per micro-step); a checkpoint written
mid-window holds the chief's share only, as on torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_mwms.backends import policy
from keras_mwms.backends.keras_api import optimizer_attributes


def accumulates_locally(optimizer: Any) -> bool:
    """Whether `optimizer`'s micro-steps may keep their gradients on the worker until the K-th
    (any number of local replicas).

    Example:

    >>> class Optimizer:
    ...     gradient_accumulation_steps, use_ema = 4, False
    >>> accumulates_locally(Optimizer())
    True
    >>> Optimizer.use_ema = True
    >>> accumulates_locally(Optimizer())
    False
    """
    return policy.accumulation_steps(optimizer) > 0 and not getattr(optimizer, "use_ema", False)


def worker_share(local_shares: tuple) -> Any:
    """This worker's share of a gradient: its local replicas' shares added in replica order.

    Example:

    >>> worker_share((1.0,)), worker_share((1.0, 2.0, 4.0))
    (1.0, 7.0)
    """
    total = local_shares[0]
    for share in local_shares[1:]:
        total = total + share
    return total


def on_first_replica(tensor: Any, devices: tuple) -> Any:
    """A `PerReplica` for this worker's local replicas on `devices`: `tensor` on the first,
    zeros on the others, so a sum over every replica adds `tensor` once per worker (exactly)."""
    import tensorflow as tf
    from tensorflow.python.distribute import values as distribute_values

    local = [tensor]
    for device in devices[1:]:
        with tf.device(device):
            local.append(tf.zeros_like(tensor))
    return distribute_values.PerReplica(tuple(local))


def count_window_all_reduce(nbytes: int) -> None:
    """Counts one executed window all-reduce of `nbytes` (called from the graph when it runs).

    It goes to the collective ledger's kinds and to the bytes handed to the engine (`WIRE`:
    added per run, since the window all-reduce does not run on every step).

    Example:

    >>> from keras_mwms.backends.compression import WIRE
    >>> WIRE.reset(); count_window_all_reduce(400); WIRE.per_step(steps=4)
    100.0
    """
    from keras_mwms.backends.compression import WIRE
    from keras_mwms.diagnostics import LEDGER

    LEDGER.kinds["gradient all-reduce"] += 1
    WIRE.add(nbytes)


def accumulate_or_apply(optimizer: Any, shares: list, trainable_variables: list,
                        sum_across_workers: Callable[[list], list]) -> None:
    """In the cross-replica context: add this worker's `shares` to the window, or apply it.

    Args:
        optimizer: a Keras optimizer with `gradient_accumulation_steps` K, built.
        shares: this worker's share of each variable's global mean gradient, plain tensors.
        trainable_variables: the variables `shares` belong to, in order.
        sum_across_workers: sums a list of this worker's tensors over all workers (one
            all-reduce, counted by `count_window_all_reduce` when it runs) and returns the
            totals, plain tensors in the same dtypes.
    """
    from keras import ops

    steps = optimizer.gradient_accumulation_steps
    accumulators = [optimizer_attributes.accumulator_of(optimizer, variable) for variable in trainable_variables]
    window = [share + accumulator.value for share, accumulator in zip(shares, accumulators)]
    is_update_step = (optimizer_attributes.iterations_variable(optimizer) + 1) % steps == 0

    def apply_window():
        totals = sum_across_workers(window)
        grads = optimizer_attributes.clip_gradients(optimizer, [total / steps for total in totals])
        optimizer_attributes.apply_weight_decay(optimizer, trainable_variables)
        optimizer_attributes.backend_update_step(optimizer, grads, trainable_variables, optimizer.learning_rate)
        optimizer_attributes.reset_gradient_accumulators(optimizer)

    def keep_window():
        for accumulator, value in zip(accumulators, window):
            accumulator.assign(value)

    ops.cond(is_update_step, apply_window, keep_window)
