"""JAX's hook for lost workers (the flow is `keras_mwms.backends.faults`), and its exit.

A gloo or coordination-service failure says little about *who* failed ("Connection reset by
peer"). At start-up every worker publishes its host and process id through JAX's coordination
service; when a collective fails with an error that looks like a lost peer, the survivors check
in on the coordination service's key-value store, and a peer that has not is lost once JAX
knows it is gone: a local peer whose process is gone, a remote one the coordination service no
longer lists as live (retrying for `window_seconds`).

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

from keras_mwms.backends.faults import Faults, bounded
from keras_mwms.diagnostics import LEDGER
from keras_mwms.errors import WorkerLostError
from keras_mwms.log import get_logger

logger = get_logger(__name__)

LOST_WORKER_EXIT_CODE = 3
CHIEF_LINGER_SECONDS = 6.0
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

    # -- start-up --------------------------------------------------------------------------
    def publish_identity(self) -> None:
        """Shares (host, pid) of every worker, so a lost local peer can be named at once."""
        client = coordination_client()
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        client.key_value_set(f"keras_mwms/identity/{self.backend.worker_index}", json.dumps(me))
        timeout_ms = int(self.backend.collective_timeout_seconds * 1000)
        for index in range(self.backend.num_workers):
            text = client.blocking_key_value_get(f"keras_mwms/identity/{index}", timeout_ms)
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
        """Local peers whose process is gone; remote ones the coordination service no longer lists."""
        here = socket.gethostname()
        ranks = [rank for rank in ranks if rank in self.peers]
        dead = [rank for rank in ranks if self.peers[rank].get("host") == here
                and not process_alive(int(self.peers[rank]["pid"]))]
        remote = [rank for rank in ranks if self.peers[rank].get("host") != here]
        if remote:
            live = self._live_nodes(remote)
            dead += [rank for rank in remote if rank not in live]
        return dead

    def _live_nodes(self, indices: list[int]) -> set[int]:
        result: dict = {}

        def ask():
            try:
                result.update(coordination_client().get_live_nodes(indices))
            except Exception:  # noqa: BLE001 - an unreachable coordinator means the chief is gone
                result["error"] = True

        if not bounded(ask, 5.0) or "error" in result:
            return set(indices) - {0}
        return {int(index) for index in result}

    def abandon(self) -> None:
        self.lost = True

    # -- exit ------------------------------------------------------------------------------
    def exit_now_if_lost(self) -> None:
        """Interpreter exit hook: leaves without JAX's shutdown barrier after a lost peer or a failure here."""
        if not self.lost and self.failed is not None:
            # fit/evaluate/predict raised here (e.g. in a callback) and the caller did not recover:
            # JAX's shutdown barrier would hold this exit ~20 s while the peers wait in their next
            # collective and then abort without a name. Leaving now closes the gloo connections,
            # so every peer raises WorkerLostError naming this worker at once.
            logger.error(f"keras_mwms: worker {self.backend.worker_index} exits without JAX's shutdown "
                         f"barrier after {self.failed}")
            _exit(1)
        if self.lost:
            if self.backend.is_chief:
                # The chief hosts JAX's coordination service; leaving at once would make the other
                # survivors abort inside JAX before they could name the lost worker.
                time.sleep(CHIEF_LINGER_SECONDS)
            _exit(LOST_WORKER_EXIT_CODE)


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
