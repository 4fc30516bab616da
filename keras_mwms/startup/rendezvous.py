"""Pre-flight rendezvous: every worker meets every other before any backend engine starts.

Backends fail badly when a peer is missing or configured differently: TensorFlow waits
forever, JAX aborts the process after minutes, torch times out with a store error. So before a
backend binds anything, keras_mwms runs this small, bounded handshake over plain TCP:

* Every member of the collective group listens on its own `TF_CONFIG` address and connects to
  every other member's address (retrying until the deadline). Both ends of each connection
  send a one-line JSON *hello*: the task's name and index, the address it believes it has, and
  a *fingerprint* (the ordered cluster, keras_mwms / Keras / backend versions, backend name,
  collective choice).
* The hello also carries the worker's *identity*: its host and the GPUs it trains on (UUIDs
  where the driver names them, `keras_mwms.devices.worker_identity`). These differ per worker,
  so they are not part of the fingerprint; but where the job's collectives are NCCL on GPUs
  (`keras_mwms.backends.policy.exclusive_gpus_reason`), two workers claiming one physical GPU
  fail fast here, naming both workers and the GPU, instead of NCCL's late "Duplicate GPU".
* Each side compares the peer's hello with its own view. Any difference (another cluster order,
  another Keras version, a second process claiming the same index, a peer at an unexpected
  address) fails *fast* on both ends, with a message naming the odd worker and the field.
  A failing worker keeps answering with an `abort` hello until it has told every peer it can
  reach, so the failure spreads in milliseconds instead of waiting for timeouts.
* When a worker has exchanged hellos with every peer in both directions it tells the chief
  it is *ready*; the chief answers every ready worker with *go* once all are ready, or with
  the abort reason if anything failed anywhere. So either every worker starts its backend or
  none does (a duplicate worker that one peer saw late still stops the whole gang). A
  duplicate that arrives only after the verdict fails alone, naming the worker it collides
  with; the gang it missed carries on.
* Then each worker closes its listener: the port is free again for the backend (the
  connecting side always closes first, so `TIME_WAIT` never sits on a listening port).
* A deadline bounds everything: on expiry each worker raises `RendezvousError` naming the
  tasks it never heard from and their addresses.

The handshake is plain Python (no ML backend needed) and single-worker jobs skip it.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keras_mwms import settings
from keras_mwms.errors import RendezvousError
from keras_mwms.startup.cluster import split_address

PROTOCOL = "keras_mwms-rendezvous/1"
DEFAULT_TIMEOUT_SECONDS = settings.RENDEZVOUS_TIMEOUT.default
RETRY_INTERVAL_SECONDS = 0.1
SOCKET_TIMEOUT_SECONDS = 5.0
MAX_HELLO_BYTES = 1 << 20
DEFAULT_PORT_ADVICE = ("give this worker a free port in TF_CONFIG (and check that no two workers "
                       "share a task.index).")
DEFAULT_MEMBERS_ADVICE = "Start every worker listed in TF_CONFIG"


@dataclass
class Peer:
    """One member of the collective group as this worker sees it."""

    rank: int
    name: str
    address: str


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    heard_from: set = field(default_factory=set)
    reached: set = field(default_factory=set)
    errors: list = field(default_factory=list)
    abort_told: set = field(default_factory=set)
    ready: dict = field(default_factory=dict)
    # Set once the chief's verdict is "go": from then on this worker starts its backend whatever
    # a late visitor (a duplicate started after the gang met) says, so it records no failure.
    decided: bool = False

    def fail(self, message: str) -> None:
        with self.lock:
            if not self.decided and message not in self.errors:
                self.errors.append(message)

    @property
    def aborted(self) -> bool:
        with self.lock:
            return bool(self.errors)


def _send_line(sock: socket.socket, payload: Mapping[str, Any]) -> None:
    sock.sendall(json.dumps(payload, sort_keys=True).encode() + b"\n")


def _read_line(sock: socket.socket) -> dict[str, Any]:
    buffer = b""
    while b"\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before a full hello arrived")
        buffer += chunk
        if len(buffer) > MAX_HELLO_BYTES:
            raise ConnectionError("hello larger than 1 MiB: not a keras_mwms peer")
    message = json.loads(buffer.split(b"\n", 1)[0])
    if not isinstance(message, dict) or message.get("protocol") != PROTOCOL:
        raise ConnectionError(f"not a {PROTOCOL} peer (got {str(message)[:120]!r})")
    return message


def describe_difference(ours: Mapping[str, Any], theirs: Mapping[str, Any], ours_name: str = "ours",
                        theirs_name: str = "theirs") -> str:
    """Names every fingerprint field that differs, with both values (and whose they are).

    Example:

    >>> describe_difference({"keras": "3.15.1", "backend": "jax"},
    ...                     {"keras": "3.14.0", "backend": "jax"})
    "keras: theirs='3.14.0', ours='3.15.1'"
    >>> describe_difference({"backend": "torch"}, {"backend": "jax"}, "worker:0", "worker:1")
    "backend: worker:1='jax', worker:0='torch'"
    """
    keys = sorted(set(ours) | set(theirs))
    parts = [
        f"{key}: {theirs_name}={theirs.get(key)!r}, {ours_name}={ours.get(key)!r}"
        for key in keys
        if ours.get(key) != theirs.get(key)
    ]
    return "; ".join(parts)


class Rendezvous:
    """One worker's side of the pre-flight handshake; `run()` returns or raises within `timeout`.

    Example (a one-worker group meets itself at once):

    >>> Rendezvous(["localhost:0"], rank=0, fingerprint={"backend": "none"}).run()

    Args:
        addresses: `host:port` of every group member in rank order (chief first).
        rank: this worker's position in `addresses`.
        fingerprint: JSON-serialisable facts that must be identical on every worker.
        timeout: seconds before giving up on missing workers (default 120).
        names: display names per rank (default `worker:<rank>`).
        port_advice: how to choose other ports, for the error when this worker's port is
            taken (default: about TF_CONFIG; the orchestrator resolvers give their own).
        identity: this worker's `{"host": ..., "gpus": [GPU identities]}` (default: none).
        exclusive_gpus: why no two workers may share a GPU (the error's explanation and fix),
            or None to allow sharing.
        members_advice: who must start, for the error when a worker never comes (default:
            the workers listed in TF_CONFIG; `keras_mwms.startup.advice` words it per orchestrator).
    """

    def __init__(self, addresses: Sequence[str], rank: int, fingerprint: Mapping[str, Any],
                 timeout: float = DEFAULT_TIMEOUT_SECONDS, names: Sequence[str] | None = None,
                 port_advice: str | None = None, identity: Mapping[str, Any] | None = None,
                 exclusive_gpus: str | None = None, members_advice: str | None = None):
        if timeout <= 0:
            raise ValueError(f"rendezvous timeout must be positive seconds, got {timeout!r}")
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank {rank} is outside 0..{len(addresses) - 1}")
        names = list(names) if names is not None else [f"worker:{i}" for i in range(len(addresses))]
        self.peers = [Peer(i, names[i], address) for i, address in enumerate(addresses)]
        self.me = self.peers[rank]
        self.fingerprint = dict(fingerprint)
        self.timeout = float(timeout)
        self.port_advice = port_advice or DEFAULT_PORT_ADVICE
        self.members_advice = members_advice or DEFAULT_MEMBERS_ADVICE
        self.identity = dict(identity or {})
        self.exclusive_gpus = exclusive_gpus
        self._state = _State()

    def _hello(self) -> dict[str, Any]:
        hello = {
            "protocol": PROTOCOL,
            "kind": "hello",
            "rank": self.me.rank,
            "name": self.me.name,
            "address": self.me.address,
            "fingerprint": self.fingerprint,
            "identity": self.identity,
        }
        if self._state.aborted:
            hello["abort"] = self._state.errors[0]
        return hello

    def _check(self, hello: Mapping[str, Any], expected: Peer | None, seen_as: str) -> int | None:
        """Validates a peer's hello; records a failure and returns None if it is not acceptable."""
        name, rank, address = hello.get("name"), hello.get("rank"), hello.get("address")
        who = f"{name} at {address} ({seen_as})"
        if "abort" in hello:
            if not self._state.aborted:
                # Relay the root cause verbatim, so every worker prints the same sentence.
                self._state.fail(str(hello["abort"]))
            return None
        theirs = hello.get("fingerprint", {})
        difference = describe_difference(self.fingerprint, theirs, self.me.name, str(name))
        if difference:
            # Relayed verbatim to every worker, so it names workers, never "ours" / "theirs".
            backend = ("" if self.fingerprint.get("backend") == theirs.get("backend") else
                       " Set KERAS_BACKEND to the same backend on every worker (where it is unset, "
                       "Keras reads ~/.keras/keras.json).")
            self._state.fail(
                f"{who} is configured differently from {self.me.name} at {self.me.address}: "
                f"{difference}.{backend} Every worker must run the same TF_CONFIG cluster (same "
                "order), the same package versions and the same backend options."
            )
            return None
        if not isinstance(rank, int) or not 0 <= rank < len(self.peers):
            self._state.fail(f"{who} sent an invalid rank {rank!r}.")
            return None
        if rank == self.me.rank:
            self._state.fail(
                f"Two processes claim {self.me.name} ({self.me.address}): this one and {who}. "
                "Give each worker its own task.index in TF_CONFIG."
            )
            return None
        if expected is not None and rank != expected.rank:
            self._state.fail(
                f"{self.me.name} expected {expected.name} at {expected.address} but found {who}. "
                "Check every worker's task.index and that the address list is identical everywhere."
            )
            return None
        shared = self._shared_gpus(hello.get("identity"))
        if shared:
            theirs = hello.get("identity") or {}
            self._state.fail(
                f"{self.me.name} at {self.me.address} (host {self.identity.get('host')}) and "
                f"{name} at {address} (host {theirs.get('host')}) both train on GPU "
                f"{', '.join(shared)}. {self.exclusive_gpus}"
            )
            return None
        return rank

    def _shared_gpus(self, theirs: Any) -> list[str]:
        """The GPUs this worker and a peer both claim, where the job forbids sharing."""
        if not self.exclusive_gpus or not isinstance(theirs, Mapping):
            return []
        their_gpus = set(theirs.get("gpus") or [])
        return [gpu for gpu in self.identity.get("gpus", []) if gpu in their_gpus]

    # ------------------------------------------------------------------ listening side
    def _serve(self, listener: socket.socket, stop: threading.Event) -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, remote = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection, remote), daemon=True).start()

    def _answer(self, connection: socket.socket, remote: Any) -> None:
        connection.settimeout(SOCKET_TIMEOUT_SECONDS)
        try:
            message = _read_line(connection)
            if message.get("kind") == "ready":
                # Phase 2 (chief only): hold the connection until the chief says go or abort.
                with self._state.lock:
                    self._state.ready[message.get("rank")] = connection
                return
            rank = self._check(message, None, f"connected from {remote[0]}")
            reply = self._hello()
            _send_line(connection, reply)
            # Let the connecting side close first so TIME_WAIT lands on its ephemeral port.
            connection.recv(1)
        except (OSError, ValueError, ConnectionError):
            connection.close()
            return
        connection.close()
        with self._state.lock:
            if rank is not None:
                self._state.heard_from.add(rank)
            if "abort" in reply:
                self._state.abort_told.add(message.get("rank"))

    # ------------------------------------------------------------------ phase 2: go / abort
    def _collect_ready(self, others: Sequence[Peer], deadline: float) -> None:
        """Chief: waits until every peer confirmed it met everyone, or a failure/deadline."""
        while time.monotonic() < deadline and not self._state.aborted:
            with self._state.lock:
                if len(self._state.ready) == len(others):
                    return
            time.sleep(0.02)
        if not self._state.aborted:
            with self._state.lock:
                late = [peer for peer in others if peer.rank not in self._state.ready]
            self._state.fail(
                "the rendezvous deadline passed before "
                + ", ".join(f"{peer.name} ({peer.address})" for peer in late)
                + " confirmed it had met every worker; see their logs."
            )

    def _release_ready(self) -> None:
        """Chief: answers every held confirmation with go (success) or the abort reason."""
        with self._state.lock:
            held = list(self._state.ready.values())
            self._state.ready.clear()
            verdict = ({"kind": "abort", "reason": self._state.errors[0]} if self._state.errors
                       else {"kind": "go"})
            self._state.decided = verdict["kind"] == "go" and len(held) == len(self.peers) - 1
        for connection in held:
            try:
                _send_line(connection, {"protocol": PROTOCOL, **verdict})
                connection.settimeout(2)
                connection.recv(1)
            except OSError:
                pass
            finally:
                connection.close()

    def _await_go(self, deadline: float) -> None:
        """Non-chief: tells the chief it met everyone and waits for the chief's verdict."""
        chief = self.peers[0]
        host, port = split_address(chief.address)
        while time.monotonic() < deadline and not self._state.aborted:
            try:
                with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_SECONDS) as sock:
                    _send_line(sock, {"protocol": PROTOCOL, "kind": "ready", "rank": self.me.rank})
                    sock.settimeout(0.2)
                    buffer = b""
                    while time.monotonic() < deadline and not self._state.aborted:
                        try:
                            chunk = sock.recv(65536)
                        except TimeoutError:
                            continue
                        if not chunk:
                            self._state.fail(f"{chief.name} ({chief.address}) ended the rendezvous "
                                             "without a verdict; see its log.")
                            return
                        buffer += chunk
                        if b"\n" in buffer:
                            verdict = json.loads(buffer.split(b"\n", 1)[0])
                            if verdict.get("kind") != "go":
                                self._state.fail(str(verdict.get("reason", "the chief aborted")))
                            else:
                                with self._state.lock:
                                    self._state.decided = True
                            return
                    break
            except OSError:
                time.sleep(RETRY_INTERVAL_SECONDS)
        if not self._state.aborted:
            self._state.fail(f"no go from {chief.name} ({chief.address}) before the deadline.")

    # ------------------------------------------------------------------ connecting side
    def _greet(self, peer: Peer, deadline: float, spreading: bool = False) -> bool:
        """Exchanges hellos with `peer`; False if it could not be reached before `deadline`."""
        host, port = split_address(peer.address)
        while time.monotonic() < deadline and (spreading or not self._state.aborted):
            try:
                with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_SECONDS) as sock:
                    sock.settimeout(SOCKET_TIMEOUT_SECONDS)
                    sent = self._hello()
                    _send_line(sock, sent)
                    hello = _read_line(sock)
                    if "abort" in sent:
                        with self._state.lock:
                            self._state.abort_told.add(peer.rank)
                    if self._check(hello, peer, f"reached at {peer.address}") is not None:
                        with self._state.lock:
                            self._state.reached.add(peer.rank)
                    return True
            except socket.gaierror as error:
                self._state.fail(
                    f"Cannot resolve the host of {peer.name} ({peer.address}): {error}. "
                    "Fix the host name in TF_CONFIG or the machine's DNS."
                )
                return False
            except (OSError, ConnectionError, ValueError):
                time.sleep(RETRY_INTERVAL_SECONDS)
        return False

    # ------------------------------------------------------------------ binding
    def _listen(self) -> socket.socket:
        host, port = split_address(self.me.address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL:
                # The TF_CONFIG host is not an address of this machine (a service name, NAT):
                # listen on every interface, as the backends themselves do.
                listener.bind(("::" if family == socket.AF_INET6 else "", port))
            elif error.errno == errno.EADDRINUSE:
                listener.close()
                raise self._port_taken_error() from None
            else:
                listener.close()
                raise RendezvousError(
                    f"{self.me.name} cannot listen on its TF_CONFIG address {self.me.address}: "
                    f"{error}. Check that the host name belongs to this machine."
                ) from None
        listener.listen(max(16, 2 * len(self.peers)))
        return listener

    def _port_taken_error(self) -> RendezvousError:
        """Asks whoever holds our port who they are, so a duplicate worker is named as such."""
        host, port = split_address(self.me.address)
        occupant = "another program"
        try:
            with socket.create_connection((host, port), timeout=2) as sock:
                sock.settimeout(2)
                # A plain hello: the occupant's own checks name the conflict on its side.
                _send_line(sock, self._hello())
                reply = _read_line(sock)
                occupant = f"another keras_mwms worker that calls itself {reply.get('name')}"
                if reply.get("name") == self.me.name:
                    occupant += (" too: two processes were given the same place in the cluster (a "
                                 "TF_CONFIG left in the shell is read before torchrun, Slurm or MPI "
                                 "variables: see the cluster source each worker names, or set "
                                 "KERAS_MWMS_CLUSTER_SOURCE)")
                difference = describe_difference(self.fingerprint, reply.get("fingerprint", {}))
                if difference:
                    occupant += f" and is configured differently: {difference}"
        except (OSError, ConnectionError, ValueError):
            pass
        return RendezvousError(
            f"{self.me.name} cannot listen on {self.me.address}: the port is already in use by "
            f"{occupant}. Stop that program, or {self.port_advice}"
        )

    # ------------------------------------------------------------------ main
    def run(self) -> None:
        """Meets every peer or raises `RendezvousError`; returns with the listening port released."""
        others = [peer for peer in self.peers if peer.rank != self.me.rank]
        if not others:
            return
        start = time.monotonic()
        deadline = start + self.timeout
        listener = self._listen()
        stop = threading.Event()
        server = threading.Thread(target=self._serve, args=(listener, stop), daemon=True)
        server.start()
        greeters = [threading.Thread(target=self._greet, args=(peer, deadline), daemon=True)
                    for peer in others]
        try:
            for greeter in greeters:
                greeter.start()
            met_everyone = False
            while time.monotonic() < deadline and not self._state.aborted:
                with self._state.lock:
                    if len(self._state.heard_from) == len(self._state.reached) == len(others):
                        met_everyone = True
                        break
                time.sleep(0.02)
            # Phase 2: nobody starts unless everybody met everybody (a late duplicate or a
            # failure seen by one worker must stop all of them).
            if met_everyone:
                if self.me.rank == 0:
                    self._collect_ready(others, deadline)
                else:
                    self._await_go(deadline)
            if self._state.aborted:
                self._spread_abort(others, min(deadline, time.monotonic() + 3))
        finally:
            # The listening socket closes before the chief says go: a worker that got its go
            # and connects to the engine on the same port (torch's TCPStore) must never land
            # in this listener's queue, where closing it resets the connection.
            stop.set()
            server.join(timeout=2)
            listener.close()
            if self.me.rank == 0:
                self._release_ready()
        self._raise_if_failed(others, time.monotonic() - start)

    def _spread_abort(self, others: Sequence[Peer], until: float) -> None:
        """Tells every peer that has not yet heard our abort, so nobody waits for a timeout."""
        with self._state.lock:
            untold = [peer for peer in others if peer.rank not in self._state.abort_told]
        messengers = [threading.Thread(target=self._greet, args=(peer, until, True), daemon=True)
                      for peer in untold]
        for messenger in messengers:
            messenger.start()
        for messenger in messengers:
            messenger.join(timeout=max(0.0, until - time.monotonic()))

    def _raise_if_failed(self, others: Sequence[Peer], elapsed: float) -> None:
        with self._state.lock:
            errors = list(self._state.errors)
            missing = [peer for peer in others
                       if peer.rank not in self._state.heard_from or peer.rank not in self._state.reached]
        if errors:
            raise RendezvousError(f"{self.me.name}: rendezvous failed: " + " | ".join(errors))
        if missing:
            listing = ", ".join(f"{peer.name} ({peer.address})" for peer in missing)
            raise RendezvousError(
                f"{self.me.name} ({self.me.address}) gave up after {elapsed:.0f} s waiting for "
                f"{listing}. {self.members_advice} within the timeout, check "
                "that their host:port is reachable from here (firewalls), or raise the timeout "
                "(CommunicationOptions(rendezvous_timeout_seconds=...) or "
                "KERAS_MWMS_RENDEZVOUS_TIMEOUT)."
            )
