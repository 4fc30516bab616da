"""Keras' own file-writing callbacks, run as keras_mwms' chief-aware ones while a strategy is active.

A user script hands `keras.callbacks.ModelCheckpoint`, `BackupAndRestore`, `CSVLogger` and
`TensorBoard` to `fit`. Run unchanged on every worker, Keras' classes all write the user's
path: two workers saving one `.weights.h5` or backup crash the job (HDF5 `unable to lock
file`), a CSV log gets its header and every row once per worker, a log directory one set of
event files per worker. While a `keras_mwms.MultiWorkerMirroredStrategy` is active, every
`keras.callbacks.CallbackList` Keras builds — in `fit`, `evaluate` and `predict` of every
backend, before any callback sees the model — passes its callbacks through `worker_aware`
(the shared patch `worker-aware-keras-callbacks`, `keras_mwms.backends.callback_list`), which
hands Keras keras_mwms' chief-aware equivalent in place of each:

| the user's callback | what runs in its place | the user's object after `fit` |
|---|---|---|
| `keras.callbacks.ModelCheckpoint`, `CSVLogger` or `TensorBoard`, or a subclass of one | a *twin*: an object of keras_mwms' class (for a subclass, of a class deriving from the user's class, then keras_mwms'), sharing the user's object's attributes | holds everything the twin set (`best`, `model`, ...): it is the same attribute dictionary |
| `keras.callbacks.BackupAndRestore` | `keras_mwms.callbacks.BackupAndRestore` with the same arguments | unchanged; the backup on disk is the state |
| a subclass of `keras.callbacks.BackupAndRestore` | refused with several workers (`ValueError` at `fit`); left as it is on one | — |
| any other callback, keras_mwms' own included | itself | — |

A subclass keeps its own methods: they come first in the twin's class, and their `super()`
calls reach keras_mwms' chief-aware methods, then Keras'. A subclass that overrides the
methods doing the I/O without calling `super()` (`ModelCheckpoint._save_model`,
`CSVLogger.on_epoch_end`, ...) writes as it wrote before, on every worker.

Example (no strategy is needed to build a twin):

>>> import keras
>>> checkpoint = keras.callbacks.ModelCheckpoint("/tmp/ckpt/best.keras", save_best_only=True)
>>> twin = worker_aware_callback(checkpoint)
>>> type(twin).__module__, type(twin).__name__, twin.__dict__ is checkpoint.__dict__
('keras_mwms.callbacks.model_checkpoint', 'ModelCheckpoint', True)
>>> twin.best = 0.5; checkpoint.best
0.5
"""

from __future__ import annotations

import functools
from typing import Any

import keras

from keras_mwms.callbacks import coordination
from keras_mwms.callbacks.backup_and_restore import BackupAndRestore
from keras_mwms.callbacks.csv_logger import CSVLogger
from keras_mwms.callbacks.model_checkpoint import ModelCheckpoint
from keras_mwms.callbacks.tensorboard import TensorBoard

# Keras' class → keras_mwms' chief-aware class whose objects can share its attributes.
_TWINS = {
    keras.callbacks.ModelCheckpoint: ModelCheckpoint,
    keras.callbacks.CSVLogger: CSVLogger,
    keras.callbacks.TensorBoard: TensorBoard,
}


def worker_aware(callbacks: Any) -> list:
    """`callbacks` (a callback, or a possibly nested list) with Keras' own file writers made
    worker-aware, flattened as `keras.callbacks.CallbackList` flattens them.

    Example:

    >>> import keras
    >>> logger, stopper = keras.callbacks.CSVLogger("log.csv"), keras.callbacks.EarlyStopping()
    >>> aware = worker_aware([logger, [stopper]])
    >>> [type(callback).__module__.startswith("keras_mwms.") for callback in aware]
    [True, False]
    """
    return [worker_aware_callback(callback) for callback in keras.tree.flatten(callbacks)]


def worker_aware_callback(callback: Any) -> Any:
    """The chief-aware callback that runs in place of `callback` (see the module docstring)."""
    if isinstance(callback, BackupAndRestore | ModelCheckpoint | CSVLogger | TensorBoard):
        return callback
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        return _backup_and_restore(callback)
    for keras_class, ours in _TWINS.items():
        if isinstance(callback, keras_class):
            twin = object.__new__(_twin_class(type(callback), ours))
            twin.__dict__ = callback.__dict__
            return twin
    return callback


@functools.cache
def _twin_class(user_class: type, ours: type) -> type:
    """`ours` for Keras' class itself; for a subclass, a class with the subclass's name that
    derives from it, then from `ours` (so its methods come first, then keras_mwms', then Keras')."""
    if user_class in _TWINS:
        return ours
    return type(user_class.__name__, (user_class, ours),
                {"__module__": user_class.__module__, "__qualname__": user_class.__qualname__,
                 "__doc__": user_class.__doc__})


def _backup_and_restore(callback: keras.callbacks.BackupAndRestore) -> Any:
    if type(callback) is not keras.callbacks.BackupAndRestore:
        if coordination.num_workers() == 1:
            return callback
        name = type(callback).__qualname__
        raise ValueError(
            f"{name} subclasses keras.callbacks.BackupAndRestore, which keras_mwms cannot run on "
            f"{coordination.num_workers()} workers: every worker would write and restore its own "
            "backup of one directory (HDF5 'unable to lock file', workers resuming at different "
            f"epochs). Derive {name} from keras_mwms.callbacks.BackupAndRestore instead (same "
            "arguments; the chief writes, every worker restores the chief's backup).")
    return BackupAndRestore(callback.backup_dir, save_freq=callback.save_freq,
                            double_checkpoint=callback.double_checkpoint,
                            delete_checkpoint=callback.delete_checkpoint)
