"""Host exchange: every worker learns the others' hosts from rank 0, over plain TCP, bounded.

Some launchers tell a process only the job's size, its rank and where rank 0 is: JAX's
`JAX_COORDINATOR_ADDRESS` (Kubeflow Trainer's JAX runtime, one pod per process), Ray Train. The
rendezvous needs every worker's address before it starts, so first:

* rank 0 listens on `host:port` (the coordinator's address);
* every other rank connects (retrying until the deadline) and sends one JSON line
  `{"rank": r, "host": h}`: h is rank 0's host when this machine holds that address, else the
  local address this machine reaches rank 0 from;
* once all ranks have arrived, rank 0 answers each with the hosts in rank order; the workers
  close first, so rank 0's port is free again (no `TIME_WAIT` on it) for the rendezvous.

A rank missing at the deadline fails the exchange on every worker, naming what was missing.
"""

from __future__ import annotations

import json
import socket
import time

from keras_mwms.startup import network
from keras_mwms.startup.cluster import format_address
from keras_mwms.startup.rendezvous import RendezvousError

RETRY_SECONDS = 0.1


def own_host(chief_host: str, chief_port: int) -> str:
    """The name other workers reach this machine by: `chief_host` when it is an address of this
    machine, else the local address of the route toward it.

    Example:

    >>> own_host("127.0.0.1", 1234)
    '127.0.0.1'
    """
    if network.interface_of(chief_host) is not None:
        return chief_host
    family = socket.AF_INET6 if ":" in chief_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((chief_host, chief_port))
        return probe.getsockname()[0]


def exchange_hosts(chief_host: str, chief_port: int, rank: int, world_size: int, timeout: float,
                   what: str) -> list[str]:
    """Every rank's host, in rank order, gathered by rank 0 at `chief_host:chief_port`.

    `what` names the variables that gave the address, for the error at the deadline.

    Example:

    >>> exchange_hosts("127.0.0.1", 0, rank=0, world_size=1, timeout=5, what="test")
    ['127.0.0.1']
    """
    if world_size == 1:
        return [chief_host]
    deadline = time.monotonic() + timeout
    if rank == 0:
        return _gather(chief_host, chief_port, world_size, deadline, what)
    return _ask(chief_host, chief_port, rank, own_host(chief_host, chief_port), deadline, what)


def _gather(host: str, port: int, world_size: int, deadline: float, what: str) -> list[str]:
    listener = network.listen_on(host, port)
    if listener is None:   # a service name or NAT address: listen on every interface
        listener = socket.create_server(("", port))
    hosts: dict[int, str] = {0: host}
    waiting: list[socket.socket] = []
    try:
        while len(hosts) < world_size:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                missing = sorted(set(range(world_size)) - set(hosts))
                raise RendezvousError(
                    f"keras_mwms rank 0: rank(s) {missing} of {world_size} never reported their host at "
                    f"{format_address(host, port)} ({what}). Start every process of the job, "
                    "and check that this port is reachable from the other workers.") from None
            connection.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                hello = json.loads(connection.makefile("rb").readline() or b"{}")
                sender, sender_host = int(hello["rank"]), str(hello["host"])
            except (OSError, ValueError, KeyError, TypeError):
                connection.close()   # a stray client: not a worker
                continue
            if not 0 < sender < world_size or sender in hosts:
                connection.sendall(json.dumps({"error": f"rank {sender} is outside 1..{world_size - 1} or "
                                                        "already reported"}).encode() + b"\n")
                connection.close()
                continue
            hosts[sender] = sender_host
            waiting.append(connection)
        reply = json.dumps({"hosts": [hosts[index] for index in range(world_size)]}).encode() + b"\n"
        for connection in waiting:
            connection.sendall(reply)
        for connection in waiting:   # the worker closes first: wait for its end of file
            connection.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                connection.recv(1)
            except OSError:
                pass
        return [hosts[index] for index in range(world_size)]
    finally:
        for connection in waiting:
            connection.close()
        listener.close()


def _ask(host: str, port: int, rank: int, mine: str, deadline: float, what: str) -> list[str]:
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic())) as peer:
                peer.sendall(json.dumps({"rank": rank, "host": mine}).encode() + b"\n")
                answer = json.loads(peer.makefile("rb").readline() or b"{}")
            if "hosts" in answer:
                return [str(name) for name in answer["hosts"]]
            raise RendezvousError(f"keras_mwms rank {rank}: rank 0 at {format_address(host, port)} "
                                  f"refused this rank: {answer.get('error', 'no answer')} ({what}). Give every "
                                  "process of the job its own rank.")
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"keras_mwms rank {rank}: rank 0 never answered at {format_address(host, port)} "
                    f"({what}). Start rank 0, and check that this address reaches it.") from None
            time.sleep(RETRY_SECONDS)
