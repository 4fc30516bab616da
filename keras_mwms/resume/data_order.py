"""The resumable global order of a shuffled input: a pure function of (job seed, epoch).

Keras shuffles with process-global random states (NumPy, Python `random`, torch, TensorFlow's
graph seeds), drawn afresh at every epoch. A job restarted mid-epoch cannot get that order
back: the states that drew it are gone with the process. So when a fit is to be resumable
(a `keras_mwms.callbacks.BackupAndRestore` among its callbacks), keras_mwms draws the order
itself: epoch `e` visits the input's units (rows of arrays and torch datasets, batches of a
`PyDataset`) in `epoch_permutation(seed, e, units)` order, the same on every worker whatever
their number, and one *stream position* — global steps since epoch 0 — says where a job is.
A backup stores `DataOrder.state()`; a restarted job, on any number of workers, continues at the
same global example (`DataOrder.resume`).

The permutation uses the Philox bit generator's raw output, whose stream NumPy keeps stable
across releases (unlike `Generator.permutation`), so a backup restores the same order under a
newer NumPy.

Example:

>>> order = DataOrder(seed=7, units=10, units_per_step=4)
>>> order.steps_per_epoch
3
>>> [order.units_at(position).size for position in range(3)]   # 4 + 4 + 2 rows
[4, 4, 2]
>>> sorted(np.concatenate([order.units_at(position) for position in range(3)]).tolist())
[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
>>> order.locate(4)      # stream position 4: epoch 1, step 1
(1, 1)
"""

from __future__ import annotations

import math

import numpy as np

_KEY_MASK = (1 << 64) - 1


def epoch_permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    """The order of `size` units in `epoch` of a job seeded `seed` (int64 indices).

    Example:

    >>> epoch_permutation(1, 0, 6).tolist() == epoch_permutation(1, 0, 6).tolist()
    True
    >>> epoch_permutation(1, 0, 6).tolist() != epoch_permutation(1, 1, 6).tolist()
    True
    """
    bits = np.random.Philox(key=np.array([seed & _KEY_MASK, epoch & _KEY_MASK], dtype=np.uint64))
    return np.argsort(bits.random_raw(size), kind="stable").astype(np.int64)


def draw_seed() -> int:
    """A job seed from NumPy's global random state (so `keras.utils.set_random_seed` fixes it).

    Example:

    >>> np.random.seed(0); first = draw_seed(); np.random.seed(0)
    >>> draw_seed() == first
    True
    """
    return int(np.random.randint(0, 2**62, dtype=np.int64))


class DataOrder:
    """Where each global step's units come from: `(seed, epoch) → permutation`, stepped by position.

    Args:
        seed: the job seed (the chief's; stored in backups).
        units: units in one epoch (rows, or a `PyDataset`'s batches).
        units_per_step: units in one global step (the global batch size for rows, 1 for batches).
        drop_remainder: an epoch ends with its last full step (a `DataLoader` with `drop_last`).
        unit: what a unit is, for messages (`"row"` or `"batch"`).
    """

    def __init__(self, seed: int, units: int, units_per_step: int, drop_remainder: bool = False,
                 unit: str = "row"):
        if units < 1 or units_per_step < 1:
            raise ValueError(f"a data order needs at least one unit and one unit per step, got "
                             f"units={units}, units_per_step={units_per_step}")
        self.seed = int(seed)
        self.units = int(units)
        self.units_per_step = int(units_per_step)
        self.drop_remainder = drop_remainder
        self.unit = unit
        steps = units // units_per_step if drop_remainder else math.ceil(units / units_per_step)
        if steps < 1:
            raise ValueError(f"{units} {unit}s make no full step of {units_per_step}")
        self.steps_per_epoch = steps
        # The stream position that a fresh iterator's first item is (set by a resume).
        self.start = 0
        self._cached: tuple[int, np.ndarray, int] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        # One read of the cache: input threads (tf.data, prefetching) may ask for two epochs.
        cached = self._cached
        if cached is None or cached[0] != epoch or cached[2] != self.seed:
            cached = (epoch, epoch_permutation(self.seed, epoch, self.units), self.seed)
            self._cached = cached
        return cached[1]

    def locate(self, position: int) -> tuple[int, int]:
        """`(epoch, step)` of a stream position."""
        return divmod(int(position), self.steps_per_epoch)

    def position(self, epoch: int, step: int) -> int:
        return epoch * self.steps_per_epoch + step

    def units_at(self, position: int) -> np.ndarray:
        """The units (global ids) of the global step at stream `position`."""
        epoch, step = self.locate(position)
        first = step * self.units_per_step
        return self.permutation(epoch)[first:min(first + self.units_per_step, self.units)]

    def state(self, epoch: int, step: int) -> dict:
        """What a backup stores to continue this order at `(epoch, step)`."""
        return {"seed": self.seed, "epoch": epoch, "step": step, "units": self.units,
                "units_per_step": self.units_per_step, "unit": self.unit,
                "drop_remainder": self.drop_remainder}

    def resume(self, saved: dict, epoch: int, step: int) -> tuple[int, str | None]:
        """Continues a backed-up order: takes its seed and starts at `(epoch, step)`.

        Returns the step (of `epoch`) training resumes at, and one line to say when that is
        not exactly the saved position: a changed global batch (the user's choice) restarts
        the epoch's steps at the last step boundary before the saved example.

        Example:

        >>> order = DataOrder(seed=1, units=64, units_per_step=16)
        >>> order.resume({"seed": 9, "units": 64, "units_per_step": 16, "unit": "row"}, 2, 3)
        (3, None)
        >>> order.seed, order.locate(order.start)
        (9, (2, 3))
        >>> step, message = DataOrder(1, 64, 24).resume(
        ...     {"seed": 9, "units": 64, "units_per_step": 16, "unit": "row"}, 2, 3)
        >>> step, message.split(":")[0]
        (2, 'BackupAndRestore')
        """
        self.seed = int(saved["seed"])
        self._cached = None
        message = None
        if saved.get("units") != self.units or saved.get("unit", "row") != self.unit:
            message = (f"BackupAndRestore: the backup's data order covers {saved.get('units')} "
                       f"{saved.get('unit', 'row')}s, this input {self.units} {self.unit}s: the "
                       "input changed since the backup, so the resumed epoch's order is this "
                       "input's, started at the same step.")
        elif saved.get("units_per_step") != self.units_per_step:
            example = step * int(saved["units_per_step"])
            new_step = min(example // self.units_per_step, self.steps_per_epoch)
            repeated = example - new_step * self.units_per_step
            message = (f"BackupAndRestore: the global batch changed from {saved['units_per_step']} "
                       f"to {self.units_per_step} {self.unit}s since the backup (your choice); "
                       f"epoch {epoch + 1} resumes at step {new_step} of the same order, so "
                       f"{repeated} {self.unit}(s) of it are trained twice.")
            step = new_step
        self.start = self.position(epoch, step)
        return step, message
