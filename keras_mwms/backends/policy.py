"""What is the same on every backend, written once: the policy behind the collective port.

Each backend adapter supplies a small collective port (`Backend.all_reduce`, `all_gather`,
`broadcast_object`, see `keras_mwms.backends.base`); everything decided *with* those
collectives lives here and imports no ML framework:

- **row checks** — every worker must pass arrays of one length (else different step counts
  would pair collectives wrongly), and tf.data inputs should start with the same batch
  (`check_same_rows`: one all-reduce carries both);
- **partial-batch placement** — `keras_mwms.data.replica_slices` is the one contract: a global
  batch is split in rank order, a short last batch fills replicas in order, so trailing
  replicas may get zero rows; such a replica steps on `dummy_row`, a zero-weight row, so every
  worker still joins every collective;
- **metric reduction** — `metric_reduction` says how one metric state variable combines over
  workers (sum, max, min, or the chief's), `GlobalMetricState` swaps the global state in while
  logs are computed;
- **float16 overflow** — `float16_gradients`: which summed gradients one process would have
  computed in float16, so that a sum beyond float16's range skips the step under a
  LossScaleOptimizer, as one process's inf would (`FLOAT16_OVERFLOW`);
- **BatchNormalization** — `global_batch_norm_moments`: whether a layer in training mode
  normalizes over the global batch (the default, one process's result) or over each worker's
  shard (`CommunicationOptions(batch_norm_statistics="per_worker")`); each backend computes
  the moments its way, and keeps moving statistics identical on every worker either way;
- **the collective engine** — `choose_implementation`: which of RING or NCCL a request
  (AUTO / RING / NCCL) gets on this worker; each backend maps the answer to its engine name;
- **lost workers** — `worker_label`, `lost_worker_message` and `raise_worker_lost`: one message
  naming the lost workers, one bounded exit (`CommunicationOptions.lost_worker_exit_seconds`).

Example:

>>> lost_worker_message(0, ["worker 1 (worker:1 at h1:2222)"], "gradient all-reduce", "Connection reset")[:71]
'keras_mwms worker 0: lost worker 1 (worker:1 at h1:2222) during gradien'
"""

from __future__ import annotations

import faulthandler
import re
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms import diagnostics
from keras_mwms.backends.keras_api import attributes
from keras_mwms.diagnostics.ledger import LEDGER
from keras_mwms.errors import WorkerLostError
from keras_mwms.log import get_logger
from keras_mwms.startup.advice import advice_for

logger = get_logger(__name__)

# -- nests --------------------------------------------------------------------------------


def map_nest(function: Callable[[Any], Any], nest: Any) -> Any:
    """Applies `function` to every leaf of a tuple/list/dict nest (None stays None).

    Example:

    >>> map_nest(lambda leaf: leaf * 2, {"a": (1, 2), "b": [3], "c": None})
    {'a': (2, 4), 'b': [6], 'c': None}
    """
    if nest is None:
        return None
    if isinstance(nest, dict):
        return {key: map_nest(function, value) for key, value in nest.items()}
    if isinstance(nest, (tuple, list)):
        mapped = [map_nest(function, value) for value in nest]
        return type(nest)(mapped) if not hasattr(nest, "_fields") else type(nest)(*mapped)
    return function(nest)


def rows_of(nest: Any) -> int:
    """Rows (leading dimension) of the first array leaf of a nest; 0 when it has none.

    Example:

    >>> rows_of((np.zeros((3, 2)), np.zeros(3)))
    3
    """
    found: list[int] = []

    def visit(leaf):
        shape = getattr(leaf, "shape", None)
        if not found and shape is not None and len(shape) > 0:
            found.append(int(shape[0]))
        return leaf

    map_nest(visit, nest)
    return found[0] if found else 0


def dummy_row(batch: Any, zeros: Callable[[tuple, Any], Any] = np.zeros) -> Any:
    """One all-zero row shaped like `batch`, for a replica whose shard of a step is empty.

    The row takes part in the step with zero weight, so the worker joins the step's collectives
    and contributes nothing. `zeros(shape, dtype)` builds a leaf (NumPy by default; a backend
    passes its own to stay on device).

    Example:

    >>> row = dummy_row((np.ones((0, 3), np.float32), np.ones((0,), np.int64)))
    >>> [(leaf.shape, leaf.dtype.name) for leaf in row]
    [((1, 3), 'float32'), ((1,), 'int64')]
    """
    def zero_row(leaf):
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0:
            return leaf
        return zeros((1, *tuple(shape[1:])), leaf.dtype)

    return map_nest(zero_row, batch)


# -- row checks ---------------------------------------------------------------------------


def idle_replicas_warning(global_batch_rows: int | None, num_replicas: int) -> str | None:
    """The warning when a global batch has fewer rows than there are replicas, else None.

    Example:

    >>> print(idle_replicas_warning(1, 2))  # doctest: +ELLIPSIS
    keras_mwms: the global batch of 1 row is smaller than the 2 replicas: 1 of them gets no rows ...
    >>> idle_replicas_warning(2, 2) is None, idle_replicas_warning(None, 2) is None
    (True, True)
    """
    if global_batch_rows is None or not 0 < global_batch_rows < num_replicas:
        return None
    idle = num_replicas - global_batch_rows
    return (f"keras_mwms: the global batch of {global_batch_rows} row{'s' if global_batch_rows > 1 else ''} "
            f"is smaller than the {num_replicas} replicas: {idle} of them get{'s' if idle == 1 else ''} "
            "no rows in each step and only wait (training stays correct: every step still takes the "
            f"whole global batch). Pass batch_size={num_replicas} or more to use every worker.")


_warned_idle = False


def warn_idle_replicas(port: Any, x: Any, batch_size: int | None, stacklevel: int) -> None:
    """Warns once per process when fit's global batch leaves replicas without rows."""
    global _warned_idle
    from keras_mwms.data import global_batch_rows

    replicas = getattr(port, "num_replicas_in_sync", port.num_workers)
    message = idle_replicas_warning(global_batch_rows(x, batch_size), replicas)
    if message is not None and not _warned_idle:
        _warned_idle = True
        if port.worker_index == 0:   # the same on every worker: the chief says it
            warnings.warn(message, stacklevel=stacklevel + 1)


def check_same_rows(port: Any, x: Any, what: str, digest: str | None = None,
                    stacklevel: int = 4, batch_size: int | None = None) -> None:
    """Every worker must pass arrays of one length; checked with one all-reduce, before step 1.

    Different lengths give workers different step counts, so their collectives would pair
    wrongly or wait forever: every worker raises the same clear `ValueError` instead. `digest`
    (`keras_mwms.data.first_batch_digest` of a tf.data input, None otherwise) rides in the
    same all-reduce; when the workers' digests differ every worker warns that their datasets
    start differently (a shuffle seeded differently per worker, or not at all).

    `port` offers `num_workers`, `worker_index` and `all_reduce(array, op)`. `batch_size`
    (fit's argument) also checks that the global batch has a row for every replica
    (`warn_idle_replicas`).

    Example (one worker: nothing to compare, no collective):

    >>> class One: num_workers, worker_index = 1, 0
    >>> check_same_rows(One(), np.zeros((4, 2)), "x")
    """
    from keras_mwms.data import different_first_batches_warning, leading_rows, uneven_rows_error

    if port.num_workers == 1:
        return
    if what == "model.fit()":
        warn_idle_replicas(port, x, batch_size, stacklevel)
    rows = leading_rows(x)
    # Per worker: rows + 1 (0: not arrays), then the 64-bit digest as two exact 32-bit halves
    # (-1: none); float64 holds both exactly.
    mine = np.zeros((port.num_workers, 3), np.float64)
    mine[port.worker_index, 0] = 0 if rows is None else rows + 1
    value = -1 if digest is None else int(digest, 16)
    mine[port.worker_index, 1:] = [-1.0, -1.0] if value < 0 else [value >> 32, value & 0xFFFFFFFF]
    everyone = np.asarray(port.all_reduce(mine, "sum"))
    error = uneven_rows_error([int(count) - 1 if count else None for count in everyone[:, 0].tolist()],
                              port.worker_index, what)
    if error is not None:
        raise error
    digests = [None if high < 0 else f"{int(high):08x}{int(low):08x}"
               for high, low in everyone[:, 1:].tolist()]
    message = different_first_batches_warning(digests, what)
    if message is not None:
        warnings.warn(message, stacklevel=stacklevel)


# -- metrics ------------------------------------------------------------------------------
_MAX_NAMES = ("max", "maximum")
_MIN_NAMES = ("min", "minimum")


def metric_reduction(metric: Any, variable: Any) -> str:
    """How a metric state variable combines across workers: "sum", "max", "min" or "first".

    A metric may declare `keras_mwms_reductions = {"variable_name": "max"}` (also when Keras
    holds it inside the model's compiled metrics: the metric that owns `variable` is asked);
    otherwise variables whose name has the word max/maximum or min/minimum (`max`,
    `running_max`, `min_value`) use max/min, `only_first_replica` ones come from the chief and
    everything else (totals, counts, confusion matrices) is summed.

    Example:

    >>> from types import SimpleNamespace as Object
    >>> metric = Object(keras_mwms_reductions={"peak": "max"})
    >>> [metric_reduction(metric, Object(name=name)) for name in ("peak", "total", "min", "running_max")]
    ['max', 'sum', 'min', 'max']
    >>> peak = Object(name="peak")
    >>> compiled = Object(metrics=[Object(variables=[peak], keras_mwms_reductions={"peak": "max"})])
    >>> metric_reduction(compiled, peak)
    'max'
    """
    declared = getattr(_owner(metric, variable), "keras_mwms_reductions", {}) or {}
    name = variable.name.rsplit("/", 1)[-1]
    if name in declared:
        return declared[name]
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    if words & set(_MAX_NAMES):
        return "max"
    if words & set(_MIN_NAMES):
        return "min"
    if getattr(variable, "aggregation", "sum") == "only_first_replica":
        return "first"
    return "sum"


def _owner(metric: Any, variable: Any) -> Any:
    """The metric among `metric` and the metrics it holds (Keras' compiled metrics hold the
    user's) whose own variables include `variable`."""
    for inner in getattr(metric, "metrics", None) or ():
        if any(held is variable for held in getattr(inner, "variables", ())):
            return _owner(inner, variable)
    return metric


def reduce_gathered(parts: np.ndarray, op: str) -> np.ndarray:
    """Combines the workers' rows of `parts` in worker order, so every worker gets the same bits.

    Example:

    >>> parts = np.array([[1.0, 5.0], [3.0, 2.0]])
    >>> [reduce_gathered(parts, op).tolist() for op in ("sum", "max", "min", "first")]
    [[4.0, 7.0], [3.0, 5.0], [1.0, 2.0], [1.0, 5.0]]
    """
    if op == "first":
        return parts[0]
    if op == "max":
        return parts.max(axis=0)
    if op == "min":
        return parts.min(axis=0)
    if op != "sum":
        raise ValueError(f"Unknown metric reduction {op!r}; expected 'sum', 'max', 'min' or 'first'.")
    value = parts[0].copy()
    for part in parts[1:]:
        value = value + part
    return value


def _read(variable: Any) -> np.ndarray:
    value = variable.value
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return np.array(value)


class GlobalMetricState:
    """Context: metric state variables hold the global (all-worker) state, then local again.

    One all-gather per dtype of every metric state, reduced in worker order
    (`reduce_gathered`), so every worker computes identical results. `port` offers
    `all_gather(array) -> array of shape (num_workers, ...)`.

    Example (one worker: the gather returns its own state):

    >>> from types import SimpleNamespace as Object
    >>> class Variable:
    ...     def __init__(self, name, value): self.name, self.value = name, np.array(value)
    ...     def assign(self, value): self.value = np.array(value)
    >>> model = Object(metrics=[Object(variables=[Variable("total", [2.0])])])
    >>> port = Object(all_gather=lambda flat: flat[None])
    >>> with GlobalMetricState(model, port):
    ...     model.metrics[0].variables[0].value.tolist()
    [2.0]
    """

    def __init__(self, model: Any, port: Any):
        self.model = model
        self.port = port

    def __enter__(self):
        pairs = [(metric, variable) for metric in self.model.metrics for variable in metric.variables]
        self.pairs = pairs
        self.saved = [_read(variable) for _, variable in pairs]
        for dtype in dict.fromkeys(value.dtype for value in self.saved):
            indices = [i for i, value in enumerate(self.saved) if value.dtype == dtype]
            gathered = np.asarray(self.port.all_gather(
                np.concatenate([self.saved[i].ravel() for i in indices])))
            offset = 0
            for i in indices:
                size = self.saved[i].size
                value = reduce_gathered(gathered[:, offset:offset + size], metric_reduction(*pairs[i]))
                offset += size
                pairs[i][1].assign(value.reshape(self.saved[i].shape).astype(dtype))
        return self

    def __exit__(self, *exc):
        for (_, variable), saved in zip(self.pairs, self.saved):
            variable.assign(saved)
        return False


# -- float16 overflow ---------------------------------------------------------------------

# float16 rounds every |x| >= 65520 to inf (65504 is its largest finite value).
FLOAT16_OVERFLOW = 65520.0


def float16_gradients(model: Any, variables: list | None = None) -> list[bool]:
    """Per trainable variable: whether one process computes its gradient in float16.

    Under `mixed_float16` a layer computing in float16 casts its float32 variables to float16,
    so the whole batch's gradient of such a variable is a float16 value, inf when its sum over
    the batch leaves float16's range. Workers sum float32 gradients of their shards, which stay
    finite: a summed gradient at or beyond `FLOAT16_OVERFLOW` is where one process saw inf.

    Example:

    >>> import types
    >>> kernel = types.SimpleNamespace(dtype="float32", _autocast=True)
    >>> head = types.SimpleNamespace(dtype="float32", _autocast=True)
    >>> layers = [types.SimpleNamespace(compute_dtype="float16", _trainable_variables=[kernel]),
    ...           types.SimpleNamespace(compute_dtype="float32", _trainable_variables=[head])]
    >>> model = types.SimpleNamespace(trainable_variables=[kernel, head],
    ...                               _flatten_layers=lambda include_self=True: layers)
    >>> float16_gradients(model)
    [True, False]
    """
    in_float16 = set()
    for layer in attributes.flatten_layers(model, include_self=True):
        if getattr(layer, "compute_dtype", None) != "float16":
            continue
        for variable in attributes.layer_trainable_variables(layer):
            if str(variable.dtype) == "float16" or attributes.variable_autocasts(variable):
                in_float16.add(id(variable))
    return [id(variable) in in_float16
            for variable in (model.trainable_variables if variables is None else variables)]


# -- the collective engine ----------------------------------------------------------------


def accumulation_steps(optimizer: Any) -> int:
    """K when `optimizer` accumulates gradients in one all-reduce per optimizer step, else 0.

    A plain Keras optimizer with `gradient_accumulation_steps=K`: its micro-steps keep their
    gradients local and the K-th all-reduces their sum (torch, the JAX flat path). A
    `LossScaleOptimizer` (it decides overflow on each micro-step's all-reduced gradient) and
    Keras' `MultiOptimizer` all-reduce every micro-step instead.

    Example:

    >>> from types import SimpleNamespace as Optimizer
    >>> accumulation_steps(Optimizer(gradient_accumulation_steps=4)), accumulation_steps(Optimizer())
    (4, 0)
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if not steps or type(optimizer).__name__ in ("LossScaleOptimizer", "MultiOptimizer"):
        return 0
    return int(steps)


def global_batch_norm_moments(layer: Any, options: Any) -> bool:
    """Whether BatchNormalization `layer` in training mode normalizes over the global batch.

    Yes for `synchronized=True`, and for an ordinary layer unless the user chose per-worker
    statistics (`CommunicationOptions.batch_norm_statistics="per_worker"`): the moments of the
    global batch are what one process computes.

    Example:

    >>> from types import SimpleNamespace as Object
    >>> ordinary = Object(synchronized=False)
    >>> global_batch_norm_moments(ordinary, Object(batch_norm_statistics="global"))
    True
    >>> global_batch_norm_moments(ordinary, Object(batch_norm_statistics="per_worker"))
    False
    >>> global_batch_norm_moments(Object(synchronized=True), Object(batch_norm_statistics="per_worker"))
    True
    """
    return bool(getattr(layer, "synchronized", False)) or options.batch_norm_statistics != "per_worker"


def choose_implementation(requested: Any, gpu_count: int, backend: str, ring_engine: str,
                          nccl_usable: bool | None = None) -> Any:
    """RING or NCCL for a requested `CommunicationImplementation`: the rule every backend follows.

    AUTO is NCCL when this worker sees a GPU and NCCL is usable, RING otherwise; RING is RING;
    NCCL is NCCL when usable, otherwise RING with a warning naming what this worker lacks.
    `nccl_usable` defaults to `gpu_count > 0`. A backend that cannot fall back (torch raises
    `NcclUnavailableError`) checks before calling.

    Example:

    >>> from keras_mwms.communication import CommunicationImplementation as Impl
    >>> choose_implementation(Impl.AUTO, 0, "JAX", "gloo").name, choose_implementation(Impl.AUTO, 2, "JAX", "gloo").name
    ('RING', 'NCCL')
    """
    from keras_mwms.communication import CommunicationImplementation

    usable = gpu_count > 0 if nccl_usable is None else nccl_usable
    if requested is CommunicationImplementation.RING:
        return CommunicationImplementation.RING
    if usable:
        return CommunicationImplementation.NCCL
    if requested is CommunicationImplementation.NCCL:
        missing = "has no GPU" if gpu_count == 0 else "cannot use NCCL"
        warnings.warn(
            f"CommunicationImplementation.NCCL was requested but this worker {missing}: the {backend} "
            f"collectives use RING ({ring_engine}) instead. Request RING or AUTO to silence this.",
            stacklevel=4,
        )
    return CommunicationImplementation.RING



def exclusive_gpus_reason(backend: str, requested: Any, gpu_count: int) -> str | None:
    """Why workers of this job must not share a GPU (the rendezvous then refuses), or None.

    `requested` is the `CommunicationImplementation` asked for; `gpu_count` the GPUs this worker
    claims. `choose_implementation` decides AUTO/NCCL/RING as the engines do; JAX always needs
    one GPU per worker (its GPU collectives are NCCL). The rendezvous uses the answer to refuse
    two workers claiming one GPU, naming both, before any engine starts.

    Example:

    >>> from keras_mwms.communication import CommunicationImplementation as Impl
    >>> exclusive_gpus_reason("torch", Impl.RING, 1) is None, exclusive_gpus_reason("torch", Impl.AUTO, 0) is None
    (True, True)
    >>> exclusive_gpus_reason("torch", Impl.AUTO, 1).split(":")[0]
    'CommunicationImplementation.AUTO picks NCCL on GPUs'
    """
    if gpu_count <= 0:
        return None
    from keras_mwms.communication import CommunicationImplementation
    from keras_mwms.devices.assignment import SET_A_LOCAL_RANK

    fix = ("NCCL cannot run two ranks on one GPU (it would fail later with 'Duplicate GPU "
           f"detected'). Give each worker its own GPU: {SET_A_LOCAL_RANK}")
    if backend == "jax":
        return (f"JAX runs collectives between GPUs with NCCL whatever is asked (here "
                f"CommunicationImplementation.{requested.name}; RING selects gloo for CPU arrays "
                "only): " + fix + ".")
    chosen = choose_implementation(requested, gpu_count, backend, "ring", nccl_usable=True)
    if chosen is not CommunicationImplementation.NCCL:
        return None
    verb = "picks" if requested is CommunicationImplementation.AUTO else "is"
    return (f"CommunicationImplementation.{requested.name} {verb} NCCL on GPUs: " + fix
            + "; or request CommunicationImplementation.RING to share GPUs.")


# -- lost workers -------------------------------------------------------------------------


def worker_label(resolver: Any, rank: int) -> str:
    """How every message names a worker: `worker R (job:index at host:port)`.

    Example:

    >>> from keras_mwms.startup.cluster import SimpleClusterResolver
    >>> worker_label(SimpleClusterResolver({"worker": ["h0:1", "h1:2"]}, "worker", 0), 1)
    'worker 1 (worker:1 at h1:2)'
    """
    job, index = resolver.group_tasks[rank]
    return f"worker {rank} ({job}:{index} at {resolver.worker_addresses[rank]})"


def check_started_group(port: Any, runtime: str, found_size: int, found_rank: int, starter: str) -> None:
    """Raises unless a collective runtime started before the strategy (Ray, a launcher, the
    script) is the one the cluster describes: the same worker count, this worker at its index.

    Example:

    >>> import types
    >>> port = types.SimpleNamespace(num_workers=2, worker_index=1, resolver=None)
    >>> check_started_group(port, "torch.distributed", 2, 1, "init_process_group")   # the cluster's
    """
    if (found_size, found_rank) == (port.num_workers, port.worker_index):
        return
    source = getattr(port.resolver, "source", None) or "TF_CONFIG"
    raise RuntimeError(
        f"keras_mwms worker {port.worker_index}: {runtime} was already initialised in this process "
        f"with {found_size} process(es), this one at index {found_rank}, but {source} describes "
        f"{port.num_workers} worker(s) with this one at index {port.worker_index}. Let "
        f"keras_mwms.MultiWorkerMirroredStrategy() start {runtime} (remove the {starter} call), or "
        "make its process count and index match the cluster.")


def lost_worker_message(worker_index: int, lost: list[str], where: str, underlying: str,
                        restart: str = "Restart the whole job (`python -m keras_mwms.launch --max-restarts N`) "
                                       "and resume with keras_mwms.callbacks.BackupAndRestore.") -> str:
    """The one message every backend gives when a peer is lost (see `raise_worker_lost`).

    Example:

    >>> print(lost_worker_message(1, [], "barrier", "Connection reset by peer"))  # doctest: +ELLIPSIS
    keras_mwms worker 1: lost an unidentified peer worker during barrier: Connection reset by peer. ...
    """
    first_line = underlying.strip().splitlines()[0][:300] if underlying.strip() else "no detail"
    return (
        f"keras_mwms worker {worker_index}: lost {', '.join(lost) or 'an unidentified peer worker'} "
        f"during {where}: {first_line.rstrip('.')}. Synchronous training cannot continue; every "
        f"worker stops. {restart}"
    )


def start_exit_watchdog(seconds: float) -> None:
    """Ends this process (exit status 1, all threads' tracebacks on stderr) in `seconds` at most.

    A worker that lost a peer must not hang in its backend's teardown, which may wait for the
    dead peer; the watchdog runs outside the interpreter lock, so it fires even then.
    """
    faulthandler.dump_traceback_later(seconds, exit=True)


def raise_worker_lost(backend: Any, where: str, error: BaseException, lost_ranks: list[int]) -> None:
    """Reports a lost peer the same way on every backend, arms the bounded exit, and raises.

    `backend` offers `resolver`, `worker_index` and `options.lost_worker_exit_seconds`.

    Example:

    >>> from types import SimpleNamespace as Object
    >>> from keras_mwms.startup.cluster import SimpleClusterResolver
    >>> from keras_mwms.communication import CommunicationOptions
    >>> resolver = SimpleClusterResolver({"worker": ["h0:1", "h1:2"]}, "worker", 0)
    >>> backend = Object(resolver=resolver, worker_index=0,
    ...                  options=CommunicationOptions(lost_worker_exit_seconds=600))
    >>> try:
    ...     raise_worker_lost(backend, "barrier", OSError("Connection reset"), [1])
    ... except WorkerLostError as error:
    ...     faulthandler.cancel_dump_traceback_later()
    ...     print(error.lost_workers, "lost worker 1 (worker:1 at h1:2)" in str(error))
    [1] True
    """
    # A peer that answers the side channel is not lost: a desync is named as such and ends
    # the job there (`keras_mwms.diagnostics.confirm_lost`); otherwise this goes on.
    diagnostics.confirm_lost(where)
    labels = [worker_label(backend.resolver, rank) for rank in lost_ranks]
    step = LEDGER.step if LEDGER.enabled else 0
    message = lost_worker_message(backend.worker_index, labels, f"{where} (train step {step})" if step else where,
                                  str(error) or type(error).__name__,
                                  restart=advice_for(backend.resolver).restart)
    logger.error(message)
    start_exit_watchdog(backend.options.lost_worker_exit_seconds)
    raise WorkerLostError(message, lost_workers=lost_ranks, where=where) from error
