"""Resolvers for the launchers users already have: Slurm, torchrun / Kubeflow, MPI, JAX's variables, SkyPilot, Ray.

Each reads its orchestrator's environment variables and answers like
`keras_mwms.TFConfigClusterResolver`: `cluster_spec()`, `task_type`, `task_id`, `master()`,
`num_accelerators()`, plus `is_chief`, `worker_index`, `num_workers` and `local_rank`.
`detect_cluster_resolver()` picks one when the strategy is given none: TF_CONFIG, else a Slurm
job step, else torchrun, else MPI, else JAX's variables, else SkyPilot, else a single worker.
`RayTrainClusterResolver` is given explicitly, inside a Ray Train loop. Every module here is pure
Python (the Ray one imports Ray when built).

Example:

>>> from keras_mwms.resolvers import SlurmClusterResolver
>>> resolver = SlurmClusterResolver(gpus_per_node=0, environ={
...     "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]",
...     "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "7"})
>>> resolver.cluster_spec().as_dict(), resolver.task_id
({'worker': ['node1:9000', 'node2:9000']}, 1)
"""

from keras_mwms.resolvers.detect import detect_cluster_resolver
from keras_mwms.resolvers.environment import ClusterEnvironmentError
from keras_mwms.resolvers.hostlist import expand_hostlist, expand_tasks_per_node
from keras_mwms.resolvers.jax_processes import JaxClusterResolver
from keras_mwms.resolvers.mpi import MPIClusterResolver
from keras_mwms.resolvers.ports import port_base_for_job
from keras_mwms.resolvers.ray_train import RayTrainClusterResolver
from keras_mwms.resolvers.skypilot import SkyPilotClusterResolver
from keras_mwms.resolvers.slurm import SlurmClusterResolver
from keras_mwms.resolvers.torchrun import TorchrunClusterResolver

__all__ = [
    "ClusterEnvironmentError",
    "JaxClusterResolver",
    "MPIClusterResolver",
    "RayTrainClusterResolver",
    "SkyPilotClusterResolver",
    "SlurmClusterResolver",
    "TorchrunClusterResolver",
    "detect_cluster_resolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "port_base_for_job",
]
