"""keras_mwms' messages: Python `logging` under the "keras_mwms" logger, each labelled with its worker.

The runtime reports of a job (the chief's "cluster of 2 workers from TF_CONFIG", its compute
threads, the straggler table, hang reports and verdicts, a lost worker, `BackupAndRestore`
resuming or preempted) are log records of `logging.getLogger("keras_mwms")` and its children
(`keras_mwms.strategy`, `keras_mwms.diagnostics.watchdog`, ...). A user silences or redirects
them as for any library:

    logging.getLogger("keras_mwms").setLevel(logging.ERROR)      # only failures
    logging.getLogger("keras_mwms").addHandler(logging.FileHandler("mwms.log"))

Defaults, chosen so that a job shows what it always showed:

* the "keras_mwms" logger's level is INFO (unless the user set one before importing
  keras_mwms), whatever the root logger's level;
* it carries one handler that writes the bare message to stderr, but only while no other
  handler would receive the record: once the user configured logging (`logging.basicConfig()`,
  a handler on "keras_mwms" or on the root logger), their handlers alone show it, in their
  format, and nothing is printed twice.

Levels: INFO for what a healthy job says (the cluster's source, a resumed backup), WARNING for
what went wrong but was handled (a straggler, a fallback backup, a preemption), ERROR for what
ends the job (a lost worker, a hang verdict). Advice the user's code should act on (a misuse,
an ignored option, an unsupported version) stays `warnings.warn`, so `-W error` and
`pytest.warns` keep working.

In a job of several workers each message starts with `[worker I] `, the label
`python -m keras_mwms.launch` puts on its workers' lines (the launcher adds none to a line that
already has it), so logs of srun, torchrun and mpirun jobs read the same.

Example:

>>> import io, logging
>>> from keras_mwms.startup.cluster import SimpleClusterResolver
>>> logger, redirected = get_logger("keras_mwms.example"), io.StringIO()
>>> logging.getLogger("keras_mwms").addHandler(handler := logging.StreamHandler(redirected))
>>> logger.info("hello", worker=SimpleClusterResolver({"worker": ["h0:1", "h1:2"]}, "worker", 1))
>>> logging.getLogger("keras_mwms").removeHandler(handler)
>>> redirected.getvalue()
'[worker 1] hello\\n'
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from keras_mwms import active

LOGGER_NAME = "keras_mwms"


class _Stderr(logging.Handler):
    """keras_mwms' own handler: the bare message on stderr while no other handler shows it."""

    def emit(self, record: logging.LogRecord) -> None:
        if _other_handler_receives(record, self) or sys.stderr is None:
            return
        try:
            sys.stderr.write(self.format(record) + "\n")   # looked up now: pytest and users swap it
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise
            self.handleError(record)


def _other_handler_receives(record: logging.LogRecord, own: logging.Handler) -> bool:
    """True when a handler besides `own` is on `record`'s way up (as `Logger.callHandlers` walks)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        if any(handler is not own for handler in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


class _WorkerLabel(logging.LoggerAdapter):
    """Prefixes `[worker I] ` in a job of several workers; `worker=` names it before the
    strategy is active (anything with `worker_index` and `num_workers`, e.g. a resolver)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        worker = kwargs.pop("worker", None) or active.active_backend()
        if worker is not None and worker.num_workers > 1:
            msg = f"[worker {worker.worker_index}] {msg}"
        return msg, kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    """The logger of keras_mwms module `name` (pass `__name__`), its messages worker-labelled."""
    return _WorkerLabel(logging.getLogger(name))


def _install_defaults() -> None:
    root = logging.getLogger(LOGGER_NAME)
    if root.level == logging.NOTSET:   # a level the user set before importing keras_mwms wins
        root.setLevel(logging.INFO)
    if not any(isinstance(handler, _Stderr) for handler in root.handlers):
        root.addHandler(_Stderr())


_install_defaults()
