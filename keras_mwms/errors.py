"""The errors keras_mwms raises while training, the same on every backend.

`WorkerLostError` is what a synchronous job raises when a peer worker dies, hangs or becomes
unreachable: no backend can go on without it, so every worker stops with a message naming the
lost worker(s), and the process ends within `CommunicationOptions.lost_worker_exit_seconds`
even if the backend's teardown waits for the dead peer. `WorkersDifferError` is what every
worker raises when their variables are found to differ (the check after `fit` and at each
checkpoint, `keras_mwms.backends.consistency`).
"""

from __future__ import annotations


class WorkerLostError(RuntimeError):
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


class WorkersDifferError(RuntimeError):
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


class KerasVersionError(RuntimeError):
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
