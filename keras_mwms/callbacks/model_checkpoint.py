"""Chief-aware `ModelCheckpoint`: every worker decides, only the chief writes, atomically."""

from __future__ import annotations

import os

import keras

from keras_mwms.backends.keras_api import attributes
from keras_mwms.callbacks import coordination
from keras_mwms.log import get_logger
from keras_mwms.resume import io

logger = get_logger(__name__)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` for multi-worker jobs: one file, written by the chief.

    Same constructor as Keras', so swapping the import is the whole migration. Every worker
    runs the same save decisions — the logs are global under keras_mwms, so `save_best_only`,
    `monitor` and `initial_value_threshold` agree everywhere and `self.best` is identical on
    all workers — but only the chief writes: to a temporary file in the target directory,
    renamed into place, so a crash never leaves a half-written checkpoint. Saving enters no
    collective (the chief reads its own copy of the mirrored variables), so the callback may
    also be given to the chief alone, as Horovod scripts do
    (`callbacks = [checkpoint] if is_chief else []`); that the workers agree is checked where
    every worker is: at every epoch's end, before any callback (`keras_mwms.callbacks.agreement`),
    and at the end of `fit`.

    Example:

    ```python
    checkpoint = keras_mwms.callbacks.ModelCheckpoint(
        "/shared/ckpt/best.keras", monitor="val_loss", save_best_only=True)
    model.fit(x, y, validation_split=0.2, epochs=10, callbacks=[checkpoint])
    ```

    Args:
        filepath: where to save; may contain `{epoch}` and log keys like `{val_loss:.2f}`.
            Must end in `.keras`, or `.weights.h5` with `save_weights_only=True`.
        monitor: the (global) metric to monitor. Defaults to `"val_loss"`.
        verbose: 1 prints a line when the chief saves.
        save_best_only: save only when the monitored metric improves.
        save_weights_only: save weights only (`model.save_weights`) instead of the whole model.
        mode: `"auto"`, `"min"` or `"max"`.
        save_freq: `"epoch"` or an integer number of batches.
        initial_value_threshold: the best value to beat before the first save.
    """

    def _save_model(self, epoch, batch, logs):
        filepath = attributes.checkpoint_file_path(self, epoch, batch, logs)
        # Decided on every worker: it updates `self.best`, which must stay identical everywhere.
        if not attributes.checkpoint_should_save(self, epoch, batch, logs, filepath):
            return
        if os.path.isdir(filepath):
            raise OSError(
                "Please specify a non-directory filepath for ModelCheckpoint. Filepath used is an "
                f"existing directory: {filepath}"
            )
        if not coordination.is_chief():
            return
        coordination.sync_model_state(self.model)
        suffix = ".weights.h5" if filepath.endswith(".weights.h5") else os.path.splitext(filepath)[1]
        try:
            with io.atomic_path(filepath, suffix) as temporary:
                self._write(temporary)
        except OSError as error:
            # The engine's error names the temporary file; say which checkpoint failed.
            raise OSError(
                error.errno,
                f"ModelCheckpoint could not save {filepath}: {error}. Nothing was written "
                "there (the previous file, if any, is intact). Check that the chief can write "
                "this directory and has free space.",
            ) from error
        if self.verbose > 0:
            logger.info(f"Epoch {epoch + 1}: finished saving model to {filepath}")

    def _write(self, path: str) -> None:
        if self.save_weights_only:
            self.model.save_weights(path, overwrite=True)
        else:
            self.model.save(path, overwrite=True)
