"""`SkyPilotClusterResolver`: the cluster of a SkyPilot task, from its `SKYPILOT_*` variables.

SkyPilot runs a task's `run:` section once on every node with `SKYPILOT_NODE_IPS` (every node's
IP, one per line, in node-rank order), `SKYPILOT_NODE_RANK`, `SKYPILOT_NUM_NODES` and
`SKYPILOT_NUM_GPUS_PER_NODE`. Two shapes of job:

* **one worker per node** (the `run:` section starts `python train.py` once): worker i is node i,
  with every GPU of its node;
* **one worker per GPU** (the `run:` section starts `SKYPILOT_NUM_GPUS_PER_NODE` processes, each
  with its index on the node in `LOCAL_RANK` or `KERAS_MWMS_LOCAL_RANK`): node n's process k is
  worker `n * SKYPILOT_NUM_GPUS_PER_NODE + k`, on GPU k.

Each worker listens on `port_base + local rank` (`keras_mwms.resolvers.ports`, the job id being
`SKYPILOT_TASK_ID`; `KERAS_MWMS_PORT_BASE` sets it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from keras_mwms import settings
from keras_mwms.devices.assignment import infer_local_rank
from keras_mwms.resolvers.environment import (
    EnvironmentClusterResolver,
    addresses_by_rank,
    check_ports,
    environment_error,
    read_int,
)
from keras_mwms.resolvers.ports import port_base_for_job

_TASK = "Run the script from a SkyPilot task's `run:` section (e.g. `sky launch --num-nodes 2 task.yaml`)."


def node_ips(environ: Mapping[str, str]) -> list[str]:
    """The nodes of `SKYPILOT_NODE_IPS` (one per line; commas and spaces also separate).

    Example:

    >>> node_ips({"SKYPILOT_NODE_IPS": "10.0.0.1\\n10.0.0.2\\n"})
    ['10.0.0.1', '10.0.0.2']
    """
    text = environ.get("SKYPILOT_NODE_IPS")
    if text is None or not text.strip():
        raise environment_error("SKYPILOT_NODE_IPS", text, "lists no node" if text is not None else "", _TASK)
    return text.replace(",", " ").split()


def workers_per_node(environ: Mapping[str, str]) -> int:
    """1, or `SKYPILOT_NUM_GPUS_PER_NODE` when this process has a local rank (one worker per GPU).

    Example:

    >>> workers_per_node({"SKYPILOT_NUM_GPUS_PER_NODE": "8"}), workers_per_node({"SKYPILOT_NUM_GPUS_PER_NODE": "8", "LOCAL_RANK": "3"})
    (1, 8)
    """
    gpus = read_int(environ, "SKYPILOT_NUM_GPUS_PER_NODE", "It is the GPU count of each node.") or 0
    if infer_local_rank(environ) is None:
        return 1
    if gpus < 1:
        raise environment_error(
            "SKYPILOT_NUM_GPUS_PER_NODE", environ.get("SKYPILOT_NUM_GPUS_PER_NODE"),
            f"gives no GPU to the process of local rank {infer_local_rank(environ)[0]} "
            f"({infer_local_rank(environ)[1]} is set: one worker per GPU)",
            "Ask SkyPilot for GPUs (resources: accelerators), or unset LOCAL_RANK and "
            "KERAS_MWMS_LOCAL_RANK to run one worker per node.")
    return gpus


class SkyPilotClusterResolver(EnvironmentClusterResolver):
    """The cluster of a SkyPilot task: one worker per node, or one per GPU (see the module docstring).

    `keras_mwms.MultiWorkerMirroredStrategy()` picks it by itself when `SKYPILOT_NODE_RANK` is
    set (and no TF_CONFIG, Slurm step, torchrun, MPI or JAX variables are).

    Example:

    >>> env = {"SKYPILOT_NODE_IPS": "10.0.0.1\\n10.0.0.2", "SKYPILOT_NODE_RANK": "1",
    ...        "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "2", "LOCAL_RANK": "1"}
    >>> resolver = SkyPilotClusterResolver(port_base=7000, environ=env)
    >>> resolver.cluster_spec().as_dict(), resolver.task_id
    ({'worker': ['10.0.0.1:7000', '10.0.0.1:7001', '10.0.0.2:7000', '10.0.0.2:7001']}, 3)

    Args:
        port_base: first port on each node. Default `KERAS_MWMS_PORT_BASE`, else
            `8888 + 16 * (hash of SKYPILOT_TASK_ID % 1000)`.
        rpc_layer: protocol prefix of `master()`. Default none.
        environ: the variables to read instead of `os.environ` (for tests and tools).
    """

    members_advice = "Start the script on every node of the SkyPilot task (and on every GPU, one worker per GPU)"
    restart_advice = "Run the task again (sky launch, or a managed job: sky jobs launch)"

    def __init__(self, port_base: int | None = None, rpc_layer: str | None = None,
                 environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        hosts = node_ips(environ)
        nodes = read_int(environ, "SKYPILOT_NUM_NODES", "It is the task's node count. " + _TASK, minimum=1)
        if nodes is not None and nodes != len(hosts):
            raise environment_error("SKYPILOT_NUM_NODES", environ.get("SKYPILOT_NUM_NODES"),
                                    f"is not the {len(hosts)} node(s) SKYPILOT_NODE_IPS lists",
                                    "Both come from SkyPilot; set neither by hand.")
        node = read_int(environ, "SKYPILOT_NODE_RANK", "It is this node's index. " + _TASK,
                        maximum=len(hosts) - 1, required=True)
        per_node = workers_per_node(environ)
        local_rank = infer_local_rank(environ)[0] if per_node > 1 else 0
        if local_rank >= per_node:
            variable = infer_local_rank(environ)[1]
            raise environment_error(variable, environ.get(variable),
                                    f"is not below SKYPILOT_NUM_GPUS_PER_NODE={per_node}",
                                    "Start one process per GPU, with local ranks 0..GPUs-1.")
        task_id = environ.get("SKYPILOT_TASK_ID")
        base = port_base_for_job(task_id, port_base, environ)
        check_ports(settings.PORT_BASE.name, settings.PORT_BASE.text(environ), base, per_node,
                    "Pass a lower port_base or set KERAS_MWMS_PORT_BASE.")
        size = len(hosts) * per_node
        self._set_workers(addresses_by_rank([hosts[rank // per_node] for rank in range(size)],
                                            [base + rank % per_node for rank in range(size)]),
                          node * per_node + local_rank, local_rank, rpc_layer)
        shape = f"{per_node} per node, one per GPU" if per_node > 1 else "one per node"
        self.source = f"SkyPilot task ({len(hosts)} node(s), {shape})"
