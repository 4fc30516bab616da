"""Multi-worker `BackupAndRestore`: restart a crashed job and resume exactly where it stopped."""

from __future__ import annotations

import os
import signal
import threading
import time

import keras

from keras_mwms.backends import resume
from keras_mwms.backends.keras_api import attributes
from keras_mwms.callbacks import coordination
from keras_mwms.errors import BackupAndRestoreError
from keras_mwms.log import get_logger
from keras_mwms.resume import backup_files, io, resumable_inputs

logger = get_logger(__name__)


PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class TrainingPreempted(SystemExit):
    """Raised on every worker after a SIGTERM: the backup is saved; the process exits with 143."""


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state so an interrupted multi-worker job resumes where it stopped.

    Synchronous training is all-or-nothing: when one worker dies the job stops, and it is
    restarted (by `python -m keras_mwms.launch --max-restarts K`, or by your orchestrator).
    With this callback the restarted job continues from the last backup, at the saved epoch
    **and step** — no batch is trained twice, and the final weights equal an uninterrupted
    run's.

    How it works across workers:

    * **Only the chief writes.** Non-chief workers write nothing at all.
    * **Writes are atomic.** Each backup is written into a temporary directory and switched in
      by renaming a small pointer file (`latest.json`), so a kill mid-write leaves the previous
      backup loadable. With `double_checkpoint=True` the previous backup is kept and used if the
      latest cannot be read.
    * **The chief reads, everyone restores.** On `fit` start the chief loads the backup and
      broadcasts it to every worker through the backend's collectives, so every worker
      restores the same state, and `backup_dir` needs to exist only on the chief's machine (a
      shared file system works too, but is not required). The saved state is the model's
      variables (weights, non-trainable statistics, random-seed state), the optimizer's
      variables, and the epoch and step.
    * **The same order, from the same example.** With `shuffle=True` on arrays or a
      `keras.utils.PyDataset`, or a torch `DataLoader` that shuffles, the order of every
      epoch is keras_mwms' own while this callback is in `fit`: a pure function of a job seed
      (drawn by the chief from NumPy's global state, so `keras.utils.set_random_seed` fixes
      it) and the epoch, the same on every worker and for any worker count (see
      `keras_mwms.resume.resumable_inputs`). The backup stores the seed, the epoch and the global
      step, and a restarted job reads on from the next global batch: its final weights are
      the uninterrupted run's, bit for bit. A tf.data pipeline that reshuffles every epoch
      (or shuffles unseeded) keeps its order inside TensorFlow's iterator: a restart then
      says once that the resumed epoch is approximate, and why. Unshuffled inputs skip the
      trained steps' batches.
    * **Any worker count.** Weights are mirrored, and the data position is counted in global
      steps (global batches), so a job may be resumed with a different number of workers:
      the global batch stays the same (each worker's share changes), and so do the optimizer
      state and the learning-rate schedule's step. A changed global batch is your choice;
      the restore says in one line where the epoch resumes then.
    * **Deleted once.** At the end of a successful `fit`, after every worker has finished, the
      chief deletes the backup (`delete_checkpoint=True`).

    Without a `keras_mwms.MultiWorkerMirroredStrategy` (one plain process) it behaves like
    `keras.callbacks.BackupAndRestore`, plus mid-epoch resumption.

    Example:

    ```python
    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = make_model()
    backup = keras_mwms.callbacks.BackupAndRestore("/tmp/backup", save_freq=50)
    model.fit(x, y, batch_size=64, epochs=10, callbacks=[backup])
    ```

    Args:
        backup_dir: directory for the backup (created by the chief).
        save_freq: `"epoch"` to back up at the end of every epoch, or an integer N to back up
            every N training steps (batches) and at the end of every epoch. `False` disables
            periodic backups.
        double_checkpoint: keep the previous backup too, and fall back to it when the latest
            one cannot be read. Defaults to `False`.
        delete_checkpoint: delete the backup when `fit` completes. Defaults to `True`.
        preemption_check_steps: how often (in steps, and at every epoch end) the workers agree
            whether any of them received SIGTERM. When one did, every worker backs up at that
            step and exits with code 143 (`TrainingPreempted`), so a restart resumes there.
            One tiny all-reduce per check; `None` disables preemption handling. Defaults to 10.

    Preemption: schedulers announce a preemption with SIGTERM (Kubernetes, Slurm, spot VMs,
    `python -m keras_mwms.launch` forwarding Ctrl-C/SIGTERM). During `fit` this callback turns
    it into a backup at the next check and a clean, non-zero exit of every worker.
    """

    # Shuffled inputs of a fit with this callback take keras_mwms' resumable order.
    keras_mwms_resumable_order = True

    def __init__(self, backup_dir: str, save_freq="epoch", double_checkpoint: bool = False,
                 delete_checkpoint: bool = True, preemption_check_steps: int | None = 10):
        super().__init__()
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed. Give the directory for backups.")
        if save_freq != "epoch" and save_freq is not False and (
                isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(
                f"Invalid value for argument `save_freq`. Received: save_freq={save_freq!r}. "
                "Expected either 'epoch', False, or a positive integer number of steps."
            )
        self.backup_dir = str(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        if preemption_check_steps is not None and (
                isinstance(preemption_check_steps, bool) or not isinstance(preemption_check_steps, int)
                or preemption_check_steps < 1):
            raise ValueError(f"preemption_check_steps must be a positive int or None, got "
                             f"{preemption_check_steps!r}")
        self.preemption_check_steps = preemption_check_steps
        self._epoch = 0
        self._steps_since_save = 0
        self._restored_from: dict | None = None
        self._sigterm_received = False
        self._previous_sigterm_handler = None

    # -- restoring ------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        self._restore()
        self._watch_for_preemption()

    def _restore(self) -> None:
        if not self.model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be built before you call "
                f"`fit()`. Model {self.model.name} is unbuilt: give it an `Input` or call it on a "
                "batch of data first."
            )
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        package = self._read_backup() if coordination.is_chief() else None
        package = coordination.broadcast_from_chief(package)
        if isinstance(package, str):
            raise BackupAndRestoreError(package)
        if package is None:
            return
        metadata, arrays = package
        self._assign_state(metadata, arrays)
        self._epoch = metadata["epoch"]
        attributes.set_initial_epoch(self.model, metadata["epoch"])
        step, pull, note = resumable_inputs.resume(self.model, metadata.get("data_order"),
                                                   metadata["epoch"], metadata["step"])
        resume.skip_steps_in_next_training_epoch(step, pull=pull)
        self._restored_from = metadata
        if not coordination.is_chief():
            return
        workers = coordination.num_workers()
        logger.info(f"BackupAndRestore: resuming from {self.backup_dir} at epoch "
                    f"{metadata['epoch'] + 1}, step {metadata['step']} (saved by "
                    f"{metadata['num_workers']} worker(s))")
        if metadata["num_workers"] != workers:
            logger.info(self._worker_count_line(metadata, workers))
        if note:   # a changed global batch, or an input whose order cannot resume exactly
            logger.warning(note)

    def _worker_count_line(self, metadata: dict, workers: int) -> str:
        saved = metadata.get("global_batch_rows")
        fit_input = resumable_inputs.active_for(self.model)
        now = fit_input.stream.global_batch_rows if fit_input and fit_input.stream else saved
        line = (f"BackupAndRestore: the backup was written by {metadata['num_workers']} "
                f"worker(s), this job has {workers}: ")
        if saved is not None and now != saved:
            return line + (f"the global batch changed from {saved} to {now} rows (your choice), "
                           f"each worker takes its 1/{workers} share of it.")
        return line + ("the same global batch" + (f" of {saved} rows" if saved else "")
                       + f", each worker now takes its 1/{workers} share of it.")

    def _read_backup(self):
        """Chief: `(metadata, arrays)`, None if there is no backup, or an error message."""
        pointer_path = os.path.join(self.backup_dir, backup_files.POINTER_FILE)
        if not os.path.exists(pointer_path):
            return None
        try:
            pointer = io.read_json(pointer_path)
        except (OSError, ValueError) as error:
            return f"BackupAndRestore: the backup pointer {pointer_path} is unreadable ({error})."
        candidates = [pointer.get("current")]
        if self.double_checkpoint and pointer.get("previous"):
            candidates.append(pointer["previous"])
        failures = []
        for name in candidates:
            try:
                package = backup_files.read_checkpoint(os.path.join(self.backup_dir, name))
            except (OSError, ValueError, KeyError) as error:
                failures.append(f"{name}: {error}")
                continue
            if failures:
                logger.warning(f"BackupAndRestore: the latest backup could not be read "
                               f"({failures[0]}); restored the previous one ({name}).")
            return package
        return (f"BackupAndRestore cannot restore from {self.backup_dir}: "
                + "; ".join(failures)
                + ". Delete the directory to start from scratch, or use double_checkpoint=True "
                "to keep a fallback backup.")

    def _state_variables(self):
        variables = list(self.model.variables)
        if self.model.optimizer is not None:
            variables += list(self.model.optimizer.variables)
        return variables

    def _assign_state(self, metadata, arrays) -> None:
        variables = self._state_variables()
        expected = [list(shape) for shape in metadata["shapes"]]
        actual = [list(variable.shape) for variable in variables]
        if expected != actual:
            raise BackupAndRestoreError(
                f"The backup in {self.backup_dir} holds {len(expected)} variables that do not match "
                f"this model and optimizer ({len(actual)} variables; first difference at "
                f"{_first_difference(expected, actual, metadata['paths'], variables)}). "
                "Use a new backup_dir for a different model."
            )
        for variable, value in zip(variables, arrays):
            variable.assign(value)

    # -- preemption -----------------------------------------------------------------------
    def _watch_for_preemption(self) -> None:
        if self.preemption_check_steps is None or threading.current_thread() is not threading.main_thread():
            return
        self._sigterm_received = False
        self._previous_sigterm_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        del signum, frame
        self._sigterm_received = True
        logger.warning(f"BackupAndRestore: worker {coordination.worker_index()} received SIGTERM; the job "
                       "backs up at the next check and stops")

    def _stop_watching(self) -> None:
        if self._previous_sigterm_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm_handler)
            self._previous_sigterm_handler = None

    def _stop_if_preempted(self, epoch: int, step: int, already_saved: bool) -> None:
        """Every worker calls this at the same points; all stop together if any got SIGTERM."""
        if not coordination.any_worker(self._sigterm_received):
            return
        if not already_saved:
            self._save(epoch, step)
        self._stop_watching()
        message = (f"BackupAndRestore: preempted (SIGTERM) — backed up to {self.backup_dir} at "
                   f"epoch {epoch + 1}, step {step}; exiting with code {PREEMPTED_EXIT_CODE}. "
                   "Restart the job to resume from there.")
        logger.warning(message)
        raise TrainingPreempted(PREEMPTED_EXIT_CODE)

    # -- saving ---------------------------------------------------------------------------
    def on_epoch_end(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._steps_since_save = 0
        # Integer save_freq backs up at epoch boundaries too, so a finished epoch is never
        # trained again after a restart (Keras' own callback only saves every N steps).
        saved = self.save_freq is not False
        if saved:
            self._save(epoch + 1, 0)
        if self.preemption_check_steps is not None:
            self._stop_if_preempted(epoch + 1, 0, already_saved=saved)

    def on_train_batch_end(self, batch, logs=None):
        saved = self._save_on_batch(batch)
        if self.preemption_check_steps is not None and (batch + 1) % self.preemption_check_steps == 0:
            steps = self.params.get("steps") if self.params else None
            if not steps or batch + 1 < steps:  # the epoch end checks the last step
                self._stop_if_preempted(self._epoch, batch + 1, already_saved=saved)

    def _save_on_batch(self, batch) -> bool:
        """Backs up every `save_freq` steps; True if it did."""
        if not isinstance(self.save_freq, int) or self.save_freq is False:
            return False
        self._steps_since_save += 1
        if self._steps_since_save < self.save_freq:
            return False
        self._steps_since_save = 0
        steps = self.params.get("steps") if self.params else None
        if steps and batch + 1 >= steps:  # the epoch-end backup covers the last step
            return False
        self._save(self._epoch, batch + 1)
        return True

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _save(self, epoch: int, step: int) -> None:
        coordination.sync_model_state(self.model)
        variables = self._state_variables()
        # Every worker reads its (mirrored) state so that backends whose reads involve
        # collectives stay in step; only the chief writes.
        arrays = [keras.ops.convert_to_numpy(variable.value) for variable in variables]
        coordination.check_workers_agree(self.model, f"BackupAndRestore's backup at epoch {epoch}, step {step}")
        if not coordination.is_chief():
            return
        metadata = {
            "format": backup_files.FORMAT,
            "epoch": epoch,
            "step": step,
            "num_workers": coordination.num_workers(),
            **self._data_order_state(epoch, step),
            "backend": keras.backend.backend(),
            "saved_at": time.time(),
            "paths": [variable.path for variable in variables],
            "shapes": [list(variable.shape) for variable in variables],
        }
        try:
            backup_files.write_backup(self.backup_dir, metadata, arrays,
                                      keep_previous=self.double_checkpoint)
        except OSError as error:
            # Disk full, read-only or missing mount: the previous backup is untouched.
            raise BackupAndRestoreError(
                f"BackupAndRestore could not write a backup to {self.backup_dir} at epoch "
                f"{epoch + 1}, step {step}: {error}. The previous backup (if any) is intact. "
                "Check that the chief can create and write this directory and has free space."
            ) from error

    def _data_order_state(self, epoch: int, step: int) -> dict:
        fit_input = resumable_inputs.active_for(self.model)
        if fit_input is None or fit_input.stream is None:
            return {}
        stream = fit_input.stream
        return {"data_order": stream.order.state(epoch, step),
                "global_batch_rows": stream.global_batch_rows}

    def on_train_end(self, logs=None):
        self._stop_watching()
        if not self.delete_checkpoint:
            return
        # Deleted once, by the chief, after every worker finished training.
        coordination.barrier("keras_mwms.BackupAndRestore.delete")
        if coordination.is_chief():
            io.remove(self.backup_dir)


def _first_difference(expected, actual, paths, variables) -> str:
    for index, (want, have) in enumerate(zip(expected, actual)):
        if want != have:
            return f"variable {index}: backup {paths[index]} {want} vs model {variables[index].path} {have}"
    return f"variable {min(len(expected), len(actual))} (different counts)"
