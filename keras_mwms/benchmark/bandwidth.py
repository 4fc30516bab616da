"""This machine's link bandwidth, and the ring all-reduce lower bound it implies.

Workers on one host talk over loopback TCP (gRPC for TensorFlow, gloo for JAX and torch), so
the "link" is the kernel's loopback path. `loopback_tcp_bandwidth` measures it directly: one
thread streams `total_bytes` through a localhost TCP socket in 1 MiB writes while the caller
reads them into a preallocated buffer; bytes ÷ seconds is the link bandwidth. A ring
all-reduce of S bytes over n workers must send 2(n−1)/n · S bytes through each worker's
link, so it cannot take less than `ring_lower_bound_seconds` (the nccl-tests "bus bandwidth"
convention). `memcpy_bandwidth` (a NumPy copy) is reported beside it as the memory ceiling.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

CHUNK_BYTES = 1024 * 1024


def ring_factor(workers: int) -> float:
    """2(n−1)/n: the share of the message each worker sends (and receives) in a ring all-reduce.

    Example:

    >>> ring_factor(2), ring_factor(4), ring_factor(1)
    (1.0, 1.5, 0.0)
    """
    return 2.0 * (workers - 1) / workers


def ring_lower_bound_seconds(nbytes: int, workers: int, bandwidth: float) -> float:
    """The least time a ring all-reduce of `nbytes` can take at `bandwidth` bytes/s per link.

    Example:

    >>> ring_lower_bound_seconds(1_000_000, 2, 1e9)
    0.001
    """
    return ring_factor(workers) * nbytes / bandwidth


def bus_bandwidth(algorithm_bandwidth: float, workers: int) -> float:
    """nccl-tests' busbw: algbw (bytes ÷ time) × 2(n−1)/n, comparable with the link bandwidth.

    Example:

    >>> bus_bandwidth(2e9, 4)
    3000000000.0
    """
    return algorithm_bandwidth * ring_factor(workers)


def loopback_tcp_bandwidth(total_bytes: int = 256 * 1024 * 1024, host: str = "127.0.0.1") -> float:
    """Bytes per second through one localhost TCP connection (see the module docstring).

    Example:

    >>> loopback_tcp_bandwidth(8 * 1024 * 1024) > 0
    True
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(1)
    listener.settimeout(30)
    payload = memoryview(bytes(CHUNK_BYTES))

    def send() -> None:
        with socket.create_connection(listener.getsockname(), timeout=30) as sender:
            remaining = total_bytes
            while remaining > 0:
                count = min(remaining, CHUNK_BYTES)
                sender.sendall(payload[:count])
                remaining -= count

    sender_thread = threading.Thread(target=send, name="loopback-sender", daemon=True)
    sender_thread.start()
    connection, _ = listener.accept()
    buffer = memoryview(bytearray(CHUNK_BYTES))
    received = 0
    with connection:
        connection.settimeout(30)
        started = time.perf_counter()
        while received < total_bytes:
            count = connection.recv_into(buffer)
            if count == 0:
                break
            received += count
        seconds = time.perf_counter() - started
    sender_thread.join(timeout=30)
    listener.close()
    if received < total_bytes:
        raise RuntimeError(f"loopback probe: received {received} of {total_bytes} bytes on {host}")
    return received / seconds


def memcpy_bandwidth(nbytes: int = 64 * 1024 * 1024, repeats: int = 5) -> float:
    """Bytes per second of a NumPy array copy (best of `repeats`): the memory ceiling.

    Example:

    >>> memcpy_bandwidth(1024 * 1024, repeats=2) > 0
    True
    """
    source = np.ones(nbytes // 4, np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def measure_machine(tcp_bytes: int = 256 * 1024 * 1024, repeats: int = 3) -> dict:
    """The machine's link figures for the report: best loopback TCP and memcpy bandwidth."""
    return {
        "loopback_tcp_bytes_per_second": max(loopback_tcp_bandwidth(tcp_bytes) for _ in range(repeats)),
        "loopback_tcp_probe": f"one localhost TCP stream of {tcp_bytes // (1024 * 1024)} MiB in 1 MiB "
                              f"writes, best of {repeats}",
        "memcpy_bytes_per_second": memcpy_bandwidth(),
        "memcpy_probe": "numpy copy of 64 MiB float32, best of 5",
    }
