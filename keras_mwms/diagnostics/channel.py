"""The side channel: small UDP datagrams that do not depend on the (possibly stuck) engine.

A worker listens on UDP at its own `TF_CONFIG` host and port number: the collective engines
use TCP (TF's gRPC, gloo, torch's store, JAX's coordinator), and UDP has its own port space,
so the address every worker already knows for every peer serves without a new setting. The
launcher, when it runs the gang, listens on a UDP port of its own and tells the workers
through `KERAS_MWMS_DIAGNOSTICS_ADDRESS`. Messages are JSON dicts, zlib-compressed, one per
datagram (at most `MAX_DATAGRAM` bytes; a report's stacks are cut to fit).

Example:

>>> first, second = Channel("127.0.0.1", 0), Channel("127.0.0.1", 0)
>>> first.send({"type": "ping"}, second.address)
True
>>> second.receive(timeout=2.0)
[{'type': 'ping'}]
>>> first.close(); second.close()
"""

from __future__ import annotations

import json
import select
import socket
import zlib

from keras_mwms import settings
from keras_mwms.startup.cluster import split_address

MAX_DATAGRAM = 60000
LAUNCHER_ADDRESS_ENV = settings.DIAGNOSTICS_ADDRESS.name


def encode(message: dict) -> bytes:
    """One datagram: compressed JSON; stacks and entries are shortened until it fits.

    Example:

    >>> len(encode({"stack": ["x" * 100000]})) <= MAX_DATAGRAM
    True
    """
    data = zlib.compress(json.dumps(message).encode())
    keep = 40
    while len(data) > MAX_DATAGRAM and keep > 0:
        keep //= 2
        message = dict(message)
        for key in ("stack", "data_stack"):
            if message.get(key):
                message[key] = [frame[-2000:] for frame in message[key][-keep:]] if keep else []
        data = zlib.compress(json.dumps(message).encode())
    return data


def decode(data: bytes) -> dict | None:
    """The message in a datagram, or None for anything that is not one of ours.

    Example:

    >>> decode(encode({"type": "ping"})), decode(b"garbage")
    ({'type': 'ping'}, None)
    """
    try:
        message = json.loads(zlib.decompress(data))
    except (zlib.error, ValueError):
        return None
    return message if isinstance(message, dict) else None


def resolve(address: str) -> tuple[str, int] | None:
    """`host:port` → an IPv4 UDP destination, or None when the host does not resolve.

    Example:

    >>> resolve("127.0.0.1:5")
    ('127.0.0.1', 5)
    """
    try:
        host, port = split_address(address)
        info = socket.getaddrinfo(host.strip("[]"), port, socket.AF_INET, socket.SOCK_DGRAM)
    except (OSError, ValueError):
        return None
    return info[0][4][:2] if info else None


class Channel:
    """One UDP socket bound at `host:port` (port 0: any free one).

    Args:
        host: the address to listen on (a worker's TF_CONFIG host; "0.0.0.0" for all).
        port: the UDP port.
    """

    def __init__(self, host: str, port: int):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict, destination: tuple[str, int] | None) -> bool:
        """Sends `message`; False when it could not (no destination, a full buffer, a closed port)."""
        if destination is None:
            return False
        try:
            self.sock.sendto(encode(message), destination)
            return True
        except OSError:
            return False

    def receive(self, timeout: float = 0.0) -> list[dict]:
        """Every message waiting now, or the first to arrive within `timeout` seconds."""
        messages: list[dict] = []
        readable, _, _ = select.select([self.sock], [], [], timeout)
        while readable:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, OSError):
                break
            message = decode(data)
            if message is not None:
                messages.append(message)
        return messages

    def close(self) -> None:
        self.sock.close()
