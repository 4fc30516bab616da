"""Resume mid-epoch: skip the global batches a restored job already trained on.

Keras 3's `BackupAndRestore` records the batch but restores only the epoch, so a job killed
mid-epoch trains the first part of that epoch twice. Keras' `EpochIterator` has no hook for
this, so we patch its private `_enumerate_iterator` (all three backends' epoch iterators
inherit it): when a resume position is pending, the first training epoch pulls and discards
the batches of the steps already done, and numbering continues at that step.

Batches are pulled, not skipped by index, so every input kind (arrays, tf.data, PyDataset,
generators) and every worker advances identically — the data position maps to global steps,
which is what makes restoring with a different number of workers correct. An input that
starts at the saved position itself (`keras_mwms.resume.resumable_inputs`' ordered stream) skips the
numbering only (`pull=False`): nothing is read just to be discarded.

A strategy installs `PATCHES` with its other tables and `close()` removes it; until a restore
arms it, the patch passes every epoch through unchanged. Without a strategy (one plain
process) there is no start-up to install it at, so arming it installs it, and the next
strategy's `close()` removes it.
"""

from __future__ import annotations

import threading

from keras_mwms import active
from keras_mwms.backends.keras_api import targets
from keras_mwms.backends.patches import Patch, PatchTable


class _Pending(threading.local):
    """The skip the next training epoch of this thread takes (none by default)."""

    steps = 0
    pull = True


_pending = _Pending()


def skip_steps_in_next_training_epoch(steps: int, pull: bool = True) -> None:
    """Registers `steps` already-trained steps to skip at the start of the next training epoch.

    `pull=False`: the input already starts after them; only the step numbers skip ahead.

    Example:

    >>> skip_steps_in_next_training_epoch(0)   # nothing to skip
    """
    if steps < 0:
        raise ValueError(f"steps to skip must be >= 0, got {steps}")
    if steps:
        PATCHES.install()
    _pending.steps = steps
    _pending.pull = pull


def _take_pending() -> tuple[int, bool]:
    steps, pull = _pending.steps, _pending.pull
    _pending.steps, _pending.pull = 0, True
    return steps, pull


def _forget_pending() -> None:
    global _pending
    _pending = _Pending()


active.register(__name__, "_pending", reset=_forget_pending, state=lambda: (_pending.steps, _pending.pull))


def _skipping_enumerate_iterator(original):
    def _enumerate_iterator(self, *args, **kwargs):
        skip, pull = _take_pending()
        for begin_step, end_step, iterator in original(self, *args, **kwargs):
            if begin_step < skip:
                for _ in range(self.steps_per_execution if pull else 0):
                    next(iterator)
                continue
            yield begin_step, end_step, iterator

    return _enumerate_iterator


PATCHES = PatchTable("resume", [Patch(
    name="resume-mid-epoch",
    target=targets.EPOCH_ITERATOR_ENUMERATE,
    replacement=_skipping_enumerate_iterator,
    works_around="Keras' BackupAndRestore records the batch but restores only the epoch, and "
                 "EpochIterator has no hook to skip trained steps",
)])
