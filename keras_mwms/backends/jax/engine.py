"""The JAX engine: `jax.distributed` start-up, the collective port, and `JaxBackend` itself.

Start-up (after keras_mwms' rendezvous, before any JAX computation):

1. choose the collective engine: AUTO → NCCL on GPU, gloo on CPU; RING → gloo; NCCL on a CPU
   machine → a warning and gloo;
2. `jax.distributed.initialize` on the chief's `TF_CONFIG` address (the rendezvous has just
   released that port), with bounded initialization, heartbeat (`heartbeat_timeout_seconds`) and
   shutdown timeouts; the coordination service listens on the chief's `TF_CONFIG` host, and
   gloo on each worker's `TF_CONFIG` host, when those are addresses of the machine (else JAX's
   defaults);
3. choose the training path (`CommunicationOptions.jax_path`, see
   `keras_mwms.backends.jax.step`):

   * **flat** (default with one device per worker): ordinary local variables, identical on
     every worker; Keras' train step split around ONE flat all-reduce of the gradients per
     step, outside Keras' jit — 1.4–6× cheaper than XLA's fused all-reduce on CPU gloo.
     Batch logs are global (metric states ride in the gradient all-reduce). A model the flat
     path cannot run exactly (BatchNormalization, an own `train_step`) trains on the
     DataParallel path instead;
   * **dataparallel** (several local devices, or asked for): a `keras.distribution.DataParallel`
     over `jax.devices()` — all devices of all workers, so `jax_num_cpu_devices=2` on 2 workers
     gives 4 replicas. Keras' jitted train step runs SPMD over the global batch: XLA inserts
     the gradient all-reduce; metrics and BatchNormalization statistics are computed over the
     global batch, exactly as one process. With gradient accumulation or compression the step
     runs in `shard_map` and keras_mwms issues the gradient collective
     (`keras_mwms.backends.jax.sharded_step`).

What Keras 3.15.1 lacks on these paths is the patch table of `keras_mwms.backends.jax.patches`
(the strategy installs it after `join`). A peer lost mid-collective becomes
`keras_mwms.WorkerLostError` naming it (`keras_mwms.backends.jax.faults`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms import devices
from keras_mwms.backends import policy
from keras_mwms.backends.base import Backend
from keras_mwms.backends.jax import patches, step, surface
from keras_mwms.backends.jax.faults import JaxFaults, coordination_client
from keras_mwms.backends.keras_api import attributes
from keras_mwms.backends.patches import ObjectState, PatchTable
from keras_mwms.communication import CommunicationImplementation
from keras_mwms.errors import StrategyCreatedTooLateError
from keras_mwms.log import get_logger

logger = get_logger(__name__)
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 120.0
# JAX's coordination service aborts every worker when one has sent no heartbeat for this long.
# It follows `CommunicationOptions.timeout_seconds` (`heartbeat_timeout_seconds`), never below
# this floor: a short stall of a loaded machine must not end a healthy job.
MIN_HEARTBEAT_TIMEOUT_SECONDS = 20
SHUTDOWN_TIMEOUT_SECONDS = 20


def likely_gpu_count() -> int:
    """GPUs this JAX worker will see, judged before JAX starts (starting it would be too early).

    0 without a CUDA/ROCm plugin, with `JAX_PLATFORMS` excluding GPUs, or with
    `CUDA_VISIBLE_DEVICES` hiding them; otherwise the visible GPUs (`CUDA_VISIBLE_DEVICES`, else
    nvidia-smi), at least 1 (`keras_mwms.devices.jax_gpu_count_before_start`).

    Example:

    >>> from unittest import mock
    >>> with mock.patch.dict("os.environ", {"JAX_PLATFORMS": "cpu"}):
    ...     likely_gpu_count()
    0
    """
    return devices.jax_gpu_count_before_start()


def resolve_engine(implementation: CommunicationImplementation, gpu_count: int) -> str:
    """The JAX collective engine a request gets on a worker with `gpu_count` GPUs.

    `policy.choose_implementation` decides; RING is gloo (CPU collectives), NCCL is XLA's NCCL.
    RING on a GPU worker warns: JAX runs GPU collectives with NCCL whatever is asked.

    Example:

    >>> resolve_engine(CommunicationImplementation.AUTO, 0), resolve_engine(CommunicationImplementation.AUTO, 1)
    ('gloo', 'nccl')
    """
    if implementation is CommunicationImplementation.RING and gpu_count > 0:
        warnings.warn("CommunicationImplementation.RING: JAX runs GPU collectives with NCCL; "
                      "gloo is used for CPU collectives only.", stacklevel=3)
    chosen = policy.choose_implementation(implementation, gpu_count, "JAX", "gloo")
    return "nccl" if chosen is CommunicationImplementation.NCCL else "gloo"


class JaxBackend(Backend):
    """keras_mwms on `KERAS_BACKEND=jax` (see the module docstring for the design).

    Created by `keras_mwms.MultiWorkerMirroredStrategy`; users do not build it themselves.

    Example:

    ```python
    strategy = keras_mwms.MultiWorkerMirroredStrategy()   # KERAS_BACKEND=jax
    strategy.backend.broadcast_object({"run_id": 7})        # the chief's value everywhere
    strategy.backend.pin_path(model, "dataparallel")        # this model skips the flat path
    ```
    """

    name = "jax"

    def __init__(self, resolver, options, tf_config_at_creation: str = ""):
        super().__init__(resolver, options, tf_config_at_creation)
        # This worker's GPUs (`keras_mwms.devices.assignment`); JAX restricts itself to them at join.
        self.gpu_assignment = devices.gpu_assignment("jax", self.num_workers)
        self._engine = resolve_engine(options.implementation, len(self.gpu_assignment.gpus))
        self._joined = False
        self._owns_distributed = False   # False: joined the jax.distributed Ray's JaxTrainer started
        self._distribution = None
        self._mesh = None
        self._collective_counter = 0
        self._path = step.SINGLE
        self._collectives = None
        self._scope_depth = 0
        self._scope_exits = 0
        self._created_in_scope: dict[int, Any] = {}
        self.faults = JaxFaults(self)
        self.models = ObjectState()   # per model: its path, and whether its state was agreed

    @staticmethod
    def version() -> str:
        import jax

        return jax.__version__

    def engine_description(self) -> str:
        return self._engine

    @property
    def collective_timeout_seconds(self) -> float:
        return self.options.timeout_seconds or DEFAULT_COLLECTIVE_TIMEOUT_SECONDS

    @property
    def native_abort_seconds(self) -> float:
        """After this long without a peer's heartbeat JAX aborts every worker natively; the hang
        report must have named the peer before (`keras_mwms.diagnostics.start`)."""
        return float(heartbeat_timeout_seconds(self.collective_timeout_seconds))

    # -- life cycle -----------------------------------------------------------------------
    def join(self) -> None:
        import jax
        import keras

        if self.num_workers == 1 and self.gpu_assignment.narrows:
            jax.config.update("jax_cuda_visible_devices", ",".join(map(str, self.gpu_assignment.gpus)))
        if self.num_workers > 1:
            self._owns_distributed = initialize_distributed(self)
            # Registered after jax.distributed's own exit hook, so it runs first (last in, first
            # out) and can leave without JAX's shutdown barrier after a lost peer or a failure.
            atexit.register(self.faults.exit_now_if_lost)
            self.faults.publish_identity()
        requested = self.options.jax_path
        all_devices = jax.devices()
        if len(all_devices) > 1:
            self._distribution = keras.distribution.DataParallel(devices=all_devices, auto_shard_dataset=False)
            self._mesh = self._distribution.device_mesh.backend_mesh
            if self.num_workers > 1:
                self._collectives = step.FlatCollectives(self.is_chief)
            if self.num_workers > 1 and jax.local_device_count() == 1 and requested != step.DATA_PARALLEL:
                # The flat path: local variables, one flat all-reduce per step. The DataParallel
                # distribution is only entered per model that needs it.
                self._path = step.FLAT
            else:
                if requested == step.FLAT:
                    warnings.warn(f"jax_path='flat': this worker has {jax.local_device_count()} local "
                                  "devices; the flat path serves one device per worker, so keras_mwms "
                                  "uses keras.distribution.DataParallel.", stacklevel=3)
                self._path = step.DATA_PARALLEL
                keras.distribution.set_distribution(self._distribution)
        self._joined = True

    def patch_table(self) -> PatchTable:
        """The JAX rows (see `keras_mwms.backends.jax.patches`): one table for the process."""
        return patches.patch_table(self)

    def leave(self) -> None:
        """Unsets the DataParallel distribution and shuts `jax.distributed` down (every worker must call it).

        `jax.distributed.shutdown()` is a barrier of all workers with a short timeout, so every
        worker first waits until the others have finished too (`JaxFaults.leave_together`); it is
        skipped after a lost peer or a failure on this worker (it would wait for the dead peer;
        the exit hook then ends the process without it). JAX cannot start again in this
        process: after `close()` create no new strategy, start a new process.
        """
        if not self._joined:
            return
        self._joined = False
        if self._path == step.DATA_PARALLEL:
            import keras

            keras.distribution.set_distribution(None)
        if (self._owns_distributed and not self.faults.lost and self.faults.failed is None
                and self.faults.leave_together()):
            import jax

            jax.distributed.shutdown()

    # -- replicas and paths ---------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        import jax

        return jax.device_count() if self._joined else self.num_workers

    @property
    def replicas_per_worker(self) -> int:
        import jax

        return jax.local_device_count() if self._joined else 1

    @property
    def mesh(self):
        """The `jax.sharding.Mesh` over all global devices (None with a single device)."""
        return self._mesh

    @property
    def distribution(self):
        """The `keras.distribution.DataParallel` in use (None with a single device)."""
        return self._distribution

    @property
    def path(self) -> str:
        """How `fit` trains: "flat" (one flat gradient all-reduce per step, the default with one
        device per worker), "dataparallel" (`keras.distribution.DataParallel` over all global
        devices for everything) or "single" (one process, one device)."""
        return self._path

    @property
    def collectives(self):
        """The `step.FlatCollectives` of this cluster (None on a single worker)."""
        return self._collectives

    def model_path(self, model) -> str:
        """The path `model` trains on, decided at its first `fit`/`evaluate`/`predict` (see `step.choose_path`)."""
        if self._path != step.FLAT:
            return self._path
        state = self.models.of(model)
        if getattr(state, "path", None) is None:
            reason = step.can_run_flat(model, self.options)
            state.path = step.choose_path(self.options.jax_path, reason)
            if reason is not None and state.path == step.FLAT:
                step.warn_flat_batch_norm(model, reason)
        return state.path

    def pin_path(self, model, path: str) -> None:
        """Makes `model` train on `path` ("flat" or "dataparallel") while the cluster runs the flat path.

        Set before the model's first `fit` (the benchmark times both paths side by side).
        """
        if path not in (step.FLAT, step.DATA_PARALLEL):
            raise ValueError(f"path must be {step.FLAT!r} or {step.DATA_PARALLEL!r}, got {path!r}")
        self.models.of(model).path = path

    # -- scope ----------------------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager:
        """Variables created inside take the chief's values when the outermost scope is left.

        Creating a variable enters no collective (a worker may build a model or load one alone,
        e.g. `keras.models.load_model` on the chief); the variables created inside the block are
        broadcast from the chief in one collective at its exit, which every worker reaches, so
        `model.get_weights()` agrees everywhere right after the block even when the workers
        seeded differently. Every worker must therefore run the same `with strategy.scope():`
        blocks, as with TensorFlow's MultiWorkerMirroredStrategy.
        """
        return self._scope()

    @contextlib.contextmanager
    def _scope(self):
        inner = (self._distribution.scope() if self._distribution is not None
                 and self._path == step.DATA_PARALLEL else contextlib.nullcontext())
        self._scope_depth += 1
        try:
            with inner:
                yield
        finally:
            self._scope_depth -= 1
            created = list(self._created_in_scope.values()) if self._scope_depth == 0 else []
            if self._scope_depth == 0:
                self._created_in_scope.clear()
        if created and any(attributes.variable_value(variable) is not None for variable in created):
            self._scope_exits += 1
            agree_on_variables(self, created, f"keras_mwms/scope-variables/{self._scope_exits}")

    @property
    def in_scope(self) -> bool:
        return self._scope_depth > 0

    def note_new_variable(self, variable) -> None:
        """Called for every new Keras variable; those created in `scope()` are agreed at its exit."""
        if self._scope_depth and self.num_workers > 1:
            self._created_in_scope[id(variable)] = variable

    # -- tf.distribute-style surface (keras_mwms.backends.jax.surface) --------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        return surface.run(self, fn, args, kwargs)

    def experimental_local_results(self, value: Any) -> tuple:
        return surface.local_results(value)

    def reduce(self, reduce_op: str, value: Any, axis: int | None) -> Any:
        return surface.reduce(self, reduce_op, value, axis)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return surface.distribute_dataset(self, dataset)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        return surface.datasets_from_function(self, dataset_fn)

    # -- collective port ------------------------------------------------------------------
    def _next_key(self, kind: str) -> str:
        self._collective_counter += 1
        return f"keras_mwms/{kind}/{self._collective_counter}"

    def barrier(self, name: str = "barrier") -> None:
        """Waits for every worker, bounded by the collective timeout (`WorkerLostError` after it)."""
        if self.num_workers == 1:
            return
        key = self._next_key(f"barrier/{name}")
        timeout_ms = int(self.collective_timeout_seconds * 1000)
        self.faults.guard(f"barrier {name!r}", lambda: coordination_client().wait_at_barrier(key, timeout_ms))

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        """Worker `root`'s picklable `value` on every worker (through the coordination service)."""
        if self.num_workers == 1:
            return value
        key = self._next_key("broadcast")
        if self.worker_index == root:
            coordination_client().key_value_set_bytes(key, pickle.dumps(value))
            return value
        timeout_ms = int(self.collective_timeout_seconds * 1000)
        data = self.faults.guard("broadcast_object",
                                 lambda: coordination_client().blocking_key_value_get_bytes(key, timeout_ms))
        return pickle.loads(data)

    def all_gather(self, value: np.ndarray) -> np.ndarray:
        """Every worker's host array stacked in worker order (shape `(num_workers,) + value.shape`)."""
        return self._gather(value, "metric all-gather")

    def _gather(self, value: np.ndarray, where: str) -> np.ndarray:
        value = np.asarray(value)
        if self.num_workers == 1:
            return value[None]
        from jax.experimental import multihost_utils

        return np.asarray(self.faults.guard(where, lambda: multihost_utils.process_allgather(value, tiled=False)))

    def all_reduce(self, value: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum, min or max of a host array over workers, in worker order (identical bits)."""
        if op == "sum":
            return self.all_reduce_sum(value)
        gathered = self.all_gather(value)
        return gathered.min(axis=0) if op == "min" else gathered.max(axis=0)

    def all_reduce_sum(self, value: np.ndarray) -> np.ndarray:
        """Sum of a host array over workers, in worker order, so every worker gets identical bits."""
        value = np.asarray(value)
        if self.num_workers == 1:
            return value
        gathered = self._gather(value, "all_reduce_sum")
        total = gathered[0].copy()
        for part in gathered[1:]:
            total = total + part
        return total

    def broadcast_arrays(self, values: list[np.ndarray], root: int = 0) -> list[np.ndarray]:
        """The chief's numpy arrays on every worker, bit for bit, in one XLA collective.

        The bytes travel padded to a power of two, so a model's variables compile a handful of
        collectives, not one per shape (which made start-up slow).
        """
        if self.num_workers == 1:
            return [np.asarray(value) for value in values]
        if root != 0:
            return super().broadcast_arrays(values, root)
        return self.faults.guard("variable broadcast",
                                 lambda: self._collectives.broadcast([np.asarray(value) for value in values]))


def agree_on_variables(backend: JaxBackend, variables: list, key: str) -> None:
    """The chief's values for `variables` on every worker: its list of shapes and dtypes
    through the coordination service (under `key`), then the values in one collective sized by
    that list (so a worker that created other variables still joins the same collective, then
    fails with a clear error instead of leaving the chief waiting)."""
    import jax.numpy as jnp

    variables = [variable for variable in variables if attributes.variable_value(variable) is not None]
    signature = [(tuple(variable.shape), str(variable.dtype)) for variable in variables]
    timeout_ms = int(backend.collective_timeout_seconds * 1000)

    def chief_list():
        if backend.is_chief:
            coordination_client().key_value_set(key, json.dumps(signature))
            return signature
        return [(tuple(shape), dtype) for shape, dtype in
                json.loads(coordination_client().blocking_key_value_get(key, timeout_ms))]

    chief_signature = backend.faults.guard("leaving strategy.scope()", chief_list)
    if chief_signature == signature:
        sent = [np.asarray(variable.value) for variable in variables]
    else:
        sent = [np.zeros(shape, jnp.dtype(dtype)) for shape, dtype in chief_signature]
    values = backend.broadcast_arrays(sent)
    if chief_signature != signature:
        raise ValueError(
            f"keras_mwms worker {backend.worker_index}: the variables created in this "
            f"`strategy.scope()` block differ from the chief's ({len(signature)} here, "
            f"{len(chief_signature)} on the chief; shapes and dtypes here {signature[:4]}..., on "
            f"the chief {chief_signature[:4]}...). Every worker must run the same "
            "`with strategy.scope():` blocks, creating the same models and optimizers in the same "
            "order; build models that only one worker needs outside the scope.")
    step.assign_values(variables, values)


def initialize_distributed(backend: Backend) -> bool:
    """`jax.distributed.initialize` on the chief's `TF_CONFIG` address, bounded, before any JAX
    computation; True when it started it, False when it joined one started before (Ray's
    `JaxTrainer(use_gpu=True)`), which must be the cluster's."""
    import jax
    from jax._src import xla_bridge

    if jax.distributed.is_initialized():
        policy.check_started_group(backend, "jax.distributed", jax.process_count(), jax.process_index(),
                                   "jax.distributed.initialize")
        return False
    if xla_bridge.backends_are_initialized():
        raise StrategyCreatedTooLateError(
            "JAX already ran a computation in this process (for example jax.devices(), "
            "keras.utils.set_random_seed(), or creating a Keras layer or variable) before "
            "keras_mwms.MultiWorkerMirroredStrategy() was created, so jax.distributed can no "
            "longer join the cluster. Create the strategy first, right after the imports, "
            "and build models, seeds and data afterwards."
        )
    gloo = backend.engine_description() == "gloo"
    if gloo:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=backend.resolver.worker_addresses[0],
        num_processes=backend.num_workers,
        process_id=backend.worker_index,
        initialization_timeout=int(max(10, backend.collective_timeout_seconds)),
        heartbeat_timeout_seconds=heartbeat_timeout_seconds(backend.collective_timeout_seconds),
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS,
        coordinator_bind_address=coordinator_bind_address(backend.resolver),
        # This worker's GPUs, always explicit on GPUs: left unset, JAX would infer them from
        # Slurm/MPI variables, which the launcher's narrowed CUDA_VISIBLE_DEVICES may not hold.
        local_device_ids=list(backend.gpu_assignment.gpus) or None,
    )
    if gloo:
        bind_gloo_to_tf_config_host(backend.resolver)   # before the first jax.devices()
    return True


def heartbeat_timeout_seconds(collective_timeout_seconds: float) -> int:
    """How long JAX's coordination service lets a worker go without a heartbeat before it aborts
    every worker (SIGABRT and XLA's C++ stack, no verdict): the collective timeout
    (`CommunicationOptions.timeout_seconds`, default `DEFAULT_COLLECTIVE_TIMEOUT_SECONDS`), at
    least `MIN_HEARTBEAT_TIMEOUT_SECONDS`.

    One bound for a silent peer: a hung or cut-off worker ends the job after `timeout_seconds`,
    as a collective waiting on it would, and the hang report names it first on every side: its
    threshold is kept 15 s below this (`native_abort_seconds`,
    `keras_mwms.diagnostics.start`), so the job never ends by JAX's native abort while hang
    reports are on. A 20 s heartbeat once aborted a healthy 2-worker CI job whose host stalled.
    (JAX's `missed_heartbeat_callback` cannot replace the abort: in jaxlib 0.10 a Python callback
    ends in `std::bad_cast`.)

    Example:

    >>> heartbeat_timeout_seconds(DEFAULT_COLLECTIVE_TIMEOUT_SECONDS), heartbeat_timeout_seconds(30.5), heartbeat_timeout_seconds(2)
    (120, 30, 20)
    """
    return max(MIN_HEARTBEAT_TIMEOUT_SECONDS, int(collective_timeout_seconds))


def coordinator_bind_address(resolver) -> str | None:
    """The chief's `TF_CONFIG` host:port for JAX's coordination service, when that host is an
    address of this machine (JAX's default is `[::]:PORT`, every interface); None (JAX's
    default) on the other workers, and for a NAT or service name that no local interface holds.

    Example:

    >>> from keras_mwms.startup.cluster import SimpleClusterResolver
    >>> coordinator_bind_address(SimpleClusterResolver({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "worker", 0))
    '127.0.0.1:2222'
    """
    from keras_mwms.startup import network
    from keras_mwms.startup.cluster import split_address

    if resolver.worker_index != 0:
        return None
    host, port = split_address(resolver.worker_addresses[0])
    if network.interface_of(host) is None:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_gloo_to_tf_config_host(resolver) -> None:
    """JAX's gloo listens on, and advertises to its peers, the address of this machine's host
    name (often 127.0.0.1, unreachable from other machines). Use this worker's `TF_CONFIG`
    host instead when it is an address of this machine.

    jax 0.10 has no public option for gloo's hostname: this builds the CPU client the way
    `xla_bridge` does, with `make_gloo_tcp_collectives(hostname=...)`. Private JAX API, so a
    JAX without it keeps its default (with a logged warning) instead of failing.
    """
    from keras_mwms.startup import network
    from keras_mwms.startup.cluster import split_address

    own_host = split_address(resolver.worker_addresses[resolver.worker_index])[0]
    if network.interface_of(own_host) is None:
        return
    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax

        make_collectives = _jax.make_gloo_tcp_collectives
        make_cpu_client = xla_bridge.make_cpu_client
        register = xla_bridge.register_backend_factory
    except (ImportError, AttributeError) as error:
        logger.warning(f"keras_mwms could not bind JAX's gloo to {own_host} (JAX {JaxBackend.version()} "
                       f"changed its private API: {error}); gloo uses the host name's address.",
                       worker=resolver)
        return

    def make_bound_cpu_client():
        collectives = make_collectives(distributed_client=distributed.global_state.client,
                                       hostname=own_host)
        return make_cpu_client(collectives=collectives)

    register("cpu", make_bound_cpu_client, priority=0, fail_quietly=False)
