"""What the environment-variable resolvers share: reading variables, errors, the worker cluster.

An orchestrator (Slurm, torchrun, mpirun) starts every process with variables that give its rank
and the job's size. A resolver turns them into a `worker` job listing one `host:port` per rank;
rank 0 is the chief. A variable that is missing or malformed raises `ClusterEnvironmentError`
naming the variable, its value and the fix, before any backend or network is touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from keras_mwms.errors import ClusterEnvironmentError
from keras_mwms.startup.cluster import WORKER, ClusterResolver, ClusterSpec, format_address


def environment_error(variable: str, value: object, problem: str, fix: str) -> ClusterEnvironmentError:
    """`ClusterEnvironmentError("NAME='value' problem: fix")`; an unset variable reads `NAME is unset`.

    Example:

    >>> str(environment_error("RANK", None, "", "Start the script with torchrun."))
    'RANK is unset: Start the script with torchrun.'
    """
    shown = f"{variable} is unset" if value is None else f"{variable}={value!r}"
    return ClusterEnvironmentError(f"{shown}{' ' + problem if problem else ''}: {fix}")


def read_int(environ: Mapping[str, str], name: str, fix: str, minimum: int = 0,
             maximum: int | None = None, required: bool = False) -> int | None:
    """The integer value of variable `name` (None when unset and not `required`), range-checked.

    Example:

    >>> read_int({"WORLD_SIZE": "4"}, "WORLD_SIZE", "Set it.", minimum=1)
    4
    """
    text = environ.get(name)
    if text is None or (not text.strip() and not required):
        if required:
            raise environment_error(name, None, "", fix)
        return None
    stripped = text.strip()
    if not (stripped.isdigit() or (stripped.startswith("-") and stripped[1:].isdigit())):
        raise environment_error(name, text, "is not an integer", fix)
    value = int(stripped)
    if value < minimum or (maximum is not None and value > maximum):
        problem = f"is outside {minimum}..{maximum}" if maximum is not None else f"is below {minimum}"
        raise environment_error(name, text, problem, fix)
    return value


def first_set(environ: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The first of `names` set (non-empty) in `environ`, or None.

    Example:

    >>> first_set({"PMI_RANK": "0"}, ["OMPI_COMM_WORLD_RANK", "PMI_RANK"])
    'PMI_RANK'
    """
    return next((name for name in names if environ.get(name, "").strip()), None)


def check_ports(variable: str, value: object, base: int, count: int, fix: str) -> None:
    """Raises when ports `base .. base + count - 1` do not all fit in 1..65535.

    Example:

    >>> check_ports("MASTER_PORT", "65535", 65536, 1, "Use a lower port.")
    Traceback (most recent call last):
    ...
    keras_mwms.errors.ClusterEnvironmentError: MASTER_PORT='65535' gives ports 65536..65536, outside 1..65535: Use a lower port.
    """
    if base < 1 or base + count - 1 > 65535:
        raise environment_error(variable, value, f"gives ports {base}..{base + count - 1}, outside 1..65535", fix)


class EnvironmentClusterResolver(ClusterResolver):
    """Base of the orchestrator resolvers: a `worker` job in rank order, this task, its local rank.

    Subclasses call `_set_workers(addresses, rank, local_rank)` and set `source`, a phrase such
    as `"Slurm job step 42.0"` that the strategy logs on the chief, and may reword
    `members_advice`, `restart_advice` and `port_advice` for their orchestrator.

    Example:

    >>> from keras_mwms.resolvers import MPIClusterResolver
    >>> resolver = MPIClusterResolver(environ={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})
    >>> resolver.source, resolver.num_workers, resolver.local_rank
    ('Open MPI (OMPI_COMM_WORLD_*)', 1, 0)
    """

    source: str = "environment"
    # The start-up and lost-worker errors' advice (`keras_mwms.startup.advice`), in the orchestrator's words.
    members_advice: str = "Start every process of the job (on every node)"
    restart_advice: str = "Restart every process of the job"
    port_advice: str = ("set KERAS_MWMS_PORT_BASE, the same on every task, to the start of a free "
                        "port range (another job on this node may use these ports).")
    _local_rank: int = 0

    def _set_workers(self, addresses: Sequence[str], rank: int, local_rank: int,
                     rpc_layer: str | None, jobs: Mapping[str, int] | None = None) -> None:
        jobs = dict(jobs) if jobs else {WORKER: len(addresses)}
        cluster: dict[str, list[str]] = {}
        start = 0
        self._task_type, self._task_id = None, None
        # Like TensorFlow's SlurmClusterResolver: jobs in name order take consecutive ranks.
        for job, count in sorted(jobs.items()):
            cluster[job] = list(addresses[start:start + count])
            if start <= rank < start + count:
                self._task_type, self._task_id = job, rank - start
            start += count
        self._cluster = ClusterSpec(cluster)
        self._local_rank = local_rank
        self._rpc_layer = rpc_layer
        self._environment = None

    @property
    def local_rank(self) -> int:
        """This process's index among the job's processes on its node (0 for the first)."""
        return self._local_rank

    @property
    def is_single_worker(self) -> bool:
        """True when the job has one process."""
        return self.num_workers == 1


def addresses_by_rank(hosts: Sequence[str], ports: Sequence[int]) -> list[str]:
    """`host:port` for every rank, bracketing IPv6 literals.

    Example:

    >>> addresses_by_rank(["a", "::1"], [1, 2])
    ['a:1', '[::1]:2']
    """
    return [format_address(host, port) for host, port in zip(hosts, ports)]
