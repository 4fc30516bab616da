"""`TorchrunClusterResolver`: the cluster of a torchrun, Kubeflow PyTorchJob or Lightning job.

Those launchers export `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (torchrun adds
`LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`; Lightning `NODE_RANK`). torchrun's own store
already listens on `MASTER_PORT`, so keras_mwms takes the ports after it:

    worker of local rank L listens on MASTER_PORT + 1 + L

so the chief's address, where the rendezvous and the backend's coordinator meet, is
`MASTER_ADDR:MASTER_PORT+1`. Hosts: on one node (`LOCAL_WORLD_SIZE == WORLD_SIZE`) every worker
is on `MASTER_ADDR`; across nodes they are `KERAS_MWMS_HOSTS` (one name per node, in node-rank
order) when set, else each worker publishes the address it reaches `MASTER_ADDR` from through
torch's `TCPStore` on `MASTER_PORT` (torchrun's agent store, or one rank 0 opens for a
PyTorchJob, or the store of the process group Ray's TorchTrainer already started), bounded by the
rendezvous timeout.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence

from keras_mwms import settings
from keras_mwms.resolvers.environment import (
    EnvironmentClusterResolver,
    addresses_by_rank,
    check_ports,
    environment_error,
    read_int,
)

HOSTS_ENV = settings.HOSTS.name
_LAUNCH = "Start the script with torchrun (e.g. `torchrun --nproc-per-node 2 train.py`) or a PyTorchJob."


class TorchrunClusterResolver(EnvironmentClusterResolver):
    """The cluster of a job started by torchrun, a Kubeflow PyTorchJob or Lightning.

    `keras_mwms.MultiWorkerMirroredStrategy()` picks it by itself when `WORLD_SIZE` and
    `MASTER_ADDR` are set (and no `TF_CONFIG` or Slurm step is).

    Example:

    >>> env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    ...        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    >>> resolver = TorchrunClusterResolver(environ=env)
    >>> resolver.cluster_spec().as_dict(), resolver.task_id, resolver.local_rank
    ({'worker': ['127.0.0.1:29501', '127.0.0.1:29502']}, 1, 1)

    Args:
        hosts: one host name per node, in node-rank order (default `KERAS_MWMS_HOSTS`, else
            `MASTER_ADDR` on one node, else exchanged through torch's store).
        rpc_layer: protocol prefix of `master()`. Default none.
        timeout: seconds to wait for the other workers' hosts when they are exchanged.
        environ: the variables to read instead of `os.environ` (for tests and tools).
    """

    restart_advice = "Restart it (torchrun --max-restarts N restarts its workers)"

    def __init__(self, hosts: Sequence[str] | None = None, rpc_layer: str | None = None,
                 timeout: float | None = None, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        world_size = read_int(environ, "WORLD_SIZE", "It is the job's process count. " + _LAUNCH,
                              minimum=1, required=True)
        local_rank = read_int(environ, "LOCAL_RANK", "It is this process's index on its node.",
                              maximum=world_size - 1) or 0
        local_size = read_int(environ, "LOCAL_WORLD_SIZE", "It is the process count per node.",
                              minimum=1, maximum=world_size)
        node_variable = "GROUP_RANK" if "GROUP_RANK" in environ else "NODE_RANK"
        node_rank = read_int(environ, node_variable, "It is this node's index in the job.")
        rank = read_int(environ, "RANK", "It is this process's rank. " + _LAUNCH, maximum=world_size - 1)
        if rank is None:
            if node_rank is None or local_size is None:
                raise environment_error("RANK", None, "", "Set RANK, or NODE_RANK with LOCAL_RANK and "
                                        "LOCAL_WORLD_SIZE. " + _LAUNCH)
            rank = node_rank * local_size + local_rank
        if rank >= world_size:
            raise environment_error("RANK", environ.get("RANK"), f"is not below WORLD_SIZE={world_size}", _LAUNCH)
        if local_size is None:
            local_size = 1  # a PyTorchJob or plain launcher: one process per pod or node
        if local_rank >= local_size:
            raise environment_error("LOCAL_RANK", environ.get("LOCAL_RANK"),
                                    f"is not below LOCAL_WORLD_SIZE={local_size}", _LAUNCH)
        if world_size % local_size:
            raise environment_error("LOCAL_WORLD_SIZE", environ.get("LOCAL_WORLD_SIZE"),
                                    f"does not divide WORLD_SIZE={world_size}",
                                    "Run the same --nproc-per-node on every node.")
        master_host = environ.get("MASTER_ADDR", "").strip()
        if not master_host or any(char.isspace() for char in master_host):
            raise environment_error("MASTER_ADDR", environ.get("MASTER_ADDR"), "is not a host name",
                                    "Set it to the rank-0 node's address. " + _LAUNCH)
        master_port = read_int(environ, "MASTER_PORT", "Set it to a free port on the rank-0 node, e.g. 29500.",
                               minimum=1, maximum=65535) or 29500
        check_ports("MASTER_PORT", environ.get("MASTER_PORT"), master_port + 1, local_size,
                    f"keras_mwms listens on MASTER_PORT+1 .. MASTER_PORT+{local_size}; pick a lower MASTER_PORT.")
        nodes = world_size // local_size
        node_hosts = self._node_hosts(hosts, environ, nodes, master_host, master_port, rank, world_size,
                                      timeout)
        self._set_workers(addresses_by_rank([node_hosts[r // local_size] for r in range(world_size)],
                                            [master_port + 1 + r % local_size for r in range(world_size)]),
                          rank, local_rank, rpc_layer)
        self.port_advice = (f"choose another --master-port: keras_mwms listens on MASTER_PORT+1 .. "
                            f"MASTER_PORT+{local_size} next to torchrun's store on MASTER_PORT.")
        self.source = ("torchrun" if "TORCHELASTIC_RUN_ID" in environ else "torch-style launcher") + \
            f" (RANK/WORLD_SIZE, MASTER_ADDR={master_host}:{master_port})"

    @staticmethod
    def _node_hosts(hosts, environ, nodes, master_host, master_port, rank, world_size, timeout) -> list[str]:
        variable = "hosts"
        if hosts is None and settings.HOSTS.is_set(environ):
            variable, hosts = HOSTS_ENV, [host.strip() for host in settings.HOSTS.read(environ).split(",")]
        if hosts is not None:
            hosts = list(hosts)
            if len(hosts) != nodes or not all(hosts):
                raise environment_error(variable, ",".join(hosts), f"names {len(hosts)} host(s) for {nodes} node(s)",
                                        "Give one host name per node, in node-rank order.")
            return hosts
        if nodes == 1:
            return [master_host]
        if timeout is None:
            timeout = settings.RENDEZVOUS_TIMEOUT.read(environ)
        return _exchange_hosts(master_host, master_port, rank, world_size, nodes,
                              agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                              timeout=timeout)


def own_address(toward: str, port: int) -> str:
    """The local IP address this machine uses to reach `toward` (no packet is sent).

    Example:

    >>> own_address("127.0.0.1", 29500)
    '127.0.0.1'
    """
    family = socket.AF_INET6 if ":" in toward else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((toward, port))
        return probe.getsockname()[0]


def _exchange_hosts(master_host: str, master_port: int, rank: int, world_size: int, nodes: int,
                   agent_store: bool, timeout: float) -> list[str]:
    """Every node's address, in node order, shared through torch's `TCPStore` on `MASTER_PORT`."""
    from datetime import timedelta

    import torch.distributed as dist

    joined = dist.is_available() and dist.is_initialized()
    if joined:
        # Ray's TorchTrainer (or the script) started the process group, whose store holds
        # MASTER_PORT: exchange through that store, which outlives this call.
        store = dist.distributed_c10d._get_default_store()
    else:
        store = dist.TCPStore(master_host, master_port, world_size, is_master=rank == 0 and not agent_store,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False)
    local_size = world_size // nodes
    prefix = "keras_mwms/hosts/"
    if rank % local_size == 0:
        address = own_address(master_host, master_port)
        if address.startswith("127.") or address == "::1":
            # The master node itself (MASTER_ADDR=localhost in some operators): its host name is
            # what the other nodes can resolve (a PyTorchJob gives each pod a service of that name).
            address = socket.gethostname()
        store.set(f"{prefix}{rank // local_size}", address)
    keys = [f"{prefix}{node}" for node in range(nodes)]
    store.wait(keys, timedelta(seconds=timeout))
    found = [store.get(key).decode() for key in keys]
    store.add(f"{prefix}done", 1)
    if rank == 0 and not agent_store and not joined:
        # The store dies with this object: keep it until every rank has read.
        deadline = time.monotonic() + timeout
        while store.add(f"{prefix}done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    return found
