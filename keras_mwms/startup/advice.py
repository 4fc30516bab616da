"""Fixes that fit how the job was started, for the errors that end in one.

The same failure needs different words under the launcher, a hand-written `TF_CONFIG`, Slurm,
MPI or torchrun: a port clash under `keras_mwms.launch --port-base` is fixed with another
`--port-base`, not by editing a `TF_CONFIG` nobody wrote; a lost worker under `srun` is
restarted by running the step again, not by `keras_mwms.launch --max-restarts`. `advice_for`
reads the resolver the strategy uses (and the variables the launcher gives its workers).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from keras_mwms import settings

# Set by `keras_mwms.launch` in every worker: the attempt number, and the --port-base if given.
LAUNCH_ATTEMPT_ENV = settings.ATTEMPT.name
LAUNCH_PORT_BASE_ENV = settings.LAUNCH_PORT_BASE.name
RESUME = "and resume with keras_mwms.callbacks.BackupAndRestore."


@dataclasses.dataclass(frozen=True)
class Advice:
    """`ports`: how to free this worker's port; `members`: who must start (for a rendezvous
    timeout); `restart`: how to restart the whole job after a lost worker."""

    ports: str
    members: str
    restart: str


def advice_for(resolver: Any, environ: Mapping[str, str] | None = None) -> Advice:
    """The advice for the job `resolver` describes.

    Example:

    >>> from keras_mwms.startup.cluster import SimpleClusterResolver
    >>> resolver = SimpleClusterResolver({"worker": ["h0:1", "h1:1"]}, "worker", 0)
    >>> advice_for(resolver, {"KERAS_MWMS_ATTEMPT": "0", "KERAS_MWMS_LAUNCH_PORT_BASE": "7000"}).ports
    'pass another --port-base to keras_mwms.launch (its workers listen on 7000 .. 7001), or leave it out to use free ports.'
    >>> advice_for(resolver, {}).members
    'Start every worker listed in TF_CONFIG'
    """
    environ = os.environ if environ is None else environ
    port_advice = getattr(resolver, "port_advice", None)
    members = getattr(resolver, "members_advice", None)
    if members:   # an orchestrator's resolver says how its job is started and restarted
        return Advice(port_advice, members, f"{resolver.restart_advice} {RESUME}")
    if settings.ATTEMPT.is_set(environ):
        base = settings.LAUNCH_PORT_BASE.read(environ)
        ports = (f"pass another --port-base to keras_mwms.launch (its workers listen on {base} .. "
                 f"{int(base) + resolver.num_workers - 1}), or leave it out to use free ports." if base else
                 "run keras_mwms.launch again: it picks free ports at every start.")
        return Advice(ports, "Keep every worker the launcher started alive",
                      "Restart the gang (python -m keras_mwms.launch --max-restarts N) " + RESUME)
    return Advice(port_advice or ("give this worker a free port in TF_CONFIG (and check that no two "
                                  "workers share a task.index)."),
                  "Start every worker listed in TF_CONFIG",
                  "Restart every worker (your orchestrator's restart policy, or python -m "
                  "keras_mwms.launch --max-restarts N on one machine) " + RESUME)
