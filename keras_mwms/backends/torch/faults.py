"""A failed torch collective becomes `keras_mwms.WorkerLostError` naming the lost worker(s).

gloo and nccl report a dead or hung peer as a `RuntimeError` of the collective (a reset
connection, a timeout), without saying which peer. When a collective fails, the survivors
check in on the chief's TCPStore for `LIVENESS_WINDOW_SECONDS`; whoever does not is reported
lost (the chief itself when its store is unreachable). `Backend.worker_lost` then prints the
one message and arms the bounded exit (`CommunicationOptions.lost_worker_exit_seconds`), the
process group is torn down (waiting at most `TEARDOWN_SECONDS`) and the error is raised: a
worker never hangs on a dead peer.

Example:

>>> looks_like_collective_failure(RuntimeError("[gloo] Connection reset by peer"))
True
>>> looks_like_collective_failure(ValueError("shapes (3,) and (4,) differ"))
False
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from keras_mwms.backends import policy
from keras_mwms.errors import WorkerLostError

# After a collective fails, survivors check in for this long to find out who is gone.
LIVENESS_WINDOW_SECONDS = 3.0
# How long a lost worker waits for its process group's teardown before going on.
TEARDOWN_SECONDS = 5.0
_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "distbackend",
            "broken pipe", "store", "closed")


def looks_like_collective_failure(error: BaseException) -> bool:
    """Whether `error`, raised by a torch collective, says a peer or the network failed."""
    text = f"{type(error).__name__} {error}".lower()
    return any(marker in text for marker in _MARKERS)


@contextlib.contextmanager
def guarded(engine: Any, what: str) -> Iterator[None]:
    """Runs `engine`'s collectives; a peer's failure raises `WorkerLostError` (see the module)."""
    try:
        yield
    except WorkerLostError:
        raise
    except (RuntimeError, ValueError) as error:
        if not engine.distributed or not looks_like_collective_failure(error):
            raise
        lose_worker(engine, what, error)


def lose_worker(engine: Any, what: str, error: BaseException) -> None:
    """Finds the lost workers, tears the process group down (bounded) and raises."""
    # The process must end even if the liveness window or gloo's teardown hangs on dead peers.
    policy.start_exit_watchdog(engine.options.lost_worker_exit_seconds)
    lost = find_lost_workers(engine)
    try:
        engine.worker_lost(what, error, lost)   # prints the message, re-arms the bound, raises
    finally:
        engine.abandon()


def find_lost_workers(engine: Any) -> list[int]:
    """Survivors check in on the chief's store; whoever does not is reported lost."""
    import torch.distributed as dist

    engine.lost_worker_checks += 1
    prefix = f"keras_mwms/alive/{engine.lost_worker_checks}/"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=LIVENESS_WINDOW_SECONDS))
        store.set(f"{prefix}{engine.worker_index}", "1")
        others = [rank for rank in range(engine.num_workers) if rank != engine.worker_index]
        deadline = time.monotonic() + LIVENESS_WINDOW_SECONDS
        alive: set[int] = set()
        while time.monotonic() < deadline and len(alive) < len(others):
            alive.update(rank for rank in others
                         if rank not in alive and store.check([f"{prefix}{rank}"]))
            time.sleep(0.1)
        return [rank for rank in others if rank not in alive]
    except Exception:
        # The store lives in the chief: unreachable means the chief is gone.
        return [0] if engine.worker_index != 0 else []


def run_bounded(function: Callable[[], None], seconds: float = TEARDOWN_SECONDS) -> None:
    """Runs `function` in a daemon thread and waits at most `seconds` for it.

    Example:

    >>> run_bounded(lambda: None, seconds=1.0)
    """
    thread = threading.Thread(target=function, name="keras_mwms-teardown", daemon=True)
    thread.start()
    thread.join(seconds)
