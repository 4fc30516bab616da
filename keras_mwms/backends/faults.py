"""Lost workers, on every backend: when a collective fails, who is gone, one message, one exit.

A collective that fails because a peer crashed, hung or left says little about *who* (gloo's
"Connection reset by peer", TF's graph traceback). Every backend runs the same flow
(`Faults.check`, or `Faults.guarded` around its collectives):

1. the error is a lost peer's (the backend's `is_lost_peer`); mismatched collectives
   (`is_desync`) go to the hang report's round instead, which names the desync and ends the
   job (`keras_mwms.diagnostics.confirm_lost`), and any other error is re-raised unchanged;
2. the bounded exit is armed (`CommunicationOptions.lost_worker_exit_seconds`): the process
   ends even if finding the lost peers, or the runtime's teardown, hangs on them;
3. the survivors find who is gone (`lost_ranks`): by default the check-in round
   (`survivors_round`) on the runtime's key-value store: each survivor writes its key, and
   whoever has not within `window_seconds` is lost (or, where `missing_are_lost` is False, only
   whom the runtime knows to be gone, `gone`); a store that cannot be reached means its host,
   the chief, is gone;
4. `Backend.worker_lost` raises `keras_mwms.WorkerLostError` in the one format
   (`keras_mwms.backends.policy.raise_worker_lost`: the message, the bounded exit re-armed);
5. the backend leaves the broken cluster its way (`abandon`).

A backend's `backends/<name>/faults.py` subclasses `Faults` with the small hook: how its
collective errors look, how to write and read a key on its store (or how its error names the
lost peers), and how it leaves.

Example (two workers on one store, worker 1 gone: worker 0's round names it):

>>> from types import SimpleNamespace as Port
>>> class DictFaults(Faults):
...     window_seconds = 0.3
...     store: dict = {}
...     def is_lost_peer(self, error): return "reset" in str(error)
...     def check_in(self, key): self.store[key] = "1"
...     def checked_in(self, keys): return {key for key in keys if key in self.store}
>>> DictFaults(Port(worker_index=0, num_workers=2)).survivors_round()
[1]
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from keras_mwms import diagnostics
from keras_mwms.backends import policy
from keras_mwms.errors import WorkerLostError

POLL_SECONDS = 0.1


class Faults:
    """Lost-worker detection of one backend: the flow above; a subclass supplies the hook.

    `backend` offers `num_workers`, `worker_index`, `options.lost_worker_exit_seconds` and
    `worker_lost(where, error, lost_ranks)` (`keras_mwms.backends.base.Backend`'s).
    """

    window_seconds = 3.0       # how long survivors check in to find out who is gone
    missing_are_lost = True    # False: a peer that has not checked in is lost only if `gone` says so

    def __init__(self, backend: Any):
        self.backend = backend
        self.rounds = 0        # numbers the check-in rounds, so each round has its own keys

    # -- the hook: what a backend supplies ---------------------------------------------------
    def is_lost_peer(self, error: BaseException) -> bool:
        """Whether `error`, raised by a collective, says a peer or the network failed."""
        raise NotImplementedError

    def is_desync(self, error: BaseException) -> bool:
        """Whether `error` says the workers issued different collectives (not a lost peer)."""
        return False

    def lost_ranks(self, error: BaseException) -> list[int]:
        """The ranks found lost; by default the survivors' check-in round."""
        return self.survivors_round()

    def detail(self, error: BaseException) -> BaseException:
        """What the message quotes of `error` (its first line; by default the error itself)."""
        return error

    def check_in(self, key: str) -> None:
        """Writes `key` on the store every worker reaches (raises when it cannot be reached)."""
        raise NotImplementedError

    def checked_in(self, keys: list[str]) -> set[str]:
        """Those of `keys` written on the store so far."""
        raise NotImplementedError

    def gone(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` (not checked in yet) the runtime already knows to be gone."""
        return []

    def abandon(self) -> None:
        """Leaves the broken cluster (a process group torn down, a shutdown barrier skipped)."""

    # -- the flow ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def guarded(self, where: str) -> Iterator[None]:
        """Runs collectives; a lost peer's error becomes `keras_mwms.WorkerLostError` naming it."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - runtimes' collective errors have no common type
            self.check(error, where)
            raise

    def check(self, error: BaseException, where: str) -> None:
        """Raises `keras_mwms.WorkerLostError` when `error` is a lost peer's; returns otherwise."""
        if self.backend.num_workers == 1 or isinstance(error, WorkerLostError):
            return
        if self.is_desync(error):
            diagnostics.confirm_lost(where)
            return
        if not self.is_lost_peer(error):
            return
        policy.start_exit_watchdog(self.backend.options.lost_worker_exit_seconds)
        lost = self.lost_ranks(error)
        try:
            self.backend.worker_lost(where, self.detail(error), lost)
        finally:
            self.abandon()

    def survivors_round(self) -> list[int]:
        """Survivors check in on the store; the ranks that did not (see the module) are lost."""
        self.rounds += 1
        prefix = f"keras_mwms/alive/{self.rounds}/"
        me, workers = self.backend.worker_index, self.backend.num_workers
        others = [rank for rank in range(workers) if rank != me]
        keys = {rank: f"{prefix}{rank}" for rank in others}
        try:
            self.check_in(f"{prefix}{me}")
            deadline = time.monotonic() + self.window_seconds
            while True:
                written = self.checked_in([keys[rank] for rank in others])
                missing = [rank for rank in others if keys[rank] not in written]
                found = self.gone(missing) if missing else []
                if not missing or found:
                    return sorted(found)
                if time.monotonic() >= deadline:
                    return missing if self.missing_are_lost else []
                time.sleep(POLL_SECONDS)
        except Exception:  # noqa: BLE001 - any store error: its host is unreachable
            # The store lives in the chief: unreachable means the chief is gone.
            return [0] if me != 0 else []


def bounded(function: Callable[[], Any], seconds: float) -> bool:
    """Runs `function` in a daemon thread for at most `seconds`; True if it finished.

    For calls that may hang on a dead peer (a teardown, a store query).

    Example:

    >>> bounded(lambda: None, seconds=1.0)
    True
    """
    thread = threading.Thread(target=function, name="keras_mwms-bounded", daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()
