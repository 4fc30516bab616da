"""Compiled losses keras_mwms can split over workers: per-row means, not sums.

On several workers every backend weighs a worker's loss as the mean over its rows of the
global batch (its rows ÷ the global rows: `keras_mwms.backends.rows`), which is one process's
gradient for Keras' default reduction (`"sum_over_batch_size"`, and `"mean"`). A Keras `Loss`
compiled with `reduction="sum"` or `reduction=None` (per-row values, whose gradient is their
sum) is the *global* batch's sum in one process; weighed as a mean it would train differently,
silently (one SGD step from zero: 16 in one process, 2 on TensorFlow, 8 on torch and JAX before
this check). Until each part of a loss is weighed as it is reduced (which needs the global row
count before the backward pass), `fit`, `evaluate` and `*_on_batch` on several workers stop on
every worker, before any collective, naming the loss and the fix.

A loss *function* that returns one number for the whole batch cannot be told apart: Keras
reduces nothing and neither can keras_mwms, which takes it as a mean over the rows (right for
`ops.mean(...)`, not for `ops.sum(...)`: docs/semantics.md › Known gaps).

Example:

>>> import keras
>>> summed = keras.losses.MeanSquaredError(reduction="sum")
>>> [loss.name for loss in summed_losses({"out": summed, "aux": "mse"})]
['mean_squared_error']
>>> summed_losses(keras.losses.MeanSquaredError())
[]
"""

from __future__ import annotations

from typing import Any

MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
"""Keras' reductions that divide by the rows (Keras scales them for distribution itself)."""


def summed_losses(loss: Any) -> list:
    """The Keras `Loss` objects in a compiled `loss` argument (one, a list or a dict of them)
    whose reduction is not a mean over the rows."""
    if isinstance(loss, dict):
        return [found for value in loss.values() for found in summed_losses(value)]
    if isinstance(loss, (list, tuple)):
        return [found for value in loss for found in summed_losses(value)]
    import keras

    if isinstance(loss, keras.losses.Loss) and getattr(loss, "reduction", None) not in MEAN_REDUCTIONS:
        return [loss]
    return []


def require_mean_reduced(backend: Any, model: Any, where: str) -> None:
    """Raises `ValueError` (on every worker alike) when `model` was compiled with a summed loss
    on several workers; one worker trains it as plain Keras does."""
    if backend.num_workers == 1:
        return
    summed = summed_losses(getattr(model, "loss", None))
    if not summed:
        return
    names = ", ".join(f"{type(loss).__name__}(reduction={loss.reduction!r})" for loss in summed)
    raise ValueError(
        f"keras_mwms worker {backend.worker_index}: {where} on {backend.num_workers} workers with "
        f"a loss reduced by sum: {names}. keras_mwms weighs each worker's loss as the mean over its "
        "rows, so a summed loss would train differently from one process, silently. Compile with "
        "the default reduction ('sum_over_batch_size'): its gradient is the sum's divided by the "
        "global batch size, so multiply an SGD learning rate by the global batch size to keep the "
        "same steps (Adam, RMSprop and other scale-free optimizers need no change). Every worker "
        "stopped here, before any collective.")
