"""JAX's hook for lost workers (the flow is `keras_mwms.backends.faults`), and its exit.

A gloo or coordination-service failure says little about *who* failed ("Connection reset by
peer"). At start-up every worker publishes its host and process id through JAX's coordination
service; when a collective fails with an error that looks like a lost peer, the survivors check
in on the coordination service's key-value store, and a peer that has not is lost once JAX
knows it is gone: a local peer whose process is gone, a remote chief whose coordination service
no longer answers (retrying for `window_seconds`).

JAX cannot leave a broken cluster cleanly: its shutdown barrier waits for the dead peer. So the
interpreter's exit skips it (`exit_now_if_lost`, registered after JAX's own exit hook so it runs
first); the chief lingers a few seconds there, because it hosts the coordination service the
other survivors still need to name the lost worker. A worker whose `fit`/`evaluate`/`predict`
raised for its own reasons (`failed`, e.g. an exception in a callback) also leaves without the
barrier, so its peers' next collective fails at once and they name it.

Example (an error that reads like a lost peer, and one that does not):

>>> [looks_like_lost_peer(error) for error in (RuntimeError("Gloo: Connection reset by peer"),
...                                            ValueError("Incompatible shapes"))]
[True, False]
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from keras_mwms.backends.faults import POLL_SECONDS, Faults, bounded
from keras_mwms.diagnostics import LEDGER
from keras_mwms.errors import WorkerLostError
from keras_mwms.log import get_logger

logger = get_logger(__name__)

LOST_WORKER_EXIT_CODE = 3
CHIEF_LINGER_SECONDS = 6.0
# Leaving (`JaxFaults.leave_together`): each worker's key, its values, and how often a worker
# that waits for a peer still at work says so.
LEAVING_KEY = "keras_mwms/leaving/"
IDENTITY_KEY = "keras_mwms/identity/"   # + index: each worker's host and pid, set at start-up
DONE, FAILED = "done", "failed"
LEAVING_NOTICE_SECONDS = 30.0
# A worker whose fit raised but whose script went on to end by itself (it caught the error,
# maybe `sys.exit(3)`): this long for every peer to end its script too, so that all leave
# together with the script's own exit status; a peer still at work after it is left at once.
RECOVERED_LEAVING_SECONDS = 10.0
_LOST_PEER_WORDS = ("Gloo", "gloo", "Connection reset", "connection", "Connection closed", "UNAVAILABLE",
                    "heartbeat", "Socket", "socket", "DEADLINE_EXCEEDED", "Broken pipe", "peer")


def looks_like_lost_peer(error: BaseException) -> bool:
    """True when a JAX runtime error reads like a dead or unreachable peer (jaxlib has no type for it)."""
    text = str(error)
    return any(word in text for word in _LOST_PEER_WORDS)


def coordination_client() -> Any:
    """The `jax.distributed` coordination-service client of this process."""
    from jax._src import distributed

    return distributed.global_state.client


class JaxFaults(Faults):
    """Names the peers behind a failed collective and ends this worker without JAX's shutdown hang.

    Held by `JaxBackend` as `backend.faults`; `backend` offers `num_workers`, `worker_index`,
    `is_chief`, `collective_timeout_seconds` and `worker_lost(where, error, lost_ranks)`.
    """

    window_seconds = 5.0
    missing_are_lost = False   # a peer is lost when its process is gone or JAX no longer lists it

    def __init__(self, backend: Any):
        super().__init__(backend)
        self.peers: dict[int, dict] = {}
        self.lost = False
        self.failed: str | None = None   # "<Error> in model.fit" when the user's call raised here
        self.left: bool | None = None    # `leave_together`'s answer, once asked

    # -- start-up --------------------------------------------------------------------------
    def publish_identity(self) -> None:
        """Shares (host, pid) of every worker, so a lost local peer can be named at once."""
        client = coordination_client()
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        client.key_value_set(f"{IDENTITY_KEY}{self.backend.worker_index}", json.dumps(me))
        timeout_ms = int(self.backend.collective_timeout_seconds * 1000)
        for index in range(self.backend.num_workers):
            text = client.blocking_key_value_get(f"{IDENTITY_KEY}{index}", timeout_ms)
            self.peers[index] = json.loads(text)

    # -- failures --------------------------------------------------------------------------
    def guard(self, where: str, call: Callable[[], Any]) -> Any:
        """`call()`; a failure caused by a lost peer becomes `WorkerLostError` naming it."""
        with LEDGER.collective(where), self.guarded(where):   # one collective: counted by the ledger
            return call()

    @contextlib.contextmanager
    def running_user_code(self, where: str) -> Iterator[None]:
        """Context of a `fit`/`evaluate`/`predict`: a lost peer becomes `WorkerLostError`; any
        other exception marks this worker as failed, so its interpreter exit skips JAX's
        shutdown barrier and the peers learn at once which worker is gone. A later call that
        ends cleanly (the caller handled the error) clears the mark."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - jaxlib's runtime errors have no stable public type
            self.check(error, where)
            if self.backend.num_workers > 1 and not isinstance(error, WorkerLostError):
                self.failed = f"{type(error).__name__} in {where}"
            raise
        self.failed = None

    # -- the hook --------------------------------------------------------------------------
    def is_lost_peer(self, error: BaseException) -> bool:
        return looks_like_lost_peer(error)

    def check_in(self, key: str) -> None:
        """Bounded: a coordination service that does not answer leaves the peers to `gone`."""
        bounded(lambda: coordination_client().key_value_set(key, "1", allow_overwrite=True), 2.0)

    def checked_in(self, keys: list[str]) -> set[str]:
        found: set[str] = set()

        def ask():
            client = coordination_client()
            for key in keys:
                try:
                    if client.key_value_try_get(key):
                        found.add(key)
                except Exception:  # noqa: BLE001 - "not found" is an exception in jaxlib
                    pass

        bounded(ask, 2.0)
        return found

    def gone(self, ranks: list[int]) -> list[int]:
        """Local peers whose process is gone; the chief, when it is remote and the coordination
        service it hosts no longer answers.

        JAX cannot tell quickly whether another remote peer died: its service learns of a death
        only after the heartbeat timeout (`engine.heartbeat_timeout_seconds`), and its
        `get_live_nodes` is a barrier of the listed tasks (each must call it, the caller too).
        Such a peer is not named here: the hang report names it (a partition or a stopped peer:
        "no answer"), its threshold kept below JAX's heartbeat timeout, whose abort would end
        the job natively (`JaxEngine.native_abort_seconds`).
        """
        here = socket.gethostname()
        ranks = [rank for rank in ranks if rank in self.peers]
        dead = [rank for rank in ranks if self.peers[rank].get("host") == here
                and not process_alive(int(self.peers[rank]["pid"]))]
        if 0 in ranks and self.peers[0].get("host") != here and not self._coordinator_answers():
            dead.append(0)
        return sorted(dead)

    @staticmethod
    def _coordinator_answers() -> bool:
        """Whether the coordination service (in the chief) answers a read within 5 s."""
        answered: list[bool] = []

        def ask():
            try:
                coordination_client().key_value_try_get(f"{IDENTITY_KEY}0")   # set at start-up
                answered.append(True)
            except Exception:  # noqa: BLE001 - an unreachable coordinator means the chief is gone
                pass

        bounded(ask, 5.0)
        return bool(answered)

    def abandon(self) -> None:
        self.lost = True

    # -- exit ------------------------------------------------------------------------------
    def exit_now_if_lost(self) -> None:
        """Interpreter exit hook: leaves without JAX's shutdown barrier after a lost peer or a
        failure here; otherwise waits until every worker has finished its script
        (`leave_together`), so that barrier never times out on a worker still at work."""
        if not self.lost and self.failed is not None and (
                _ended_by_uncaught_exception() or not self._all_leave_within(RECOVERED_LEAVING_SECONDS)):
            # fit/evaluate/predict raised here (e.g. in a callback) and the script died of it, or
            # went on while its peers did not end: JAX's shutdown barrier would hold this exit
            # ~20 s while the peers wait in their next collective and then abort without a name.
            # Leaving now closes the gloo connections, so every peer raises WorkerLostError
            # naming this worker at once. (A script that caught the error and ended, its peers
            # too, leaves below with its own exit status: `sys.exit(3)` stays 3.)
            logger.error(f"keras_mwms: worker {self.backend.worker_index} exits without JAX's shutdown "
                         f"barrier after {self.failed}")
            self._announce_leaving(FAILED)
            _exit(1)
        if self.lost:
            if self.backend.is_chief:
                # The chief hosts JAX's coordination service; leaving at once would make the other
                # survivors abort inside JAX before they could name the lost worker.
                time.sleep(CHIEF_LINGER_SECONDS)
            _exit(LOST_WORKER_EXIT_CODE)
        if not self.leave_together():
            _exit(0)   # a peer ended without the barrier: JAX's would wait for it, then abort

    def leave_together(self) -> bool:
        """Marks this worker as leaving and waits until every other worker has too; True then,
        False when a peer ended without JAX's shutdown barrier (then this worker must skip it).

        Called once, before `jax.distributed.shutdown()` (`strategy.close()`, or the interpreter's
        exit). That barrier gives the workers `SHUTDOWN_TIMEOUT_SECONDS` to arrive, so a worker
        still at work after its last collective (the chief saving the model) was aborted
        (SIGABRT) mid-save when the others had finished earlier. The wait has no deadline, as on
        TensorFlow and torch, where a worker that finished leaves and the others go on: a peer
        that dies ends it (a local one at once; the chief aborts the others through JAX at once;
        a remote one after the heartbeat timeout), and it says every `LEAVING_NOTICE_SECONDS`
        whom it waits for.
        """
        if self.left is None:
            self.left = self._wait_for_peers_to_leave()
        return self.left

    def _all_leave_within(self, seconds: float) -> bool:
        """`leave_together`, bounded: True when every peer ended its script within `seconds`."""
        if self.left is None:
            self.left = self._wait_for_peers_to_leave(deadline=time.monotonic() + seconds)
        return bool(self.left)

    def _wait_for_peers_to_leave(self, deadline: float | None = None) -> bool | None:
        """`leave_together`'s wait, done once; None when `deadline` passed first."""
        client = coordination_client()
        if not self.peers or self.lost or client is None:   # None: jax.distributed shut down already
            return True
        me = self.backend.worker_index
        self._announce_leaving(DONE)
        started = time.monotonic()
        notice = started + LEAVING_NOTICE_SECONDS
        for rank in (rank for rank in range(self.backend.num_workers) if rank != me):
            while True:
                try:
                    value = client.key_value_try_get(f"{LEAVING_KEY}{rank}")
                except Exception as error:  # noqa: BLE001 - "not found" is an exception in jaxlib
                    if "NOT_FOUND" not in str(error):   # the service is gone: no barrier to pass
                        return False
                    value = None
                if value is not None:
                    if value == FAILED:
                        return False
                    break
                if (self.peers[rank].get("host") == socket.gethostname()
                        and not process_alive(int(self.peers[rank]["pid"]))):
                    logger.error(f"keras_mwms: worker {rank} ended without leaving JAX's cluster; worker "
                                 f"{me} leaves without JAX's shutdown barrier")
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                if time.monotonic() >= notice:
                    logger.warning(f"keras_mwms: worker {me} finished its script and waits for worker "
                                   f"{rank} to finish its own ({time.monotonic() - started:.0f} s so far); "
                                   "JAX's workers leave its cluster together")
                    notice += LEAVING_NOTICE_SECONDS
                time.sleep(POLL_SECONDS)
        return True

    def _announce_leaving(self, value: str) -> None:
        bounded(lambda: coordination_client().key_value_set(
            f"{LEAVING_KEY}{self.backend.worker_index}", value, allow_overwrite=True), 2.0)


def _ended_by_uncaught_exception() -> bool:
    """Whether the script ended with an exception it did not catch (Python printed it and set
    `sys.last_value` before the exit hooks; `sys.exit(n)` sets nothing)."""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def process_alive(pid: int) -> bool:
    """True if `pid` runs on this host and is not a zombie.

    Example:

    >>> process_alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
