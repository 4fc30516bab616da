"""`MPIClusterResolver`: the cluster of a job started by `mpirun` / `mpiexec` / `srun --mpi`.

Open MPI exports `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`; MPICH and Intel
MPI's Hydra export `PMI_RANK`, `PMI_SIZE` (and `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`); PMIx
launchers export `PMIX_RANK`. None of them says where the other ranks run, so the hosts come
from the user: `hosts=` or `KERAS_MWMS_HOSTS` (one name per node, `host1,host2` or a Slurm-style
`node[1-4]`), ranks placed by block (mpirun's default `--map-by slot`: node i runs ranks
`i*L .. i*L+L-1`, L processes per node). On one node no host list is needed (`localhost`).
Each rank listens on `port_base + local rank` (see `keras_mwms.resolvers.ports`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from keras_mwms import settings
from keras_mwms.resolvers.environment import (
    EnvironmentClusterResolver,
    addresses_by_rank,
    check_ports,
    environment_error,
    first_set,
    read_int,
)
from keras_mwms.resolvers.hostlist import given_hosts, nodes_share
from keras_mwms.resolvers.ports import PORT_BASE_ENV, port_base_for_job

HOSTS_ENV = settings.HOSTS.name
# (rank, size, local rank, local size, job id, what to call it), most specific first.
FLAVOURS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE"),
     "Open MPI (OMPI_COMM_WORLD_*)"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ("PMI_KVSNAME",), "MPICH/Hydra (PMI_*)"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE", ("PMIX_NAMESPACE",), "PMIx (PMIX_*)"),
)
_LAUNCH = "Start the script with mpirun (e.g. `mpirun -np 2 python train.py`)."


def mpi_flavour(environ: Mapping[str, str]) -> tuple | None:
    """The `FLAVOURS` row whose rank variable is set, or None outside MPI.

    Example:

    >>> mpi_flavour({"PMI_RANK": "0", "PMI_SIZE": "2"})[-1]
    'MPICH/Hydra (PMI_*)'
    """
    return next((flavour for flavour in FLAVOURS if first_set(environ, [flavour[0]])), None)


class MPIClusterResolver(EnvironmentClusterResolver):
    """The cluster of an MPI job (Open MPI, MPICH, Intel MPI, PMIx launchers).

    `keras_mwms.MultiWorkerMirroredStrategy()` picks it by itself under `mpirun` when neither
    `TF_CONFIG`, a Slurm step nor torchrun variables are set.

    Example:

    >>> env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
    ...        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    >>> resolver = MPIClusterResolver(hosts="node[1-2]", port_base=7000, environ=env)
    >>> resolver.cluster_spec().as_dict()
    {'worker': ['node1:7000', 'node1:7001', 'node2:7000', 'node2:7001']}
    >>> resolver.task_id, resolver.local_rank, resolver.is_chief
    (3, 1, False)

    Args:
        hosts: the nodes, in order: a list or a `host1,host2` / `node[1-4]` string. Default
            `KERAS_MWMS_HOSTS`, or `localhost` when every rank is on this node.
        port_base: first port on each node. Default `KERAS_MWMS_PORT_BASE`, else
            `8888 + 16 * (MPI job id % 1000)`.
        rpc_layer: protocol prefix of `master()`. Default none.
        environ: the variables to read instead of `os.environ` (for tests and tools).
    """

    members_advice = "Start every rank of the MPI job"
    restart_advice = "Run mpirun again"

    def __init__(self, hosts: str | Sequence[str] | None = None, port_base: int | None = None,
                 rpc_layer: str | None = None, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        flavour = mpi_flavour(environ)
        if flavour is None:
            raise environment_error("OMPI_COMM_WORLD_RANK", None, "(nor PMI_RANK, PMIX_RANK)", _LAUNCH)
        rank_name, size_name, local_rank_name, local_size_name, job_names, self.source = flavour
        size = read_int(environ, size_name, f"It is the job's rank count. {_LAUNCH}", minimum=1, required=True)
        rank = read_int(environ, rank_name, f"It is this process's rank. {_LAUNCH}", maximum=size - 1,
                        required=True)
        local_size = read_int(environ, local_size_name, "It is the rank count on this node.", minimum=1,
                              maximum=size)
        local_rank = read_int(environ, local_rank_name, "It is this rank's index on its node.")
        hosts_variable, hosts = given_hosts(hosts, environ, settings.HOSTS)
        if hosts is None:
            if local_size is not None and local_size != size:
                raise environment_error(HOSTS_ENV, None, f"but {local_size_name}={local_size} is not "
                                        f"{size_name}={size} (ranks on several nodes)",
                                        "Set KERAS_MWMS_HOSTS to the nodes in rank order, e.g. "
                                        "`mpirun -x KERAS_MWMS_HOSTS=node1,node2 ...`.")
            hosts = ["localhost"]
        per_node = nodes_share(hosts, size, hosts_variable, "ranks")
        if local_size is not None and local_size != per_node:
            raise environment_error(local_size_name, environ.get(local_size_name),
                                    f"is not {per_node}, the ranks per node of {len(hosts)} node(s)",
                                    f"Fix {HOSTS_ENV} to list every node of the job once.")
        if local_rank is not None and local_rank != rank % per_node:
            raise environment_error(local_rank_name, environ.get(local_rank_name),
                                    f"is not {rank % per_node}: ranks are not placed by block",
                                    "Run mpirun with --map-by slot (the default), not --map-by node.")
        job_variable = first_set(environ, job_names)
        base = port_base_for_job(environ.get(job_variable) if job_variable else None, port_base, environ)
        check_ports(job_variable or PORT_BASE_ENV,
                    environ.get(job_variable) if job_variable else settings.PORT_BASE.text(environ),
                    base, per_node, "Pass a lower port_base or set KERAS_MWMS_PORT_BASE.")
        self._set_workers(addresses_by_rank([hosts[r // per_node] for r in range(size)],
                                            [base + r % per_node for r in range(size)]),
                          rank, rank % per_node, rpc_layer)
