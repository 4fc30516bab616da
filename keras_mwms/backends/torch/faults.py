"""torch's hook for lost workers (the flow is `keras_mwms.backends.faults`).

gloo and nccl report a dead or hung peer as a `RuntimeError` (or `ValueError`) of the
collective (a reset connection, a timeout), without saying which peer. The survivors then check
in on the chief's TCPStore for `window_seconds`; whoever does not is reported lost (the chief
itself when its store is unreachable). The process group is then torn down, waiting at most
`TEARDOWN_SECONDS`: a worker never hangs on a dead peer.

Example:

>>> looks_like_collective_failure(RuntimeError("[gloo] Connection reset by peer"))
True
>>> looks_like_collective_failure(ValueError("shapes (3,) and (4,) differ"))
False
"""

from __future__ import annotations

import datetime

from keras_mwms.backends.faults import Faults

# How long a lost worker waits for its process group's teardown before going on.
TEARDOWN_SECONDS = 5.0
_MARKERS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "distbackend",
            "broken pipe", "store", "closed")


def looks_like_collective_failure(error: BaseException) -> bool:
    """Whether `error`, raised by a torch collective, says a peer or the network failed."""
    text = f"{type(error).__name__} {error}".lower()
    return any(marker in text for marker in _MARKERS)


class TorchFaults(Faults):
    """Lost peers of a torch process group, found on its TCPStore (held as `engine.faults`)."""

    window_seconds = 3.0

    def is_lost_peer(self, error: BaseException) -> bool:
        return (self.backend.distributed and isinstance(error, (RuntimeError, ValueError))
                and looks_like_collective_failure(error))

    def check_in(self, key: str) -> None:
        store = _store()
        store.set_timeout(datetime.timedelta(seconds=self.window_seconds))
        store.set(key, "1")

    def checked_in(self, keys: list[str]) -> set[str]:
        store = _store()
        return {key for key in keys if store.check([key])}

    def abandon(self) -> None:
        self.backend.abandon()


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
