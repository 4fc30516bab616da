"""How many compute threads each worker uses: the host's cores split among its workers.

Two workers that each run one thread per core oversubscribe the host, and synchronous training
waits for the slowest: torch under `srun` or `mpirun` ran 40-100x slower than under the
launcher on a 16-core host. The split therefore counts the workers on this host from the
cluster itself (the addresses that share this worker's host), whatever started them: the
launcher, a Slurm step, MPI, torchrun or a `TF_CONFIG` with several local addresses. A thread
variable the user set (`OMP_NUM_THREADS`) wins and nothing is said; otherwise the chief says
once what was chosen. The launcher exports the same split as `OMP_NUM_THREADS` before its
workers start (`CHOSEN_ENV` tells them it was not the user's), so OpenMP and BLAS start with it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping, Sequence

from keras_mwms import settings
from keras_mwms.startup.cluster import split_address

USER_THREADS_ENV = "OMP_NUM_THREADS"
CHOSEN_ENV = settings.THREADS_CHOSEN.name


def _host_key(address: str) -> str:
    host = split_address(address)[0].lower()
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "localhost"
    except ValueError:
        pass
    return "localhost" if host in ("localhost", "localhost.localdomain") else host


def local_workers(addresses: Sequence[str], index: int) -> int:
    """How many of the cluster's workers share worker `index`'s host (itself included).

    Example:

    >>> local_workers(["localhost:1", "127.0.0.1:2", "node2:1"], 0), local_workers(["node1:1", "node2:1"], 1)
    (2, 1)
    """
    if not addresses:
        return 1
    own = _host_key(addresses[index])
    return sum(_host_key(address) == own for address in addresses)


@dataclasses.dataclass(frozen=True)
class ThreadSplit:
    """This worker's share of the host: `threads` is None when the user chose the threads or
    the worker is alone on its host (the backend's own default then stays, as in plain Keras).

    Example:

    >>> print(ThreadSplit(local_workers=2, cores=16, threads=8).announcement())
    keras_mwms: 2 workers share this host's 16 cores: 8 compute threads each (set OMP_NUM_THREADS to choose)
    """

    local_workers: int
    cores: int
    threads: int | None

    def announcement(self) -> str | None:
        """The chief's one line about the split, or None when there is nothing to say."""
        if self.threads is None:
            return None
        return (f"keras_mwms: {self.local_workers} workers share this host's {self.cores} cores: "
                f"{self.threads} compute thread{'s' if self.threads > 1 else ''} each "
                f"(set {USER_THREADS_ENV} to choose)")


def plan(addresses: Sequence[str], index: int, environ: Mapping[str, str] | None = None,
         cores: int | None = None) -> ThreadSplit:
    """The split for worker `index` of the cluster at `addresses`.

    Example:

    >>> plan(["localhost:1", "localhost:2"], 1, environ={}, cores=16).threads
    8
    >>> plan(["localhost:1", "localhost:2"], 1, environ={"OMP_NUM_THREADS": "3"}, cores=16).threads is None
    True
    >>> plan(["node1:1", "node2:1"], 0, environ={}, cores=16).threads is None
    True
    """
    environ = os.environ if environ is None else environ
    count = local_workers(addresses, index)
    cores = cores or os.cpu_count() or 1
    user_set = USER_THREADS_ENV in environ and settings.THREADS_CHOSEN.text(environ) != environ[USER_THREADS_ENV]
    return ThreadSplit(local_workers=count, cores=cores,
                       threads=None if user_set or count < 2 else max(1, cores // count))
