"""This worker's hang report: its ledger and the Python stacks that say what it is doing.

Built on the watchdog thread while the main thread may be stuck anywhere (in a collective,
in the input pipeline, in user code): `sys._current_frames()` gives the main thread's
frame without its help. When the input pipeline is making a batch on another thread
(TensorFlow's `from_generator`), that thread's stack comes too.

Example:

>>> from keras_mwms.diagnostics.ledger import Ledger
>>> report = build_report(1, "worker 1 (worker:1 at h1:2)", Ledger(), threshold=3.0)
>>> report["type"], report["worker"], report["ledger"]["sequence"], bool(report["stack"])
('report', 1, 0, True)
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

from keras_mwms.diagnostics.ledger import Ledger

STACK_FRAMES = 30


def thread_stack(ident: int | None) -> list[str]:
    """The formatted stack of thread `ident` (innermost last), at most `STACK_FRAMES` frames."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return traceback.format_stack(frame)[-STACK_FRAMES:] if frame is not None else []


KERAS_CALLS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


def keras_call(ident: int | None) -> str:
    """The innermost Keras method (`fit`, `train_on_batch`, ...) thread `ident` is inside, or "":
    a `train_on_batch` a callback runs inside `fit` is named as such."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    while frame is not None:
        code = frame.f_code
        if code.co_name in KERAS_CALLS and f"{os.sep}keras{os.sep}" in code.co_filename:
            return code.co_name
        if f"{os.sep}keras_mwms{os.sep}" in code.co_filename and "original" in code.co_freevars:
            # keras_mwms' own wrapper of a Keras method (its start-of-fit sync runs there).
            name = getattr(frame.f_locals.get("original"), "__name__", "")
            if name in KERAS_CALLS:
                return name
        frame = frame.f_back
    return ""


def build_report(worker: int, label: str, ledger: Ledger, threshold: float, failed: bool = False) -> dict:
    """The report message of worker `worker` (see the module docstring).

    `failed`: this worker's own collective failed (it reports from the lost-worker path or
    from an uncaught collective error), so where it waits now says nothing.
    """
    snapshot = ledger.snapshot()
    data = snapshot.get("data")
    return {
        "type": "report", "worker": worker, "label": label, "pid": os.getpid(),
        "host": socket.gethostname(), "time": time.time(), "threshold": threshold, "failed": failed,
        "ledger": snapshot, "stack": thread_stack(ledger.main_thread),
        # The Keras method the main thread is in now; else (and for a worker whose collective
        # failed, which has left that call) the last one that ran a train step.
        "call": (failed and snapshot["call"]) or keras_call(ledger.main_thread) or snapshot["call"],
        "data_stack": thread_stack(ledger.data_thread) if data and not data["main_thread"] else [],
    }
