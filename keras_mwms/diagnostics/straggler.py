"""Straggler attribution: per worker and epoch, where the time went, and who is slow.

Synchronous training runs at the slowest worker's pace, so wall-clock time per step is the
same everywhere; what differs is *why* each worker spent it. From its ledger
(`keras_mwms.diagnostics.ledger`) each worker knows its seconds **waiting for data**,
**computing** (the step minus its collective waits) and **waiting in collectives**. A slow
worker waits little in collectives (the others wait for it) and spends more on its own work
(data + compute); a worker is named when its own work exceeds the median worker's by more
than `RELATIVE_THRESHOLD` (and by `ABSOLUTE_THRESHOLD_SECONDS` per step at least, so noise
on fast steps names nobody).

At every epoch end of `fit` (a patch row on Keras' `CallbackList.on_epoch_end`, before the
callbacks run) each worker sends its epoch's times to the chief over the side channel — no
collective, so a model trained on one worker alone cannot hang the others — and the chief,
after waiting at most `GATHER_SECONDS` for them, keeps the report for
`keras_mwms.callbacks.TensorBoard` (`last_epoch_report`). The table is printed, after the
epoch's callbacks (so after Keras' progress line), only when it says something — a straggler
named that cost the epoch `PRINT_MIN_SECONDS` or more, a worker's times missing — or on request: `KERAS_MWMS_REPORT=1` (the launcher's
`--report`). Epochs are numbered from 1, as Keras' "Epoch 1/3".

Example:

>>> times = {0: {"data": 0.01, "compute": 0.5, "collective": 1.9, "steps": 8},
...          1: {"data": 1.9, "compute": 0.5, "collective": 0.1, "steps": 8}}
>>> stragglers(times)
[1]
>>> print(format_report(3, times, [1]).splitlines()[0])
keras_mwms epoch 4: seconds per worker (data wait / compute / collective wait); straggler: worker 1
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

from keras_mwms import active, settings
from keras_mwms.backends.keras_api import targets
from keras_mwms.backends.patches import Patch
from keras_mwms.diagnostics.ledger import LEDGER
from keras_mwms.log import get_logger

logger = get_logger(__name__)

RELATIVE_THRESHOLD = 0.2
ABSOLUTE_THRESHOLD_SECONDS = 0.005
GATHER_SECONDS = 2.0
KEYS = ("data", "compute", "collective", "steps", "in_graph_steps")
REPORT_ENV = settings.REPORT.name
PRINT_MIN_SECONDS = 0.5

_PRISTINE = {"epochs": 0, "previous": None, "last": None}
_state: dict[str, Any] = dict(_PRISTINE)   # epochs reported, the ledger totals at the last one, its report
active.register(__name__, "_state", reset=lambda: _state.update(_PRISTINE), state=lambda: dict(_state))


def stragglers(times: dict[int, dict]) -> list[int]:
    """Workers whose own work (data + compute) exceeds the median's by more than the thresholds."""
    own = {worker: entry["data"] + entry["compute"] for worker, entry in times.items()}
    if len(own) < 2:
        return []
    median = statistics.median(own.values())
    steps = max(1, max(int(entry.get("steps", 0)) for entry in times.values()))
    return sorted(worker for worker, seconds in own.items()
                  if seconds > median * (1 + RELATIVE_THRESHOLD)
                  and seconds - median > ABSOLUTE_THRESHOLD_SECONDS * steps)


def reports_requested() -> bool:
    """Whether the user asked for every table (`KERAS_MWMS_REPORT=1`, the launcher's `--report`).

    Example:

    >>> reports_requested() in (True, False)
    True
    """
    return settings.REPORT.read()


def worth_printing(slow: list[int], missing: list[int], times: dict[int, dict] | None = None) -> bool:
    """An epoch table is printed when it names a silent worker, or a straggler whose own work
    exceeds the fastest worker's by `PRINT_MIN_SECONDS` or more (a few milliseconds of jitter on
    a busy machine name someone too, and say nothing), or on request.

    Example:

    >>> times = {0: {"data": 0.0, "compute": 0.2}, 1: {"data": 0.9, "compute": 0.2}}
    >>> worth_printing([1], [], times), worth_printing([], [1]), worth_printing([], []) == reports_requested()
    (True, True, True)
    """
    if missing or reports_requested():
        return True
    if not slow or times is None:
        return bool(slow)
    own = {worker: entry["data"] + entry["compute"] for worker, entry in times.items()}
    fastest = min(own.values())   # what the others waited for, roughly
    return any(own[worker] - fastest >= PRINT_MIN_SECONDS for worker in slow)


def format_report(epoch: int, times: dict[int, dict], slow: list[int], missing: list[int] = ()) -> str:
    """The chief's report of `epoch` (0-based, printed 1-based as Keras does): one line per
    worker, the straggler named (or nobody)."""
    named = ", ".join(f"worker {worker}" for worker in slow) or "none"
    lines = [f"keras_mwms epoch {epoch + 1}: seconds per worker (data wait / compute / collective wait); "
             f"straggler: {named}"]
    in_graph = False
    for worker in sorted(times):
        entry = times[worker]
        # A step compiled with its collectives (TensorFlow) cannot be split: "-", not 0.000.
        whole = int(entry.get("in_graph_steps", 0)) >= int(entry["steps"]) > 0
        in_graph |= whole
        compute = "-" if whole else f"{entry['compute']:.3f}"
        lines.append(f"  worker {worker}: {entry['data']:.3f} / {compute} / "
                     f"{entry['collective']:.3f} over {int(entry['steps'])} step(s)")
    if in_graph:
        lines.append("  (-: the step's compute and collectives run in one compiled graph; the "
                     "last column holds both)")
    for worker in missing:
        lines.append(f"  worker {worker}: no times arrived within {GATHER_SECONDS:g} s")
    return "\n".join(lines)


def last_epoch_report() -> dict | None:
    """The chief's last epoch report: `{"epoch", "times", "stragglers"}` (None elsewhere, or before one).

    Example:

    >>> last_epoch_report() is None or "stragglers" in last_epoch_report()
    True
    """
    return _state["last"]


def _epoch_times() -> dict:
    totals = {key: float(LEDGER.totals[key]) for key in KEYS}
    previous = _state["previous"] or {key: 0.0 for key in KEYS}
    _state["previous"] = totals
    return {key: round(totals[key] - previous[key], 6) for key in KEYS}


def on_epoch_end(epoch: int, watchdog: Any) -> tuple[dict | None, str]:
    """Sends this worker's epoch times to the chief; on the chief, gathers and returns the report
    and the text to print (empty unless `worth_printing`)."""
    own = _epoch_times()
    if not own["steps"]:
        return None, ""   # no distributed train step this epoch (a model trained on one worker alone)
    _state["epochs"] += 1
    number = _state["epochs"]
    if watchdog.index != 0:
        watchdog.send_to(0, {"type": "epoch", "worker": watchdog.index, "number": number, "times": own})
        return None, ""
    deadline = time.monotonic() + GATHER_SECONDS
    times = {0: own}
    while len(times) < watchdog.num_workers and time.monotonic() < deadline:
        times.update(watchdog.epoch_times(number))
        if len(times) < watchdog.num_workers:
            time.sleep(0.005)
    missing = [worker for worker in range(watchdog.num_workers) if worker not in times]
    slow = stragglers(times)
    report = {"epoch": epoch, "times": times, "stragglers": slow}
    _state["last"] = report
    return report, (format_report(epoch, times, slow, missing) if worth_printing(slow, missing, times) else "")


def _reporting_on_epoch_end(original: Callable) -> Callable:
    def on_epoch_end_hook(self, epoch, *args, **kwargs):
        from keras_mwms import diagnostics

        watchdog = diagnostics.active_watchdog()
        report, text = None, ""
        if watchdog is not None and LEDGER.enabled:
            report, text = on_epoch_end(epoch, watchdog)
        result = original(self, epoch, *args, **kwargs)
        if text:   # after the callbacks: below Keras' finished progress line, not inside it
            names = report["stragglers"] or len(report["times"]) < watchdog.num_workers
            logger.log(logging.WARNING if names else logging.INFO, text)
        return result

    return on_epoch_end_hook


PATCH = Patch(
    name="ledger-epoch-report",
    target=targets.CALLBACK_LIST_ON_EPOCH_END,
    replacement=_reporting_on_epoch_end,
    works_around="Keras has no framework-level epoch-end hook outside the user's callbacks: the "
                 "chief's straggler report must exist before they (our TensorBoard) run",
    parameters=("epoch",),
)
