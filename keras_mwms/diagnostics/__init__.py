"""Say who is stuck, where, and who is slow: the collective ledger, hang reports, straggler times.

* `ledger` — each worker counts its collectives (sequence number, kind, bytes, train step,
  phase) in a small ring buffer, and times data, compute and collective waits (`LEDGER`);
* `watchdog` + `channel` + `report` + `verdict` — when a worker waits in one collective longer
  than `CommunicationOptions.hang_report_seconds`, on SIGUSR1, or when the launcher sees no
  progress, every worker reports its ledger and main-thread stack over UDP (independent of
  the stuck engine) and the chief prints one verdict (no answer / data wait / behind /
  desync), then the job ends with exit status `HANG_EXIT_CODE`;
* `data_wait` — the patch that times every batch a `keras.utils.PyDataset` makes;
* `straggler` — per worker and epoch: seconds waiting for data, computing, waiting in
  collectives; the chief names a worker persistently slower than the median.
* `recompile_limit` — TorchDynamo's recompile-limit hits, read from torch's log line (the
  torch backend's warning and the benchmark's count share it).

`start(backend)` and `stop()` are a step of the strategy's start-up and `close()`
(`keras_mwms.active.Session`), with the diagnostics' patch table (`patches.PATCHES`).

Example:

>>> from keras_mwms.diagnostics import LEDGER, HANG_EXIT_CODE
>>> HANG_EXIT_CODE, LEDGER.sequence >= 0
(5, True)
"""

from __future__ import annotations

import warnings
from typing import Any

from keras_mwms import active, settings
from keras_mwms.diagnostics import native
from keras_mwms.diagnostics.ledger import LEDGER, Ledger
from keras_mwms.diagnostics.watchdog import HANG_EXIT_CODE, Watchdog

VERDICT_BEFORE_NATIVE_ABORT_SECONDS = 15.0
"""A hang report's round and the exit after its verdict take well under this."""

__all__ = ["HANG_EXIT_CODE", "LEDGER", "Ledger", "Watchdog", "active_watchdog", "confirm_lost",
           "on_escaping_error", "start", "stop"]

_active: Watchdog | None = None


def active_watchdog() -> Watchdog | None:
    """The running watchdog of this process, if any.

    Example:

    >>> active_watchdog() is None or isinstance(active_watchdog(), Watchdog)
    True
    """
    return _active


def start(backend: Any, labels: list[str] | None = None) -> Watchdog | None:
    """Starts this worker's watchdog for `backend` (several workers and a threshold), replacing any.

    `labels` name the workers in messages (`keras_mwms.backends.policy.worker_label`).
    """
    global _active
    stop()
    threshold = getattr(backend.options, "hang_report_seconds", None)
    if backend.num_workers < 2 or not threshold or not LEDGER.enabled:
        return None
    # A runtime that ends the job by itself, natively and with no verdict, after a peer has been
    # silent this long (JAX's heartbeat, which follows timeout_seconds): report well before it.
    abort = getattr(backend, "native_abort_seconds", None)
    if abort:
        threshold = min(threshold, max(1.0, abort - VERDICT_BEFORE_NATIVE_ABORT_SECONDS))
    addresses = list(backend.resolver.worker_addresses)
    try:
        watchdog = Watchdog(backend.worker_index, addresses, threshold, LEDGER,
                            launcher=settings.DIAGNOSTICS_ADDRESS.read(), labels=labels)
    except OSError as error:
        warnings.warn(f"keras_mwms worker {backend.worker_index}: no hang reports in this job: the UDP "
                      f"side channel could not listen on {addresses[backend.worker_index]} ({error}). "
                      "Free that UDP port, or set CommunicationOptions(hang_report_seconds=0) to "
                      "silence this.", stacklevel=3)
        return None
    watchdog.start()
    native.install(watchdog.on_native_terminate)
    _active = watchdog
    return watchdog


def stop() -> None:
    """Stops this process's watchdog, if one runs.

    Example:

    >>> stop()
    """
    global _active
    watchdog, _active = _active, None
    if watchdog is not None:
        native.uninstall()
        watchdog.close()


active.register(__name__, "_active", reset=stop, state=active_watchdog)


def confirm_lost(where: str) -> None:
    """Before a lost-peer error: exits with a desync verdict if every peer is alive (see `watchdog`).

    Example:

    >>> confirm_lost("gradient all-reduce")   # no watchdog in this process: returns at once
    """
    if _active is not None:
        _active.confirm_lost(where)


def on_escaping_error(error: BaseException | None, traceback: Any = None) -> None:
    """An error leaving `with strategy:` (which closes the watchdog): the uncaught-error round now.

    A failed collective gets its report round (a desync verdict ends the job there) while the
    watchdog can still answer its peers; any other error, or none, returns at once.

    Example:

    >>> on_escaping_error(RuntimeError("Collective ops is aborted by: ..."))   # no watchdog: returns
    """
    if _active is not None and error is not None:
        _active.on_escaping_error(error, traceback)
