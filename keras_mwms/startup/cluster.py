"""Who is in the job and who am I: `TF_CONFIG` parsing, validation and resolvers.

Every worker of a multi-worker job learns the cluster and its own place in it from the
`TF_CONFIG` environment variable, exactly as TensorFlow users expect:

```
{"cluster": {"worker": ["host0:port", "host1:port"]},
 "task": {"type": "worker", "index": 1}}
```

The list is identical on every worker and its order is the identity. The *collective group*
is the `chief` task (if the cluster has one) followed by the `worker` tasks; its first member
is the chief, which writes checkpoints and hosts the rendezvous. An `evaluator` task is never
waited for; a `ps` job is ignored with a warning because a mirrored strategy has no parameter
servers.

Everything here is pure Python: a bad `TF_CONFIG` is reported as a `TFConfigError` (a
`ValueError`) naming the field, the value and the fix, before any backend or network is touched.
Resolvers for launchers that do not write `TF_CONFIG` (Slurm, torchrun / PyTorchJob, MPI) build
on `ClusterResolver` in `keras_mwms.resolvers`.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from keras_mwms.errors import TFConfigError

TF_CONFIG_ENV = "TF_CONFIG"
CHIEF = "chief"
WORKER = "worker"
EVALUATOR = "evaluator"
PS = "ps"
KNOWN_TASK_TYPES = (CHIEF, WORKER, EVALUATOR, PS)
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"})


def _fail(field: str, value: Any, problem: str, fix: str) -> TFConfigError:
    shown = json.dumps(value) if _is_jsonable(value) else repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return TFConfigError(f"TF_CONFIG field `{field}` {problem} (got {shown}). {fix}")


def _is_jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def split_address(address: str) -> tuple[str, int]:
    """Splits `"host:port"` (or `"[v6]:port"`) into `(host, port)`.

    Raises `ValueError` when the address has no port or the port is not a number in
    1..65535.

    Example:

    >>> split_address("[::1]:2222")
    ('::1', 2222)
    >>> split_address("worker-0.example.com:2222")
    ('worker-0.example.com', 2222)
    """
    if not isinstance(address, str) or not address:
        raise ValueError(f"expected a 'host:port' string, got {address!r}")
    if address.startswith("["):
        end = address.find("]")
        if end < 0 or address[end + 1 : end + 2] != ":":
            raise ValueError(f"IPv6 address must look like '[::1]:2222', got {address!r}")
        host, port_text = address[1:end], address[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} inside [...] is not an IPv6 address") from None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not host:
            raise ValueError(f"expected 'host:port', got {address!r} (no port)")
        if ":" in host:
            raise ValueError(
                f"{address!r} looks like a bare IPv6 address; write it as '[{host}]:{port_text}'"
            )
        if any(ch.isspace() for ch in host) or "/" in host:
            raise ValueError(f"{host!r} is not a valid host name")
    if not port_text.isdigit():
        raise ValueError(f"port {port_text!r} in {address!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} in {address!r} is outside 1..65535")
    return host, port


def format_address(host: str, port: int) -> str:
    """Joins a host and a port, bracketing IPv6 literals: `format_address("::1", 5)` → `"[::1]:5"`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ClusterSpec:
    """The jobs of a cluster and their task addresses, like `tf.train.ClusterSpec`.

    Example:

    >>> spec = ClusterSpec({"worker": ["localhost:2001", "localhost:2002"]})
    >>> spec.jobs, spec.num_tasks("worker"), spec.task_address("worker", 1)
    (['worker'], 2, 'localhost:2002')
    >>> spec.as_dict()
    {'worker': ['localhost:2001', 'localhost:2002']}

    Args:
        cluster: a mapping from job name to the list of its task addresses.
    """

    def __init__(self, cluster: Mapping[str, Sequence[str]] | ClusterSpec | None = None):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        self._jobs: dict[str, list[str]] = {
            job: list(tasks) for job, tasks in (cluster or {}).items()
        }

    @property
    def jobs(self) -> list[str]:
        """The job names, in insertion order."""
        return list(self._jobs)

    def as_dict(self) -> dict[str, list[str]]:
        """A copy of the spec as `{job: [address, ...]}`."""
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    def _tasks(self, job_name: str) -> list[str]:
        try:
            return self._jobs[job_name]
        except KeyError:
            raise ValueError(f"No such job in cluster: {job_name!r}") from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks `job_name` has; `ValueError` for an unknown job."""
        return len(self._tasks(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The valid task indices of `job_name`."""
        return list(range(self.num_tasks(job_name)))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The `host:port` of task `task_index` of `job_name`; `ValueError` if absent."""
        tasks = self._tasks(job_name)
        if not 0 <= task_index < len(tasks):
            raise ValueError(f"No task with index {task_index} in job {job_name!r}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> list[str]:
        """The addresses of every task of `job_name`, in index order."""
        return list(self._tasks(job_name))

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _validate_cluster(cluster: Any) -> dict[str, list[str]]:
    if not isinstance(cluster, dict):
        raise _fail(
            "cluster", cluster, "must be an object mapping job names to address lists",
            'Write it as {"worker": ["host0:port", "host1:port"]}.',
        )
    if not cluster:
        raise _fail("cluster", cluster, "is empty", 'List the workers: {"worker": ["host:port", ...]}.')
    result: dict[str, list[str]] = {}
    for job, tasks in cluster.items():
        if job not in KNOWN_TASK_TYPES:
            close = difflib.get_close_matches(job, KNOWN_TASK_TYPES, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise _fail(
                f"cluster.{job}", job, "is not a known job name",
                f"Use only {', '.join(KNOWN_TASK_TYPES)}.{hint}",
            )
        if isinstance(tasks, dict):
            raise _fail(
                f"cluster.{job}", tasks, "is a sparse {index: address} mapping, which keras_mwms "
                "does not support", "List every task's address in index order.",
            )
        if not isinstance(tasks, list):
            raise _fail(f"cluster.{job}", tasks, "must be a list of 'host:port' strings",
                        f'Write it as "{job}": ["host:port", ...].')
        if not tasks:
            raise _fail(f"cluster.{job}", tasks, "is an empty job",
                        f"List at least one address or remove the `{job}` job.")
        for index, address in enumerate(tasks):
            try:
                split_address(address)
            except ValueError as error:
                raise _fail(
                    f"cluster.{job}[{index}]", address, f"is not a valid address: {error}",
                    "Each task address must be 'host:port' (IPv6: '[::1]:port'), port in 1..65535.",
                ) from None
        result[job] = list(tasks)
    for job in (CHIEF, EVALUATOR):
        if job in result and len(result[job]) != 1:
            raise _fail(f"cluster.{job}", result[job], f"has {len(result[job])} tasks",
                        f"A cluster has at most one {job}; move the others to `worker`.")
    if CHIEF not in result and WORKER not in result:
        raise _fail("cluster", cluster, "has neither a `chief` nor a `worker` job",
                    "A multi-worker job needs at least one `worker` (or `chief`) task.")
    seen: dict[str, str] = {}
    for job, tasks in result.items():
        for index, address in enumerate(tasks):
            name = f"{job}:{index}"
            if address in seen:
                raise _fail(f"cluster.{job}[{index}]", address,
                            f"duplicates the address of {seen[address]}",
                            "Every task needs its own host:port.")
            seen[address] = name
    hosts = {split_address(address)[0].lower() for tasks in result.values() for address in tasks}
    local, remote = hosts & LOCAL_HOSTS, hosts - LOCAL_HOSTS
    if local and remote:
        warnings.warn(
            f"TF_CONFIG mixes local addresses {sorted(local)} with other hosts {sorted(remote)}: "
            "workers on other machines cannot reach 'localhost'. Use every machine's routable "
            "host name or IP address.",
            stacklevel=4,
        )
    return result


def _validate_task(task: Any, cluster: dict[str, list[str]]) -> tuple[str, int]:
    if not isinstance(task, dict):
        raise _fail("task", task, "must be an object", 'Write it as {"type": "worker", "index": 0}.')
    if "type" not in task:
        raise _fail("task.type", task, "is missing", 'Add "type": "worker" (or "chief").')
    task_type = task["type"]
    if not isinstance(task_type, str) or task_type not in KNOWN_TASK_TYPES:
        close = difflib.get_close_matches(str(task_type), KNOWN_TASK_TYPES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise _fail("task.type", task_type, "is not a known task type",
                    f"Use one of {', '.join(KNOWN_TASK_TYPES)}.{hint}")
    if task_type not in cluster:
        raise _fail("task.type", task_type, f"names a job the cluster does not have (jobs: {sorted(cluster)})",
                    f"Add a `{task_type}` job to `cluster` or fix the task type.")
    if "index" not in task:
        raise _fail("task.index", task, "is missing", 'Add "index": N, this task\'s position in its job list.')
    index = task["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise _fail("task.index", index, "must be an integer",
                    'Write the index as a JSON number, e.g. "index": 0.')
    size = len(cluster[task_type])
    if not 0 <= index < size:
        raise _fail("task.index", index, f"is out of range for job `{task_type}` with {size} task(s)",
                    f"Use an index in 0..{size - 1}.")
    return task_type, index


def parse_tf_config(text: str) -> dict[str, Any]:
    """Parses and validates a `TF_CONFIG` JSON string.

    Returns `{"cluster": {...}, "task_type": str, "task_id": int, "rpc_layer": str | None,
    "environment": str | None, "session_master": str | None}`. Raises `TFConfigError` naming the
    bad field otherwise.

    Example:

    >>> config = parse_tf_config(
    ...     '{"cluster": {"worker": ["localhost:2001", "localhost:2002"]},'
    ...     ' "task": {"type": "worker", "index": 1}}')
    >>> config["task_type"], config["task_id"]
    ('worker', 1)
    """
    if not isinstance(text, str):
        raise _fail("TF_CONFIG", text, "must be a JSON string", "Set TF_CONFIG to a JSON object.")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TFConfigError(
            f"TF_CONFIG is not valid JSON: {error.msg} at line {error.lineno} column {error.colno} "
            f"(character {error.pos}): {text[max(0, error.pos - 20):error.pos + 20]!r}. "
            "Check quoting: JSON needs double quotes, and shells need the whole value in single quotes."
        ) from None
    if not isinstance(data, dict):
        raise _fail("TF_CONFIG", data, "must be a JSON object",
                    'Write it as {"cluster": {...}, "task": {...}}.')
    unknown = sorted(set(data) - {"cluster", "task", "rpc_layer", "environment", "session_master"})
    if unknown:
        warnings.warn(f"TF_CONFIG has keys keras_mwms ignores: {unknown}.", stacklevel=2)
    if "cluster" not in data:
        raise _fail("cluster", data, "is missing", 'Add "cluster": {"worker": ["host:port", ...]}.')
    cluster = _validate_cluster(data["cluster"])
    if "task" not in data:
        raise _fail("task", data, "is missing", 'Add "task": {"type": "worker", "index": N}.')
    task_type, task_id = _validate_task(data["task"], cluster)
    for key in ("rpc_layer", "environment", "session_master"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise _fail(key, data[key], "must be a string", f"Remove `{key}` or make it a string.")
    return {
        "cluster": cluster,
        "task_type": task_type,
        "task_id": task_id,
        "rpc_layer": data.get("rpc_layer"),
        "environment": data.get("environment"),
        "session_master": data.get("session_master"),
    }


def make_tf_config(workers: Sequence[str], index: int, task_type: str = WORKER,
                   chief: str | None = None) -> str:
    """Builds a validated `TF_CONFIG` JSON string, for launchers and shell scripts.

    Example:

    >>> make_tf_config(["h1:2222", "h2:2222"], 1)
    '{"cluster": {"worker": ["h1:2222", "h2:2222"]}, "task": {"type": "worker", "index": 1}}'
    """
    cluster: dict[str, list[str]] = {}
    if chief:
        cluster[CHIEF] = [chief]
    if workers:
        cluster[WORKER] = list(workers)
    text = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    parse_tf_config(text)
    return text


class ClusterResolver:
    """What every resolver offers: the cluster, this task, and the collective-group view.

    Subclasses set `_cluster`, `_task_type`, `_task_id`, `_rpc_layer`, `_environment`.
    `cluster_spec()`, `task_type`, `task_id`, `master()`, `rpc_layer`, `environment` and
    `num_accelerators()` follow `tf.distribute.cluster_resolver`; `is_chief`, `worker_index`,
    `num_workers`, `worker_addresses` and `chief_address` describe the collective group
    (chief first, then workers).
    """

    _cluster: ClusterSpec
    _task_type: str | None
    _task_id: int | None
    _rpc_layer: str | None = None
    _environment: str | None = None

    def _warn_about_ps(self) -> None:
        if PS in self._cluster.jobs:
            warnings.warn(
                f"TF_CONFIG lists {self._cluster.num_tasks(PS)} `ps` task(s). "
                "MultiWorkerMirroredStrategy has no parameter servers: they are ignored and never "
                "waited for. Remove the `ps` job to silence this warning.",
                stacklevel=3,
            )

    def cluster_spec(self) -> ClusterSpec:
        """The whole cluster as a `ClusterSpec` (every job, `ps` and `evaluator` included)."""
        return ClusterSpec(self._cluster)

    @property
    def task_type(self) -> str | None:
        """This task's job name (`"worker"`, `"chief"`, ...), or None on a single worker."""
        return self._task_type

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        self._task_type = value

    @property
    def task_id(self) -> int | None:
        """This task's index within its job, or None on a single worker."""
        return self._task_id

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        self._task_id = value

    @property
    def rpc_layer(self) -> str | None:
        """The RPC protocol prefix used by `master()` (TF_CONFIG's `rpc_layer`)."""
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def environment(self) -> str | None:
        """The `environment` given to the constructor (e.g. `"google"`), or None."""
        return self._environment

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of a task (this one by default), prefixed with `rpc_layer://`; '' if unknown."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None or not self._cluster:
            return ""
        address = self._cluster.task_address(task_type, task_id)
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """Local accelerators of the active Keras backend, e.g. `{"GPU": 2}`; `{}` on CPU."""
        del task_type, task_id, config_proto
        from keras_mwms import devices

        count = devices.local_gpu_count()
        return {"GPU": count} if count else {}

    @property
    def group_tasks(self) -> list[tuple[str, int]]:
        """The collective group in rank order: `chief:0` (if any), then every `worker`."""
        tasks: list[tuple[str, int]] = []
        for job in (CHIEF, WORKER):
            if job in self._cluster.jobs:
                tasks += [(job, index) for index in range(self._cluster.num_tasks(job))]
        return tasks

    @property
    def worker_addresses(self) -> list[str]:
        """`host:port` of every member of the collective group, in rank order."""
        return [self._cluster.task_address(job, index) for job, index in self.group_tasks]

    @property
    def num_workers(self) -> int:
        """How many processes train together (chief + workers); 1 on a single worker."""
        return max(1, len(self.group_tasks))

    @property
    def worker_index(self) -> int | None:
        """This task's rank in the collective group, or None for an evaluator or `ps` task."""
        if not self._cluster:
            return 0
        try:
            return self.group_tasks.index((self.task_type, self.task_id))
        except ValueError:
            return None

    @property
    def is_chief(self) -> bool:
        """True for the task that writes checkpoints: `chief:0`, else `worker:0`."""
        return self.worker_index == 0

    @property
    def chief_address(self) -> str | None:
        """`host:port` of the chief, or None on a single worker."""
        addresses = self.worker_addresses
        return addresses[0] if addresses else None

    @property
    def task_name(self) -> str:
        """`"worker:1"`-style name of this task, for messages."""
        return f"{self.task_type}:{self.task_id}" if self.task_type is not None else "worker:0"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(task={self.task_name}, worker_index={self.worker_index}, "
                f"num_workers={self.num_workers}, cluster={self._cluster.as_dict()})")


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this task from the `TF_CONFIG` environment variable.

    Same API as `tf.distribute.cluster_resolver.TFConfigClusterResolver`, plus the
    collective-group view (`is_chief`, `worker_index`, `num_workers`). Without `TF_CONFIG`
    (unset or empty) it describes a single worker and warns once, so a job that was meant to
    be distributed never runs alone silently.

    Example:

    >>> import os, json
    >>> os.environ["TF_CONFIG"] = json.dumps({
    ...     "cluster": {"worker": ["localhost:2001", "localhost:2002"]},
    ...     "task": {"type": "worker", "index": 1}})
    >>> resolver = TFConfigClusterResolver()
    >>> resolver.task_type, resolver.task_id, resolver.num_workers, resolver.is_chief
    ('worker', 1, 2, False)
    >>> resolver.master(rpc_layer="grpc")
    'grpc://localhost:2002'
    >>> del os.environ["TF_CONFIG"]

    Args:
        task_type: overrides `task.type` of `TF_CONFIG`.
        task_id: overrides `task.index` of `TF_CONFIG`.
        rpc_layer: overrides `rpc_layer` of `TF_CONFIG`.
        environment: the environment name (like TensorFlow, not read from `TF_CONFIG`).
        tf_config: the JSON to read instead of the environment variable (for tests and tools).
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None, environment: str | None = None,
                 tf_config: str | None = None):
        text = os.environ.get(TF_CONFIG_ENV, "") if tf_config is None else tf_config
        self.tf_config_text = text
        self._session_master: str | None = None
        if not text.strip():
            self._cluster = ClusterSpec()
            self._task_type, self._task_id = task_type, task_id
            self._rpc_layer, self._environment = rpc_layer, environment
            return
        config = parse_tf_config(text)
        self._session_master = config["session_master"]
        self._cluster = ClusterSpec(config["cluster"])
        self._task_type = task_type if task_type is not None else config["task_type"]
        self._task_id = task_id if task_id is not None else config["task_id"]
        self._rpc_layer = rpc_layer if rpc_layer is not None else config["rpc_layer"]
        # Like TensorFlow's resolver: `environment` comes from the argument only.
        self._environment = environment
        self._warn_about_ps()

    @property
    def is_single_worker(self) -> bool:
        """True when no `TF_CONFIG` was given."""
        return not self._cluster

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The TF1 session master, by TensorFlow's `TFConfigClusterResolver` rules.

        `TF_CONFIG`'s `session_master` when it has one; `''` when the cluster holds a single
        task (or none), whatever the arguments, because a lone task runs its session in
        process; otherwise the task's address (this task by default), prefixed with
        `rpc_layer://` unless the layer is empty. An `rpc_layer` argument, even `''`, wins over
        `TF_CONFIG`'s.
        """
        if self._session_master is not None:
            return self._session_master
        jobs = self._cluster.jobs
        if not jobs or (len(jobs) == 1 and self._cluster.num_tasks(jobs[0]) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        address = self._cluster.task_address(task_type, task_id)
        layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return f"{layer}://{address}" if layer else address


class SimpleClusterResolver(ClusterResolver):
    """A resolver for an explicit cluster, like `tf.distribute.cluster_resolver.SimpleClusterResolver`.

    The spec is validated with the same rules as `TF_CONFIG`.

    Example:

    >>> resolver = SimpleClusterResolver(
    ...     ClusterSpec({"chief": ["h0:2222"], "worker": ["h1:2222"]}),
    ...     task_type="worker", task_id=0)
    >>> resolver.worker_index, resolver.num_workers, resolver.chief_address
    (1, 2, 'h0:2222')

    Args:
        cluster_spec: a `ClusterSpec` or a `{job: [address, ...]}` mapping.
        task_type: this task's job name.
        task_id: this task's index within its job.
        rpc_layer: the RPC protocol prefix for `master()`.
        environment: free-form environment name.
    """

    def __init__(self, cluster_spec: ClusterSpec | Mapping[str, Sequence[str]], task_type: str,
                 task_id: int, rpc_layer: str | None = None, environment: str | None = None):
        cluster = _validate_cluster(ClusterSpec(cluster_spec).as_dict())
        _validate_task({"type": task_type, "index": task_id}, cluster)
        self._cluster = ClusterSpec(cluster)
        self._task_type, self._task_id = task_type, task_id
        self._rpc_layer, self._environment = rpc_layer, environment
        self._warn_about_ps()

    @property
    def is_single_worker(self) -> bool:
        return False
