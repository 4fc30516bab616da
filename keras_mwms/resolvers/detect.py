"""Which orchestrator started this process: the resolver the strategy uses when given none.

Order: `TF_CONFIG` (Ray's TensorflowTrainer writes one), else a Slurm job step
(`SLURM_STEP_NUM_TASKS`, set by `srun`), else a torch-style launcher (`WORLD_SIZE` with
`MASTER_ADDR`: torchrun, Kubeflow's torch runtime, PyTorchJob, Lightning, Ray's TorchTrainer), else
MPI (`OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `PMIX_RANK`), else JAX's variables (`JAX_NUM_PROCESSES`:
Kubeflow's JAX runtime), else a SkyPilot task (`SKYPILOT_NODE_RANK`), else a single worker
(`TFConfigClusterResolver` without `TF_CONFIG`, which warns). When several are present they must
agree on the worker count: a `TF_CONFIG` for 4 workers inside a 2-task Slurm step is an error, not
a guess. `KERAS_MWMS_CLUSTER_SOURCE=tf_config|slurm|torchrun|mpi|jax|skypilot|single` picks one
and skips the check (e.g. torchrun started by `srun`, one task per node, each running several
workers).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping

from keras_mwms import settings
from keras_mwms.resolvers.environment import environment_error, read_int
from keras_mwms.resolvers.jax_processes import JaxClusterResolver
from keras_mwms.resolvers.mpi import MPIClusterResolver, mpi_flavour
from keras_mwms.resolvers.skypilot import SkyPilotClusterResolver, node_ips, workers_per_node
from keras_mwms.resolvers.slurm import SlurmClusterResolver
from keras_mwms.resolvers.torchrun import TorchrunClusterResolver
from keras_mwms.startup.cluster import TF_CONFIG_ENV, ClusterResolver, TFConfigClusterResolver

SOURCE_ENV = settings.CLUSTER_SOURCE.name


def _tf_config_size(environ: Mapping[str, str]) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the resolver that is kept warns once, on its own
        return TFConfigClusterResolver(tf_config=environ[TF_CONFIG_ENV]).num_workers


def _sizes(environ: Mapping[str, str]) -> dict[str, tuple[str, Callable[[], int]]]:
    """Present sources → (variable holding the worker count, how to read it), in priority order."""
    present: dict[str, tuple[str, Callable[[], int]]] = {}
    if environ.get(TF_CONFIG_ENV, "").strip():
        present["tf_config"] = (TF_CONFIG_ENV, lambda: _tf_config_size(environ))
    if environ.get("SLURM_STEP_NUM_TASKS", "").strip():
        present["slurm"] = ("SLURM_STEP_NUM_TASKS", lambda: read_int(
            environ, "SLURM_STEP_NUM_TASKS", "It is the job step's task count.", minimum=1))
    if environ.get("WORLD_SIZE", "").strip() and environ.get("MASTER_ADDR", "").strip():
        present["torchrun"] = ("WORLD_SIZE", lambda: read_int(
            environ, "WORLD_SIZE", "It is the job's process count.", minimum=1))
    flavour = mpi_flavour(environ)
    if flavour is not None:
        present["mpi"] = (flavour[1], lambda: read_int(
            environ, flavour[1], "It is the MPI job's rank count.", minimum=1, required=True))
    if environ.get("JAX_NUM_PROCESSES", "").strip():
        present["jax"] = ("JAX_NUM_PROCESSES", lambda: read_int(
            environ, "JAX_NUM_PROCESSES", "It is the job's process count.", minimum=1))
    if environ.get("SKYPILOT_NODE_RANK", "").strip():
        present["skypilot"] = ("SKYPILOT_NODE_IPS",
                               lambda: len(node_ips(environ)) * workers_per_node(environ))
    return present


def _build(source: str, environ: Mapping[str, str]) -> ClusterResolver:
    if source == "tf_config":
        return TFConfigClusterResolver(tf_config=environ.get(TF_CONFIG_ENV, ""))
    if source == "slurm":
        return SlurmClusterResolver(environ=environ)
    if source == "torchrun":
        return TorchrunClusterResolver(environ=environ)
    if source == "mpi":
        return MPIClusterResolver(environ=environ)
    if source == "jax":
        return JaxClusterResolver(environ=environ)
    if source == "skypilot":
        return SkyPilotClusterResolver(environ=environ)
    return TFConfigClusterResolver(tf_config="")


def detect_cluster_resolver(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver for this process's orchestrator (see the module docstring for the order).

    Example:

    >>> resolver = detect_cluster_resolver({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
    ...                                     "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2"})
    >>> type(resolver).__name__, resolver.num_workers
    ('TorchrunClusterResolver', 2)
    >>> detect_cluster_resolver({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, '
    ...                          '"task": {"type": "worker", "index": 0}}', "SLURM_STEP_NUM_TASKS": "3"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    keras_mwms.errors.ClusterEnvironmentError: SLURM_STEP_NUM_TASKS='3' says 3 workers, but TF_CONFIG says 2: ...
    """
    environ = os.environ if environ is None else environ
    forced = settings.CLUSTER_SOURCE.read(environ)
    if forced:
        return _build(forced, environ)
    present = _sizes(environ)
    if not present:
        return _build("single", environ)
    if len(present) == 1:
        return _build(next(iter(present)), environ)
    counts = {source: (variable, read()) for source, (variable, read) in present.items()}
    chosen = next(iter(counts))
    chosen_variable, chosen_count = counts[chosen]
    for source, (variable, count) in counts.items():
        if count != chosen_count:
            raise environment_error(
                variable, environ.get(variable), f"says {count} workers, but {chosen_variable} says {chosen_count}",
                f"keras_mwms will not guess between {chosen} and {source}: unset the variables of the "
                f"launcher that does not start the workers, or set {SOURCE_ENV} to {chosen} or {source}.")
    ignored = [source for source in counts if source != chosen]
    stale = " (e.g. a TF_CONFIG left in the shell)" if chosen == "tf_config" else ""
    # Agreeing counts do not mean agreeing ranks: a TF_CONFIG left in the shell makes every
    # torchrun worker worker 0. Say which source won, so a clash that follows is explained.
    warnings.warn(
        f"keras_mwms: this worker's cluster is read from {chosen} ({chosen_variable}); the "
        f"{' and '.join(f'{source} ({counts[source][0]})' for source in ignored)} variables also present are "
        f"ignored. If {' or '.join(ignored)} started this job, unset {chosen_variable}{stale} or set "
        f"{SOURCE_ENV}={ignored[0]}; set {SOURCE_ENV}={chosen} to keep this choice without this warning.",
        stacklevel=2)
    return _build(chosen, environ)


def describe_source(resolver: ClusterResolver) -> str:
    """One line naming where the cluster came from, logged by the chief.

    Example:

    >>> describe_source(TFConfigClusterResolver(tf_config=""))
    'single worker (no TF_CONFIG, Slurm step, torchrun, MPI, JAX or SkyPilot variables)'
    """
    if getattr(resolver, "source", None):
        return resolver.source
    if isinstance(resolver, TFConfigClusterResolver):
        return "TF_CONFIG" if not resolver.is_single_worker else \
            "single worker (no TF_CONFIG, Slurm step, torchrun, MPI, JAX or SkyPilot variables)"
    return type(resolver).__name__
