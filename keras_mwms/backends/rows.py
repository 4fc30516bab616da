"""This step's rows: one object per engine for the row counts a training step weighs by.

Every backend weighs a worker's gradient by the rows of its shard, so that the all-reduced sum
divided by the global rows is one process's global-batch gradient, uneven and empty shards
included. `StepRows` holds the numbers of the current step as Python values: this worker's
rows (0: an empty shard, stepping on a zero-weight dummy row), the weight its loss was
multiplied by, and the global rows a `LossScaleOptimizer`'s unit is taken from.

The torch engine owns one (`TorchEngine.rows`); only its step (`backends/torch/step.py`)
begins a step, a fit, or weighs the loss (`tests/test_architecture.py` keeps it so); the
gradient all-reduce reads it and takes the loss weight (`take_loss_weight`), so a second
`optimizer.apply` in the same custom step, whose loss skipped `scale_loss`, is weighted by the
rows there instead. TensorFlow and JAX
count rows inside their traced steps (`tf.function`, `jax.jit`), where the numbers are
symbolic tensors of the step itself, not Python values between steps, so they pass them
through their step functions instead.

Example (a worker's 3 rows, its loss weighted by them, then taken by the all-reduce):

>>> rows = StepRows()
>>> rows.begin(3)
>>> rows.weigh_loss(loss_scaled=False, global_sum=lambda local: local)
3.0
>>> rows.take_loss_weight(), rows.take_loss_weight()
(3.0, None)
"""

from __future__ import annotations

from collections.abc import Callable


class StepRows:
    """This worker's rows in the current step and the weight its loss was multiplied by.

    Attributes:
        local: this worker's rows in the current step (1 before any step).
        loss_weight: the factor the optimizer's `scale_loss` multiplied the mean loss by
            (None: not weighted, e.g. a custom `train_step` that skips `scale_loss`).
        fit_global_rows: the global rows of the fit's first step, the unit of a
            `LossScaleOptimizer`'s loss weight (None until that step weighs its loss).

    Example (under a LossScaleOptimizer the weight is rows ÷ the fit's first global rows):

    >>> rows = StepRows(2)
    >>> rows.weigh_loss(loss_scaled=True, global_sum=lambda local: local * 4)
    0.25
    >>> rows.has_rows, rows.fit_global_rows
    (True, 8.0)
    """

    def __init__(self, local: int = 1):
        self.local = local
        self.loss_weight: float | None = None
        self.fit_global_rows: float | None = None

    @property
    def has_rows(self) -> bool:
        """Whether this worker's shard of the step has rows (else it steps on a dummy row)."""
        return self.local > 0

    def begin(self, rows: int) -> None:
        """A training step starts on `rows` rows of this worker."""
        self.local = rows

    def begin_fit(self) -> None:
        """A fit starts: its first step takes the `LossScaleOptimizer` unit anew."""
        self.fit_global_rows = None

    def weigh_loss(self, loss_scaled: bool, global_sum: Callable[[float], float]) -> float:
        """Records and returns the factor this worker's mean loss is multiplied by.

        Its rows; under a LossScaleOptimizer (`loss_scaled`) rows ÷ K, K being the global rows
        of the fit's first step, summed across workers by `global_sum` once per fit.
        """
        rows = float(self.local)
        if loss_scaled:
            if self.fit_global_rows is None:
                self.fit_global_rows = global_sum(rows) or 1.0
            rows = rows / self.fit_global_rows
        self.loss_weight = rows
        return rows

    def take_loss_weight(self) -> float | None:
        """The recorded loss weight (None: the loss was not weighted), forgotten once taken."""
        weight, self.loss_weight = self.loss_weight, None
        return weight
