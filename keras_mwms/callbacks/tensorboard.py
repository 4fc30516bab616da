"""Chief-only `TensorBoard`: one set of summaries per job, not one per worker."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import keras

from keras_mwms.backends.keras_api import attributes
from keras_mwms.callbacks import coordination


class TensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose summaries are written by the chief only.

    The logs are global under keras_mwms, so the chief's summaries describe the whole job.
    Non-chief workers run the same callback code (so anything it computes stays in step) but
    write into a private temporary directory — the `tf.distribute` convention — so nothing of
    theirs survives in `log_dir`. That directory exists only while the callback is in use: it
    is made when Keras hands the callback its model and deleted when training ends, or when
    the process exits if `fit` raised or only `evaluate`/`predict` used it. Only a worker
    killed by a signal it does not handle can leave it behind.

    Example:

    ```python
    model.fit(x, y, epochs=5, callbacks=[keras_mwms.callbacks.TensorBoard("/shared/logs")])
    ```

    With several workers the chief also writes, per epoch, each worker's seconds waiting for
    data, computing and waiting in collectives (`keras_mwms/worker_<i>/..._seconds`) and which
    worker is the straggler (`keras_mwms.diagnostics.straggler`).

    Args:
        log_dir: where the chief writes the event files. Other arguments are Keras'.
    """

    # Class-level defaults, not set in __init__: a Keras TensorBoard made worker-aware
    # (`keras_mwms.callbacks.worker_aware`) runs these methods without this __init__.
    _scratch_dir: str | None = None
    _requested_log_dir: str | None = None
    _remove_scratch_dir_at_exit = None

    def set_model(self, model):
        # Decided here rather than in __init__: a callback may be built before the strategy.
        if self._scratch_dir is None and not coordination.is_chief():
            self._requested_log_dir = self.log_dir
            self._scratch_dir = tempfile.mkdtemp(prefix="keras_mwms-tensorboard-")
            # `fit` skips on_train_end when it raises, and evaluate/predict never call it.
            # Registered now, after the strategy's own exit hooks, this one runs before them
            # (last in, first out), so a backend that ends a failed worker with os._exit
            # (JAX) cannot skip it.
            self._remove_scratch_dir_at_exit = functools.partial(
                shutil.rmtree, self._scratch_dir, ignore_errors=True)
            atexit.register(self._remove_scratch_dir_at_exit)
            self.log_dir = self._scratch_dir
        super().set_model(model)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._write_worker_times(epoch)

    def _write_worker_times(self, epoch):
        """The chief's straggler report as scalars: `worker_<i>/{data,compute,collective}_seconds`."""
        from keras_mwms.diagnostics import straggler

        report = straggler.last_epoch_report()
        if self._scratch_dir is not None or report is None or report["epoch"] != epoch:
            return
        with attributes.tensorboard_train_writer(self).as_default():
            for worker, times in sorted(report["times"].items()):
                for key in ("data", "compute", "collective"):
                    self.summary.scalar(f"keras_mwms/worker_{worker}/{key}_seconds", times[key], step=epoch)
                self.summary.scalar(f"keras_mwms/worker_{worker}/straggler",
                                    float(worker in report["stragglers"]), step=epoch)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if self._scratch_dir is not None:
            self._remove_scratch_dir_at_exit()
            atexit.unregister(self._remove_scratch_dir_at_exit)
            self._scratch_dir = self._remove_scratch_dir_at_exit = None
            self.log_dir = self._requested_log_dir
