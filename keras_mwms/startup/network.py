"""Which local interface and socket a collective engine should use for a `TF_CONFIG` host.

Engines left to themselves pick an address from the machine's host name (often a loopback
entry in `/etc/hosts`, which a peer on another machine cannot reach) and listen on every
interface. These helpers let a backend bind the worker's own `TF_CONFIG` address instead,
where the engine allows it. Linux only; elsewhere they answer `None` and the engine's default
applies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def local_addresses(host: str) -> list[str]:
    """The IP addresses `host` resolves to (no brackets); [] if it does not resolve.

    Example:

    >>> local_addresses("127.0.0.1")
    ['127.0.0.1']
    """
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0].split("%")[0] for info in infos))


def _ipv4_interfaces() -> dict[str, str]:
    found = {}
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found.setdefault(socket.inet_ntoa(reply[20:24]), name)
    return found


def _ipv6_interfaces() -> dict[str, str]:
    found = {}
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if len(fields) >= 6:
                found.setdefault(str(ipaddress.IPv6Address(int(fields[0], 16))), fields[5])
    return found


def interface_of(host: str) -> str | None:
    """The name of the local network interface holding `host`'s address, or None.

    None when `host` does not resolve, is not an address of this machine (NAT, a service
    name), or the platform cannot list interfaces.

    Example:

    >>> interface_of("127.0.0.1")
    'lo'
    """
    try:
        interfaces = {**_ipv4_interfaces(), **_ipv6_interfaces()}
    except (OSError, AttributeError):  # no if_nameindex or no fcntl ioctl on this platform
        return None
    for address in local_addresses(host):
        if address in interfaces:
            return interfaces[address]
    return None


def listen_on(host: str, port: int) -> socket.socket | None:
    """A TCP socket listening on `host:port` only, or None if `host` is not local here.

    Uses `SO_REUSEADDR`, as the engines do, so a port the rendezvous just released (in
    TIME_WAIT) can be bound again. Other errors (the port taken) are raised.

    Example:

    >>> listener = listen_on("127.0.0.1", 0)
    >>> listener.getsockname()[0]
    '127.0.0.1'
    >>> listener.close()
    """
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        if isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
            return None
        raise
    listener.listen(128)
    return listener


def wait_until_accepting(host: str, port: int, timeout: float, interval: float = 0.05) -> bool:
    """Polls `host:port` with plain TCP connects until one succeeds; False after `timeout` s.

    A client engine started before its server listens (torch's TCPStore) logs a warning with a
    C++ stack trace on every retry; waiting here first keeps worker logs clean. The probe
    connection is closed at once without sending anything, which servers ignore.

    Example:

    >>> with socket.socket() as server:
    ...     server.bind(("127.0.0.1", 0)); server.listen(1)
    ...     wait_until_accepting("127.0.0.1", server.getsockname()[1], timeout=5)
    True
    """
    import time

    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            with socket.create_connection((host.strip("[]"), port), timeout=max(0.1, interval * 20)):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
