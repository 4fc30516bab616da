"""Chief-only `TensorBoard`: one set of summaries per job, not one per worker."""

from __future__ import annotations

import shutil
import tempfile

import keras

from keras_mwms.callbacks import coordination


class TensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose summaries are written by the chief only.

    The logs are global under keras_mwms, so the chief's summaries describe the whole job.
    Non-chief workers run the same callback code (so anything it computes stays in step) but
    write into a private temporary directory that is deleted when training ends — the
    `tf.distribute` convention — so nothing of theirs survives in `log_dir`.

    Example:

    ```python
    model.fit(x, y, epochs=5, callbacks=[keras_mwms.callbacks.TensorBoard("/shared/logs")])
    ```

    Args:
        log_dir: where the chief writes the event files. Other arguments are Keras'.
    """

    def __init__(self, log_dir="logs", *args, **kwargs):
        self._scratch_dir = None
        if not coordination.is_chief():
            self._scratch_dir = tempfile.mkdtemp(prefix="keras_mwms-tensorboard-")
            log_dir = self._scratch_dir
        super().__init__(log_dir, *args, **kwargs)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)
