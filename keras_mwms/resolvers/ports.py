"""The port convention: several jobs can share a node without choosing ports by hand.

A Slurm or MPI job gives every task on a node its own port, `base + local index`, like
TensorFlow's `SlurmClusterResolver`. TensorFlow's fixed base (8888) makes two jobs on one node
collide, so keras_mwms offsets it by the job id:

    base = 8888 + 16 * (job_id % 1000)          # 8888 .. 24872, below Linux's ephemeral ports

so jobs whose ids differ modulo 1000 never share a port when each runs at most 16 tasks per
node. `KERAS_MWMS_PORT_BASE` (every task must see the same value) or the resolver's `port_base`
argument replaces the computed base; the rendezvous then names any port that is still taken.

Example:

>>> port_base_for_job("4242")
12760
>>> port_base_for_job("4242", port_base=5000)
5000
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping

from keras_mwms import settings

DEFAULT_PORT_BASE = 8888
PORTS_PER_JOB = 16
JOB_SLOTS = 1000
PORT_BASE_ENV = settings.PORT_BASE.name


def port_base_for_job(job_id: str | None, port_base: int | None = None,
                      environ: Mapping[str, str] | None = None) -> int:
    """The first port of this job on every node: `port_base`, else `KERAS_MWMS_PORT_BASE`,
    else `8888 + 16 * (job_id % 1000)` (a non-numeric job id is hashed; no id: 8888).

    Example:

    >>> port_base_for_job(None), port_base_for_job("1001"), port_base_for_job("x", environ={"KERAS_MWMS_PORT_BASE": "7000"})
    (8888, 8904, 7000)
    """
    environ = os.environ if environ is None else environ
    if port_base is not None:
        if isinstance(port_base, bool) or not isinstance(port_base, int) or not 1 <= port_base <= 65535:
            raise ValueError(f"port_base={port_base!r} must be an integer port in 1..65535.")
        return port_base
    chosen = settings.PORT_BASE.read(environ)
    if chosen is not None:
        return chosen
    if not job_id:
        return DEFAULT_PORT_BASE
    number = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return DEFAULT_PORT_BASE + PORTS_PER_JOB * (number % JOB_SLOTS)
