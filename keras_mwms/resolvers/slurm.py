"""`SlurmClusterResolver`: the cluster of a Slurm job step (`srun`), from `SLURM_*` variables.

Same constructor and results as `tf.distribute.cluster_resolver.SlurmClusterResolver`
(tests/test_resolvers_slurm.py compares the two on hundreds of random environments), with
three differences, each because the TensorFlow one fails or guesses there:

* node lists are expanded in Python, so no `scontrol` is needed on the compute node;
* the default port base is 8888 offset by the job id (`keras_mwms.resolvers.ports`), so two
  jobs sharing a node do not collide; an explicit `port_base` behaves exactly like TensorFlow's;
* a malformed or inconsistent environment (a rank outside the step, counts that do not match
  the node list, a task placed on another node than Slurm says) raises
  `ClusterEnvironmentError` naming the variable, instead of an `AssertionError` or a hang.

Tasks are placed like TensorFlow does: nodes in name order, each node's tasks on consecutive
ports `base + SLURM_LOCALID`, and jobs in name order take consecutive ranks (`chief` before
`worker`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

from keras_mwms import settings
from keras_mwms.resolvers.environment import (
    EnvironmentClusterResolver,
    addresses_by_rank,
    check_ports,
    environment_error,
    first_set,
    read_int,
)
from keras_mwms.resolvers.hostlist import expand_hostlist, expand_tasks_per_node
from keras_mwms.resolvers.ports import port_base_for_job
from keras_mwms.startup.cluster import WORKER

NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE_VARIABLES = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
NUM_TASKS_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
_IN_A_STEP = "Run the script with srun inside your allocation (e.g. `srun python train.py`)."


def local_gpu_count(environ: Mapping[str, str]) -> int:
    """GPUs on this node: `SLURM_GPUS_ON_NODE`, else `CUDA_VISIBLE_DEVICES`, else `nvidia-smi`, else 0.

    Example:

    >>> local_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}), local_gpu_count({"SLURM_GPUS_ON_NODE": "4"})
    (2, 4)
    """
    on_node = read_int(environ, "SLURM_GPUS_ON_NODE", "It must count this node's GPUs.")
    if on_node is not None:
        return on_node
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


class SlurmClusterResolver(EnvironmentClusterResolver):
    """The cluster of a Slurm job step, like `tf.distribute.cluster_resolver.SlurmClusterResolver`.

    Start one process per task with `srun` (e.g. `#SBATCH --nodes=2 --ntasks-per-node=2`, then
    `srun python train.py`): `keras_mwms.MultiWorkerMirroredStrategy()` picks this resolver by
    itself when it sees a job step. Build one explicitly for other jobs or ports.

    Example:

    >>> env = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "12",
    ...        "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    >>> resolver = SlurmClusterResolver(port_base=8888, gpus_per_node=4, auto_set_gpu=False, environ=env)
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['gpu01:8888', 'gpu01:8889', 'gpu02:8888', 'gpu02:8889']}
    >>> resolver.task_type, resolver.task_id, resolver.master(), resolver.num_accelerators()
    ('worker', 2, 'grpc://gpu02:8888', {'GPU': 2})
    >>> resolver.visible_devices, resolver.worker_index, resolver.local_rank
    ('0,1', 2, 0)

    Args:
        jobs: `{job name: task count}`; default `{"worker": SLURM_STEP_NUM_TASKS}`. Jobs take
            consecutive ranks in name order (`chief` before `worker`).
        port_base: first port on each node (task i of a node listens on `port_base + i`).
            Default: `KERAS_MWMS_PORT_BASE`, else `8888 + 16 * (SLURM_JOB_ID % 1000)`.
        gpus_per_node: GPUs on each node; default `SLURM_GPUS_ON_NODE`, else
            `CUDA_VISIBLE_DEVICES`, else `nvidia-smi`, else 0.
        gpus_per_task: GPUs for each task; default `gpus_per_node // most tasks on a node`.
        tasks_per_node: an int for every node, or `{host: count}`; default from
            `SLURM_STEP_NODELIST` and `SLURM_STEP_TASKS_PER_NODE`.
        auto_set_gpu: set `CUDA_VISIBLE_DEVICES` to this task's GPUs (when it has any). Default True.
        rpc_layer: protocol prefix of `master()`. Default `"grpc"`.
        environ: the variables to read instead of `os.environ` (for tests and tools).
    """

    members_advice = "Start every task of the Slurm job step (srun)"
    restart_advice = "Run the job step again (srun in a retry loop, or sbatch --requeue)"

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int | None = None,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: int | Mapping[str, int] | None = None, auto_set_gpu: bool = True,
                 rpc_layer: str | None = "grpc", environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        rank = read_int(environ, "SLURM_PROCID", "It is this task's rank. " + _IN_A_STEP, required=True)
        num_tasks_variable = first_set(environ, NUM_TASKS_VARIABLES) or NUM_TASKS_VARIABLES[0]
        num_tasks = read_int(environ, num_tasks_variable, "It is the job step's task count. " + _IN_A_STEP,
                             minimum=1, required=jobs is None)
        configuration = self._task_configuration(environ, tasks_per_node)
        total = sum(configuration.values())
        if jobs is None:
            jobs = {WORKER: num_tasks}
        if sum(jobs.values()) != total:
            raise environment_error(
                num_tasks_variable if num_tasks is not None else "SLURM_STEP_TASKS_PER_NODE",
                environ.get(num_tasks_variable), f"gives {sum(jobs.values())} task(s) to jobs {dict(jobs)}, "
                f"but the nodes run {total} ({configuration})",
                "Make srun's --ntasks equal the sum of --ntasks-per-node over the nodes, or pass "
                "matching `jobs`/`tasks_per_node`.")
        if not 0 <= rank < total:
            raise environment_error("SLURM_PROCID", environ.get("SLURM_PROCID"),
                                    f"is outside the job step's {total} task(s)",
                                    "Start every task with the same srun command.")
        most_tasks = max(configuration.values())
        if gpus_per_node is None:
            gpus_per_node = local_gpu_count(environ)
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // most_tasks
        if most_tasks * gpus_per_task > gpus_per_node:
            raise environment_error(
                "SLURM_GPUS_ON_NODE", environ.get("SLURM_GPUS_ON_NODE"),
                f"leaves {gpus_per_node} GPU(s) per node for {most_tasks} task(s) of {gpus_per_task} GPU(s)",
                "Ask Slurm for more GPUs (--gpus-per-node), fewer tasks per node, or lower gpus_per_task.")
        job_id = environ.get("SLURM_JOB_ID")
        base = port_base_for_job(job_id, port_base, environ)
        check_ports("SLURM_JOB_ID", job_id, base, most_tasks,
                    "Pass a lower port_base or set KERAS_MWMS_PORT_BASE.")
        hosts, ports, devices = [], [], []
        for host, count in sorted(configuration.items()):
            for offset in range(count):
                hosts.append(host)
                ports.append(base + offset)
                first = offset * gpus_per_task
                devices.append(",".join(str(gpu) for gpu in range(first, first + gpus_per_task)))
        self._check_placement(environ, rank, hosts[rank], ports[rank] - base)
        local_rank = read_int(environ, "SLURM_LOCALID", "It is this task's index on its node.")
        self._set_workers(addresses_by_rank(hosts, ports), rank,
                          ports[rank] - base if local_rank is None else local_rank, rpc_layer, jobs)
        self._gpus_per_node, self._gpus_per_task = gpus_per_node, gpus_per_task
        self._auto_set_gpu = auto_set_gpu
        self.visible_devices = devices[rank]
        step = environ.get("SLURM_STEP_ID")
        self.source = f"Slurm job step {job_id}.{step}" if step else f"Slurm job {job_id}"
        self._set_visible_devices()

    @staticmethod
    def _task_configuration(environ: Mapping[str, str], tasks_per_node) -> dict[str, int]:
        if isinstance(tasks_per_node, Mapping):
            return dict(tasks_per_node)
        nodes_variable = first_set(environ, NODELIST_VARIABLES) or NODELIST_VARIABLES[0]
        if nodes_variable not in environ:
            raise environment_error(nodes_variable, None, "", "It lists the step's nodes. " + _IN_A_STEP)
        hosts = expand_hostlist(environ[nodes_variable], nodes_variable)
        repeated = sorted({host for host in hosts if hosts.count(host) > 1})
        if repeated:
            raise environment_error(nodes_variable, environ[nodes_variable], f"names {repeated} twice",
                                    "List each node once; Slurm's own node lists never repeat a node.")
        if tasks_per_node is not None:
            return {host: int(tasks_per_node) for host in hosts}
        counts_variable = first_set(environ, TASKS_PER_NODE_VARIABLES) or TASKS_PER_NODE_VARIABLES[0]
        if counts_variable not in environ:
            raise environment_error(counts_variable, None, "", "It counts tasks per node. " + _IN_A_STEP)
        counts = expand_tasks_per_node(environ[counts_variable], counts_variable)
        if len(counts) != len(hosts):
            raise environment_error(counts_variable, environ[counts_variable],
                                    f"counts {len(counts)} node(s) but {nodes_variable} lists {len(hosts)}",
                                    "Both must come from the same job step; set neither by hand.")
        return dict(zip(hosts, counts))

    @staticmethod
    def _check_placement(environ: Mapping[str, str], rank: int, host: str, offset: int) -> None:
        node = environ.get("SLURMD_NODENAME")
        if node and node != host:
            raise environment_error(
                "SLURMD_NODENAME", node, f"is not {host!r}, where task {rank} is placed in node-name order",
                "Use block distribution (srun --distribution=block, the default) or pass `tasks_per_node`.")
        local = read_int(environ, "SLURM_LOCALID", "It is this task's index on its node.")
        if local is not None and local != offset:
            raise environment_error(
                "SLURM_LOCALID", environ.get("SLURM_LOCALID"), f"is not {offset}, task {rank}'s index on {host}",
                "Use block distribution (srun --distribution=block, the default).")

    def _set_visible_devices(self) -> None:
        if self._auto_set_gpu and self._gpus_per_task:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.visible_devices
            # These are this task's GPUs: the backends use them all, not one by SLURM_LOCALID
            # (`keras_mwms.devices.assignment`, as for the launcher's).
            os.environ[settings.GPUS_PER_WORKER.name] = str(self._gpus_per_task)

    def cluster_spec(self):
        """The cluster (and, with `auto_set_gpu`, this task's `CUDA_VISIBLE_DEVICES`, as TensorFlow's does)."""
        self._set_visible_devices()
        return super().cluster_spec()

    def get_task_info(self) -> tuple[str | None, int | None]:
        """`(task_type, task_id)` of this process, like TensorFlow's."""
        return self.task_type, self.task_id

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict[str, int]:
        """`{"GPU": gpus_per_task}`, like TensorFlow's (also `{"GPU": 0}` without GPUs)."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task}
