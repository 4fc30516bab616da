"""The workers-agree check of a fit that writes checkpoints, at a point every worker reaches.

A checkpoint must not be written from workers whose variables drifted apart (the file would
hold one worker's state and the job would go on diverged). The check is a collective, so it
cannot live in `ModelCheckpoint` itself: a script may give that callback to the chief alone,
as Horovod's idiom does (`callbacks = [checkpoint] if is_chief else []`), and a collective
entered by the chief alone never completes. Instead, while a strategy is active, every
`CallbackList` Keras builds starts with a `CheckpointAgreement` on every worker
(`keras_mwms.backends.callback_list`), whatever the user's lists hold:

* `on_train_begin` — one tiny all-reduce: does any worker's list hold a `ModelCheckpoint`
  (Keras' own, a subclass, or keras_mwms')?
* `on_epoch_end` — if so, before any user callback runs, the workers-agree check
  (`keras_mwms.WorkersDifferError` on every worker, naming the variable and the workers).

A fit without checkpoints pays the one all-reduce, and `fit` still ends with its own check.
Checkpoints saved every N batches (`save_freq=N`) are covered by the next epoch's check.

Example (no strategy: one process, nothing to agree on):

>>> import keras
>>> agreement = CheckpointAgreement([keras.callbacks.ModelCheckpoint("/tmp/best.keras")])
>>> agreement.on_train_begin(); agreement.checking
False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_mwms import active
from keras_mwms.callbacks import coordination


class CheckpointAgreement(keras.callbacks.Callback):
    """Checks that the workers agree at every epoch end of a fit that writes checkpoints."""

    def __init__(self, callbacks: Sequence[Any]):
        super().__init__()
        self.writes_checkpoints = any(isinstance(callback, keras.callbacks.ModelCheckpoint)
                                      for callback in callbacks)
        self.checking = False

    def on_train_begin(self, logs=None):
        strategy = active.active_strategy()
        # A model of no strategy trains on this worker alone: no collective (`fit_call`, step 4).
        if strategy is None or strategy.num_workers == 1 or not strategy.backend.uses(self.model):
            self.checking = False
            return
        self.checking = coordination.any_worker(self.writes_checkpoints)

    def on_epoch_end(self, epoch, logs=None):
        if self.checking:
            coordination.sync_model_state(self.model)
            coordination.check_workers_agree(self.model, f"ModelCheckpoint at epoch {epoch + 1}")


def with_agreement(callbacks: Sequence[Any]) -> list:
    """`callbacks` with a `CheckpointAgreement` first (its epoch-end check runs before theirs)."""
    callbacks = list(callbacks)
    return [CheckpointAgreement(callbacks), *callbacks]
