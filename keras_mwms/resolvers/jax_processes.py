"""`JaxClusterResolver`: the cluster of `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID` / `JAX_COORDINATOR_ADDRESS`.

Kubeflow Trainer v2's JAX runtime (one pod per process) sets only these three variables, the
ones `jax.distributed.initialize()` reads. They describe a cluster whatever the Keras backend:
process `JAX_PROCESS_ID` of `JAX_NUM_PROCESSES`, rank 0 at `JAX_COORDINATOR_ADDRESS`. The other
processes' hosts are `KERAS_MWMS_HOSTS` (one name per node, ranks placed by block) when set,
else each process reports its own to rank 0 at the coordinator's address
(`keras_mwms.resolvers.exchange`). Ports follow the coordinator's:

    the k-th process on a host listens on JAX_COORDINATOR_PORT + k

so rank 0 is the coordinator itself: the rendezvous meets there, then the JAX backend starts
`jax.distributed` right at `JAX_COORDINATOR_ADDRESS`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from keras_mwms import settings
from keras_mwms.resolvers.environment import (
    EnvironmentClusterResolver,
    addresses_by_rank,
    check_ports,
    environment_error,
    read_int,
)
from keras_mwms.resolvers.exchange import exchange_hosts
from keras_mwms.resolvers.hostlist import given_hosts, nodes_share
from keras_mwms.startup.cluster import split_address

HOSTS_ENV = settings.HOSTS.name
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
_LAUNCH = ("Set JAX_NUM_PROCESSES, JAX_PROCESS_ID and JAX_COORDINATOR_ADDRESS (host:port of process 0) "
           "on every process, as Kubeflow Trainer's JAX runtime does.")


def read_coordinator(environ: Mapping[str, str]) -> tuple[str, int]:
    """`(host, port)` of `JAX_COORDINATOR_ADDRESS`, or `ClusterEnvironmentError` naming it.

    Example:

    >>> read_coordinator({"JAX_COORDINATOR_ADDRESS": "trainjob-node-0-0.trainjob:6666"})
    ('trainjob-node-0-0.trainjob', 6666)
    """
    text = environ.get(COORDINATOR_ENV)
    if text is None or not text.strip():
        raise environment_error(COORDINATOR_ENV, None, "", _LAUNCH)
    try:
        return split_address(text.strip())
    except ValueError as error:
        raise environment_error(COORDINATOR_ENV, text, f"is not host:port ({error})",
                                "Write it as host:port, e.g. trainjob-node-0-0.trainjob:6666.") from None


class JaxClusterResolver(EnvironmentClusterResolver):
    """The cluster of a job started with JAX's variables (Kubeflow Trainer's JAX runtime), any backend.

    `keras_mwms.MultiWorkerMirroredStrategy()` picks it by itself when `JAX_NUM_PROCESSES` is set
    (and no TF_CONFIG, Slurm step, torchrun or MPI variables are).

    Example:

    >>> env = {"JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3", "JAX_COORDINATOR_ADDRESS": "n1:6666"}
    >>> resolver = JaxClusterResolver(hosts="n[1-2]", environ=env)
    >>> resolver.cluster_spec().as_dict(), resolver.task_id, resolver.local_rank
    ({'worker': ['n1:6666', 'n1:6667', 'n2:6666', 'n2:6667']}, 3, 1)

    Args:
        hosts: the nodes in order, a list or a `host1,host2` / `node[1-4]` string (ranks placed
            by block). Default `KERAS_MWMS_HOSTS`, else each process reports its host to
            process 0 at the coordinator's address.
        rpc_layer: protocol prefix of `master()`. Default none.
        timeout: seconds to wait for every process's host. Default the rendezvous timeout.
        environ: the variables to read instead of `os.environ` (for tests and tools).
    """

    restart_advice = "Restart every process (a TrainJob restarts its pods per its restart policy)"

    def __init__(self, hosts: str | Sequence[str] | None = None, rpc_layer: str | None = None,
                 timeout: float | None = None, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        size = read_int(environ, "JAX_NUM_PROCESSES", "It is the job's process count. " + _LAUNCH,
                        minimum=1, required=True)
        rank = read_int(environ, "JAX_PROCESS_ID", f"It is this process's index in 0..{size - 1}. " + _LAUNCH,
                        maximum=size - 1, required=True)
        coordinator_host, coordinator_port = read_coordinator(environ)
        hosts_variable, hosts = given_hosts(hosts, environ, settings.HOSTS)
        if hosts is not None:
            per_node = nodes_share(hosts, size, hosts_variable, "processes")
            rank_hosts = [hosts[index // per_node] for index in range(size)]
            local_ranks = [index % per_node for index in range(size)]
        else:
            if timeout is None:
                timeout = settings.RENDEZVOUS_TIMEOUT.read(environ)
            rank_hosts = exchange_hosts(coordinator_host, coordinator_port, rank, size, timeout,
                                        f"{COORDINATOR_ENV}={environ[COORDINATOR_ENV].strip()}")
            local_ranks = [rank_hosts[:index].count(host) for index, host in enumerate(rank_hosts)]
        # Process 0 is the coordinator, whatever KERAS_MWMS_HOSTS calls its node.
        rank_hosts[0] = coordinator_host
        check_ports(COORDINATOR_ENV, environ[COORDINATOR_ENV], coordinator_port, max(local_ranks) + 1,
                    "keras_mwms listens on the coordinator's port and the next ones, one per process "
                    "on a host; pick a lower port.")
        self._set_workers(addresses_by_rank(rank_hosts, [coordinator_port + local for local in local_ranks]),
                          rank, local_ranks[rank], rpc_layer)
        self.port_advice = (f"choose another {COORDINATOR_ENV} port: keras_mwms listens on it and the "
                            "next ones, one per process on a host.")
        self.source = (f"JAX variables (JAX_PROCESS_ID/JAX_NUM_PROCESSES, "
                       f"{COORDINATOR_ENV}={environ[COORDINATOR_ENV].strip()})")
