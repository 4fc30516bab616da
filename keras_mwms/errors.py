"""Every error keras_mwms raises, under one base: `KerasMwmsError`.

`except keras_mwms.errors.KerasMwmsError` catches anything keras_mwms itself refused or lost;
each class also keeps the built-in base it always had (`ValueError` for a configuration that
cannot work, `RuntimeError` for a job that cannot go on), so existing `except ValueError:` and
`except RuntimeError:` blocks keep working. Arguments of the wrong type or value given to a
public function or class still raise plain `TypeError`/`ValueError`, as Keras does.

| error | also a | raised when |
|-------|--------|-------------|
| `TFConfigError` | `ValueError` | `TF_CONFIG` or a cluster spec cannot describe a valid job |
| `ClusterEnvironmentError` | `TFConfigError` | Slurm, torchrun or MPI variables cannot describe a valid job |
| `EnvironmentVariableError` | `ValueError` | a `KERAS_MWMS_*` variable has a value keras_mwms cannot read |
| `GpuAssignmentError` | `ValueError` | the GPUs a worker should use cannot be decided |
| `RendezvousError` | `RuntimeError` | the workers could not all meet with identical configurations |
| `StrategyCreatedTooLateError` | `RuntimeError` | TensorFlow or JAX ran a computation before the strategy existed |
| `NcclUnavailableError` | `RuntimeError` | NCCL was requested where torch cannot use it |
| `WorkerLostError` | `RuntimeError` | a peer worker crashed, hung or left during training |
| `WorkersDifferError` | `RuntimeError` | the workers' variables differ after `fit` or at a checkpoint |
| `BackupAndRestoreError` | `RuntimeError` | a backup exists but cannot be restored |
| `KerasVersionError` | `RuntimeError` | the installed Keras or backend lacks a private name keras_mwms needs, or is outside the supported releases without the override |
| `KerasNameMissing` | `AttributeError` | the firewall resolves a private Keras name this Keras lacks (turned into a `KerasVersionError` at start) |

`keras_mwms.callbacks.TrainingPreempted` is not an error: it is the `SystemExit` that ends a
worker after a SIGTERM once its backup is saved, and stays outside `Exception` on purpose.
"""

from __future__ import annotations


class KerasMwmsError(Exception):
    """The base of every error keras_mwms raises; catch it to handle all of them at once.

    Every subclass also derives from the built-in exception it has always been (see the
    module's table), so catching that keeps working.

    Example:

    >>> from keras_mwms.errors import KerasMwmsError, TFConfigError
    >>> issubclass(TFConfigError, KerasMwmsError), issubclass(TFConfigError, ValueError)
    (True, True)

    Subclasses:
        TFConfigError, ClusterEnvironmentError, EnvironmentVariableError, GpuAssignmentError,
        RendezvousError, StrategyCreatedTooLateError, NcclUnavailableError, WorkerLostError,
        WorkersDifferError, BackupAndRestoreError, KerasVersionError, KerasNameMissing.
    """


class TFConfigError(KerasMwmsError, ValueError):
    """A `TF_CONFIG` (or explicit cluster spec) that cannot describe a valid job.

    The message names the offending field, shows its value and says how to fix it.

    Example:

    >>> from keras_mwms.startup.cluster import parse_tf_config, TFConfigError
    >>> try:
    ...     parse_tf_config('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}}')
    ... except TFConfigError as error:
    ...     print("task.index" in str(error))
    True
    """


class EnvironmentVariableError(KerasMwmsError, ValueError):
    """A `KERAS_MWMS_*` environment variable whose value keras_mwms cannot read.

    The message reads `NAME='value' problem: fix` (`keras_mwms.settings` reads every variable).

    Example:

    >>> from keras_mwms import settings
    >>> try:
    ...     settings.LEDGER.read({"KERAS_MWMS_LEDGER": "maybe"})
    ... except EnvironmentVariableError as error:
    ...     print(error)
    KERAS_MWMS_LEDGER='maybe' is not a switch: set it to 1 (on) or 0 (off).
    """


class ClusterEnvironmentError(TFConfigError, EnvironmentVariableError):
    """An orchestrator's environment that cannot describe a valid job.

    The message names the variable, shows its value and says how to fix it. It is a
    `TFConfigError` (a `ValueError`), so code that catches bad `TF_CONFIG`s catches these too.

    Example:

    >>> from keras_mwms.resolvers import TorchrunClusterResolver, ClusterEnvironmentError
    >>> try:
    ...     TorchrunClusterResolver(environ={"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    ... except ClusterEnvironmentError as error:
    ...     print(str(error).split(":")[0])
    RANK='x' is not an integer
    """


class GpuAssignmentError(KerasMwmsError, ValueError):
    """The GPUs a worker should use cannot be decided; the message says what to set.

    Example:

    >>> from keras_mwms.devices.assignment import assign_gpus
    >>> try:
    ...     assign_gpus("torch", visible=4, workers=2, environ={})
    ... except GpuAssignmentError as error:
    ...     print("no local rank" in str(error))
    True
    """


class RendezvousError(KerasMwmsError, RuntimeError):
    """The workers of a job could not all meet with identical configurations.

    The message names the missing or mismatched tasks, their addresses and what to fix.

    Example:

    >>> issubclass(RendezvousError, RuntimeError)
    True
    """


class StrategyCreatedTooLateError(KerasMwmsError, RuntimeError):
    """TensorFlow or JAX ran a computation before `MultiWorkerMirroredStrategy()` was created.

    Their collectives (TensorFlow) or distributed runtime (JAX) can only be configured before
    the first computation: create the strategy right after the imports, then build models,
    seeds and data.

    Example:

    >>> issubclass(StrategyCreatedTooLateError, RuntimeError)
    True
    """


class NcclUnavailableError(KerasMwmsError, RuntimeError):
    """`CommunicationImplementation.NCCL` was requested where torch cannot use NCCL.

    Example:

    >>> issubclass(NcclUnavailableError, RuntimeError)
    True
    """


class WorkerLostError(KerasMwmsError, RuntimeError):
    """A peer worker crashed, hung or left; synchronous training cannot continue on any worker.

    The message names the lost worker(s) as `worker R (job:index at host:port)` when they can
    be found, and the backend's own error is chained as the cause. Restart the whole gang (for
    example `python -m keras_mwms.launch --max-restarts N`) and resume with
    `keras_mwms.callbacks.BackupAndRestore`.

    Example:

    >>> error = WorkerLostError("lost worker 1", lost_workers=[1], where="gradient all-reduce")
    >>> isinstance(error, RuntimeError), error.lost_workers, error.where
    (True, [1], 'gradient all-reduce')

    Args:
        message: the full message (see `keras_mwms.backends.policy.lost_worker_message`).
        lost_workers: ranks of the workers found lost (empty when none could be named).
        where: the operation that failed, e.g. `"gradient all-reduce"`.
    """

    def __init__(self, message: str, lost_workers: list[int] | None = None, where: str = ""):
        super().__init__(message)
        self.lost_workers = list(lost_workers or [])
        self.where = where


class WorkersDifferError(KerasMwmsError, RuntimeError):
    """The workers' model or optimizer variables differ: synchronous training has diverged.

    Raised on every worker at once by the check at the end of `fit` and at every checkpoint
    (`keras_mwms.backends.consistency`), so no worker waits for another that stopped. The
    message names the first differing variable and the workers that hold other values.

    Example:

    >>> error = WorkersDifferError("variables differ", variable="dense/kernel", workers=[1])
    >>> isinstance(error, RuntimeError), error.variable, error.workers
    (True, 'dense/kernel', [1])

    Args:
        message: the full message.
        variable: the path of the first differing variable (model weights first, then the
            optimizer's variables).
        workers: the ranks whose values differ from the chief's (with 2 workers: `[1]`).
    """

    def __init__(self, message: str, variable: str = "", workers: list[int] | None = None):
        super().__init__(message)
        self.variable = variable
        self.workers = list(workers or [])


class BackupAndRestoreError(KerasMwmsError, RuntimeError):
    """A backup exists but cannot be restored (corrupt, or from another model).

    The message names the backup directory and what to do (delete it, or restore the model it
    was written by).

    Example:

    >>> issubclass(BackupAndRestoreError, RuntimeError)
    True
    """


class KerasVersionError(KerasMwmsError, RuntimeError):
    """The installed Keras (or backend) is one keras_mwms cannot serve; raised before the
    workers meet, by `MultiWorkerMirroredStrategy()` on every worker.

    The message names the installed release, what is outside the supported range or which
    private Keras names it lacks, the supported releases and the override
    (`KERAS_MWMS_ALLOW_UNTESTED_KERAS=1`, which tries a release outside the range that still
    has every name keras_mwms needs).

    Example:

    >>> isinstance(KerasVersionError("Keras 3.11.3 is not supported"), RuntimeError)
    True
    """


class KerasNameMissing(KerasMwmsError, AttributeError):
    """A private Keras name keras_mwms relies on is not in the installed Keras.

    Raised by the Keras firewall (`keras_mwms.backends.keras_api`) when it resolves a name;
    `MultiWorkerMirroredStrategy()` turns every such name into one `KerasVersionError` before
    the workers meet.

    Example:

    >>> issubclass(KerasNameMissing, AttributeError)
    True
    """
