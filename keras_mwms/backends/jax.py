"""The JAX backend: `jax.distributed`, then the flat path or a `keras.distribution.DataParallel`.

Start-up (after keras_mwms' rendezvous, before any JAX computation):

1. choose the collective engine: AUTO → NCCL on GPU, gloo on CPU; RING → gloo; NCCL on a CPU
   machine → a warning and gloo;
2. `jax.distributed.initialize` on the chief's `TF_CONFIG` address (the rendezvous has just
   released that port), with bounded initialization, heartbeat and shutdown timeouts;
3. choose the training path (`KERAS_MWMS_JAX_PATH`, see `keras_mwms.backends.jax_flat`):

   * **flat** (default with one device per worker): ordinary local variables, identical on
     every worker; Keras' train step split around ONE flat all-reduce of the gradients per
     step, outside Keras' jit — 1.4–6× cheaper than XLA's fused all-reduce on CPU gloo.
     Batch logs are global (metric states ride in the gradient all-reduce). A model the flat path cannot run
     exactly (BatchNormalization, an own `train_step`) trains on the DataParallel path instead;
   * **dataparallel** (several local devices, or asked for): a `keras.distribution.DataParallel`
     over `jax.devices()` — all devices of all workers, so `jax_num_cpu_devices=2` on 2 workers
     gives 4 replicas. Keras' jitted train step runs SPMD over the global batch: XLA inserts
     the gradient all-reduce; metrics and BatchNormalization statistics are computed over the
     global batch, exactly as one process.

What Keras 3.15.1 lacks on these paths is patched in `keras_mwms.backends.jax_patches`:
the chief's variable values on every worker (workers may seed differently) — broadcast when
`strategy.scope()` is left and at each `fit`/`evaluate` entry, never when a variable is
created, so a worker may save, load or build a model alone —, numpy / tf.data / generator /
PyDataset input cut by keras_mwms into global batches (`jax_data`), a local `predict`
returning the full ordered output with no collective, the chief-only progress bar, uneven array inputs as a clear error on every
worker, and a clear `WorkerLostError` naming the lost worker when a peer dies, followed by a
bounded exit instead of JAX's shutdown hang. A worker whose `fit`/`evaluate`/`predict` raised
(e.g. in a callback) exits without JAX's shutdown barrier (exit code 1), so its peers name it
at once. The coordinator and gloo bind the `TF_CONFIG` hosts (README's bind table).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import pickle
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms.backends.base import Backend
from keras_mwms.communication import CommunicationImplementation

DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 120.0
HEARTBEAT_TIMEOUT_SECONDS = 20
SHUTDOWN_TIMEOUT_SECONDS = 20
LOST_WORKER_EXIT_CODE = 3
EXIT_WATCHDOG_SECONDS = 15.0
CHIEF_LINGER_SECONDS = 6.0


class WorkerLostError(RuntimeError):
    """A peer worker died or became unreachable, so this synchronous job cannot continue.

    The message names the lost worker(s). The process exits non-zero soon after this error is
    reported (JAX cannot leave a broken cluster cleanly); restart the gang, e.g. with
    `python -m keras_mwms.launch --max-restarts N`, and resume from `BackupAndRestore`.

    Example:

    >>> issubclass(WorkerLostError, RuntimeError)
    True
    """


def gpu_possible() -> bool:
    """True if this JAX install could see a GPU, decided without initialising any JAX backend.

    Example:

    >>> isinstance(gpu_possible(), bool)
    True
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cuda" not in platforms and "gpu" not in platforms:
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(importlib.util.find_spec(name) is not None
               for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"))


def resolve_engine(implementation: CommunicationImplementation, has_gpu: bool) -> str:
    """The JAX collective engine for a requested implementation.

    Example:

    >>> resolve_engine(CommunicationImplementation.AUTO, has_gpu=False)
    'gloo'
    >>> resolve_engine(CommunicationImplementation.AUTO, has_gpu=True)
    'nccl'
    """
    if implementation == CommunicationImplementation.NCCL:
        if has_gpu:
            return "nccl"
        warnings.warn("CommunicationImplementation.NCCL was requested but this worker has no GPU; "
                      "keras_mwms uses gloo for the JAX CPU collectives instead.", stacklevel=3)
        return "gloo"
    if implementation == CommunicationImplementation.RING:
        if has_gpu:
            warnings.warn("CommunicationImplementation.RING: JAX runs GPU collectives with NCCL; "
                          "gloo is used for CPU collectives only.", stacklevel=3)
        return "gloo"
    return "nccl" if has_gpu else "gloo"


class PerReplica:
    """This worker's per-replica values (what `strategy.run` returns and `strategy.reduce` takes).

    Example:

    >>> PerReplica((1, 2)).values
    (1, 2)
    """

    def __init__(self, values: tuple):
        self.values = tuple(values)

    def __repr__(self) -> str:
        return f"PerReplica({self.values!r})"


class JaxBackend(Backend):
    """keras_mwms on `KERAS_BACKEND=jax` (see the module docstring for the design).

    Created by `keras_mwms.MultiWorkerMirroredStrategy`; users do not build it themselves.

    Example:

    ```python
    strategy = keras_mwms.MultiWorkerMirroredStrategy()   # KERAS_BACKEND=jax
    strategy.backend.broadcast_object({"run_id": 7})        # the chief's value everywhere
    ```
    """

    name = "jax"

    def __init__(self, resolver, options, tf_config_at_creation: str = ""):
        super().__init__(resolver, options, tf_config_at_creation)
        self._engine = resolve_engine(options.implementation, gpu_possible())
        self._joined = False
        self._distribution = None
        self._mesh = None
        self._collective_counter = 0
        self._peers: dict[int, dict] = {}
        self._lost: str | None = None
        self._path = "single"
        self._collectives = None
        self.failed: str | None = None   # set by jax_patches when fit/evaluate/predict raised
        self._scope_depth = 0
        self._scope_exits = 0
        self._created_in_scope: dict[int, Any] = {}
        self.lost_error_type = WorkerLostError

    # -- identity -------------------------------------------------------------------------
    @staticmethod
    def version() -> str:
        import jax

        return jax.__version__

    def engine_description(self) -> str:
        return self._engine

    @property
    def collective_timeout_seconds(self) -> float:
        return self.options.timeout_seconds or DEFAULT_COLLECTIVE_TIMEOUT_SECONDS

    # -- life cycle -----------------------------------------------------------------------
    def join(self) -> None:
        import jax
        from jax._src import xla_bridge

        if self.num_workers > 1:
            if xla_bridge.backends_are_initialized():
                raise RuntimeError(
                    "JAX already ran a computation in this process (for example jax.devices(), "
                    "keras.utils.set_random_seed(), or creating a Keras layer or variable) before "
                    "keras_mwms.MultiWorkerMirroredStrategy() was created, so jax.distributed can no "
                    "longer join the cluster. Create the strategy first, right after the imports, "
                    "and build models, seeds and data afterwards."
                )
            if self._engine == "gloo":
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                coordinator_address=self.resolver.worker_addresses[0],
                num_processes=self.num_workers,
                process_id=self.worker_index,
                initialization_timeout=int(max(10, self.collective_timeout_seconds)),
                heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS,
                shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_SECONDS,
                coordinator_bind_address=self._coordinator_bind_address(),
            )
            if self._engine == "gloo":
                self._bind_gloo_to_tf_config_host()   # before the first jax.devices()
            # Registered after jax.distributed's own atexit hook, so it runs first (LIFO) and can
            # leave without JAX's shutdown barrier once a peer is known to be gone, or when
            # fit/evaluate/predict raised on this worker only (`failed`).
            atexit.register(self._exit_now_if_lost)
            self._publish_identity()
        import keras

        from keras_mwms.backends import jax_flat, jax_patches

        requested = jax_flat.requested_path()
        all_devices = jax.devices()
        if len(all_devices) > 1:
            self._distribution = keras.distribution.DataParallel(
                devices=all_devices, auto_shard_dataset=False)
            self._mesh = self._distribution.device_mesh.backend_mesh
            if self.num_workers > 1:
                self._collectives = jax_flat.FlatCollectives(self.is_chief)
            if self.num_workers > 1 and jax.local_device_count() == 1 and requested != "dataparallel":
                # The flat path: local variables, one flat all-reduce per step (jax_flat). The
                # DataParallel distribution is only entered per model that needs it.
                self._path = jax_flat.FLAT
            else:
                if requested == jax_flat.FLAT:
                    warnings.warn(f"{jax_flat.PATH_ENV}=flat: this worker has "
                                  f"{jax.local_device_count()} local devices; the flat path serves one "
                                  "device per worker, so keras_mwms uses keras.distribution.DataParallel.",
                                  stacklevel=3)
                self._path = jax_flat.DATA_PARALLEL
                keras.distribution.set_distribution(self._distribution)
        jax_patches.install(self)
        self._joined = True

    def _coordinator_bind_address(self) -> str | None:
        """The chief's `TF_CONFIG` host:port for JAX's coordination service, when that host is an
        address of this machine (JAX's default is `[::]:PORT`, every interface); None (JAX's
        default) for a NAT or service name that no local interface holds."""
        from keras_mwms import network
        from keras_mwms.cluster import split_address

        if self.worker_index != 0:
            return None
        host, port = split_address(self.resolver.worker_addresses[0])
        if network.interface_of(host) is None:
            return None
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _bind_gloo_to_tf_config_host(self) -> None:
        """JAX's gloo listens on, and advertises to its peers, the address of this machine's host
        name (often 127.0.0.1, unreachable from other machines). Use this worker's `TF_CONFIG`
        host instead when it is an address of this machine.

        jax 0.10 has no public option for gloo's hostname: this builds the CPU client the way
        `xla_bridge` does, with `make_gloo_tcp_collectives(hostname=...)`. Private JAX API, so a
        JAX without it keeps its default (with a warning) instead of failing.
        """
        from keras_mwms import network
        from keras_mwms.cluster import split_address

        own_host = split_address(self.resolver.worker_addresses[self.worker_index])[0]
        if network.interface_of(own_host) is None:
            return
        try:
            from jax._src import distributed, xla_bridge
            from jax._src.lib import _jax

            make_collectives = _jax.make_gloo_tcp_collectives
            make_cpu_client = xla_bridge.make_cpu_client
            register = xla_bridge.register_backend_factory
        except (ImportError, AttributeError) as error:
            warnings.warn(f"keras_mwms could not bind JAX's gloo to {own_host} (JAX {self.version()} "
                          f"changed its private API: {error}); gloo uses the host name's address.",
                          stacklevel=3)
            return

        def make_bound_cpu_client():
            collectives = make_collectives(distributed_client=distributed.global_state.client,
                                           hostname=own_host)
            return make_cpu_client(collectives=collectives)

        register("cpu", make_bound_cpu_client, priority=0, fail_quietly=False)

    def leave(self) -> None:
        import jax

        from keras_mwms.backends import jax_patches

        if not self._joined:
            return
        self._joined = False
        jax_patches.uninstall(self)
        if self._path == "dataparallel":
            import keras

            keras.distribution.set_distribution(None)
        if self.num_workers > 1 and self._lost is None and self.failed is None:
            jax.distributed.shutdown()   # (after a failure the exit hook leaves without it)

    # -- replicas -------------------------------------------------------------------------
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
        """The `jax_flat.FlatCollectives` of this cluster (None on a single worker)."""
        return self._collectives

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
        inner = (self._distribution.scope() if self._distribution is not None and self._path == "dataparallel"
                 else contextlib.nullcontext())
        self._scope_depth += 1
        try:
            with inner:
                yield
        finally:
            self._scope_depth -= 1
            created = list(self._created_in_scope.values()) if self._scope_depth == 0 else []
            if self._scope_depth == 0:
                self._created_in_scope.clear()
        self._agree_on_variables(created)

    def note_new_variable(self, variable) -> None:
        """Called for every new Keras variable; those created in `scope()` are agreed at its exit."""
        if self._scope_depth and self.num_workers > 1:
            self._created_in_scope[id(variable)] = variable

    def _agree_on_variables(self, variables: list) -> None:
        """The chief's values for `variables` on every worker: its list of shapes and dtypes
        through the coordination service, then the values in one collective sized by that list
        (so a worker that created other variables still joins the same collective, then fails
        with a clear error instead of leaving the chief waiting)."""
        from keras_mwms.backends import jax_flat

        variables = [variable for variable in variables if getattr(variable, "_value", None) is not None]
        if not variables:
            return
        import jax.numpy as jnp

        signature = [(tuple(variable.shape), str(variable.dtype)) for variable in variables]
        self._scope_exits += 1
        key = f"keras_mwms/scope-variables/{self._scope_exits}"
        timeout_ms = int(self.collective_timeout_seconds * 1000)
        try:
            if self.is_chief:
                self._client.key_value_set(key, json.dumps(signature))
                chief_signature = signature
            else:
                chief_signature = [(tuple(shape), dtype) for shape, dtype in
                                   json.loads(self._client.blocking_key_value_get(key, timeout_ms))]
        except Exception as error:  # noqa: BLE001 - jaxlib raises its own runtime error types
            self.raise_if_worker_lost(error, "leaving strategy.scope()")
            raise
        if chief_signature == signature:
            sent = [np.asarray(variable.value) for variable in variables]
        else:
            sent = [np.zeros(shape, jnp.dtype(dtype)) for shape, dtype in chief_signature]
        values = self.broadcast_arrays(sent)
        if chief_signature != signature:
            raise ValueError(
                f"keras_mwms worker {self.worker_index}: the variables created in this "
                f"`strategy.scope()` block differ from the chief's ({len(signature)} here, "
                f"{len(chief_signature)} on the chief; shapes and dtypes here {signature[:4]}..., on "
                f"the chief {chief_signature[:4]}...). Every worker must run the same "
                "`with strategy.scope():` blocks, creating the same models and optimizers in the same "
                "order; build models that only one worker needs outside the scope.")
        jax_flat.assign_values(variables, values)

    # -- tf.distribute-style surface ------------------------------------------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        replicas = self.replicas_per_worker

        def component(value, index):
            return value.values[index] if isinstance(value, PerReplica) else value

        results = []
        for index in range(replicas):
            call_args = tuple(component(arg, index) for arg in args)
            call_kwargs = {key: component(value, index) for key, value in kwargs.items()}
            results.append(fn(*call_args, **call_kwargs))
        return results[0] if replicas == 1 else PerReplica(tuple(results))

    def experimental_local_results(self, value: Any) -> tuple:
        return value.values if isinstance(value, PerReplica) else (value,)

    def reduce(self, reduce_op: str, value: Any, axis: int | None) -> Any:
        import jax

        # A nest (e.g. `(loss, gradients)` from a custom training step) is reduced leaf by leaf,
        # as on TensorFlow and torch, in one flat all-reduce per dtype.
        components = self.experimental_local_results(value)
        structure = jax.tree_util.tree_structure(components[0])
        per_leaf = zip(*[[np.asarray(jax.device_get(leaf)) for leaf in jax.tree_util.tree_leaves(part)]
                         for part in components])
        local_sums, local_counts = [], []
        for parts in per_leaf:
            if isinstance(value, PerReplica) or self.replicas_per_worker == 1:
                local_counts.append(len(parts) if axis is None else sum(p.shape[axis] for p in parts))
            else:
                local_counts.append(1)
            summed = [part.sum(axis=axis) if axis is not None else part for part in parts]
            local_sums.append(np.sum(np.stack(summed), axis=0))
        totals = self._all_reduce_sum_nest(local_sums)
        if reduce_op == "MEAN":
            counts = self.all_reduce_sum(np.asarray(local_counts, dtype=np.float64))
            totals = [(total / count).astype(local.dtype)
                      for total, count, local in zip(totals, counts, local_sums)]
        return jax.tree_util.tree_unflatten(structure, totals)

    def _all_reduce_sum_nest(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """`all_reduce_sum` of several arrays: one flat collective per dtype, same bits as one by one."""
        if len(arrays) == 1:
            return [self.all_reduce_sum(arrays[0])]
        totals: list[Any] = [None] * len(arrays)
        for dtype in dict.fromkeys(array.dtype for array in arrays):  # same order on every worker
            indices = [i for i, array in enumerate(arrays) if array.dtype == dtype]
            flat = self.all_reduce_sum(np.concatenate([arrays[i].ravel() for i in indices]))
            offset = 0
            for i in indices:
                totals[i] = flat[offset:offset + arrays[i].size].reshape(arrays[i].shape)
                offset += arrays[i].size
        return totals

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        from keras_mwms.backends.jax_data import DistributedDataset, split_local_replicas
        from keras_mwms.data import replica_slices

        workers, index, replicas = self.num_workers, self.worker_index, self.replicas_per_worker

        def local_part(batch):
            from keras.src import tree

            leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
            rows = int(np.shape(leaves[0])[0])
            slices = replica_slices(rows, workers * replicas) if rows else [(0, 0)] * (workers * replicas)
            first, last = slices[index * replicas][0], slices[(index + 1) * replicas - 1][1]
            return tree.map_structure(
                lambda leaf: None if leaf is None else np.asarray(leaf)[first:last], batch, none_is_leaf=True)

        def batches():
            iterator = dataset.as_numpy_iterator() if hasattr(dataset, "as_numpy_iterator") else dataset
            for batch in iterator:
                parts = split_local_replicas(local_part(batch), replicas)
                yield parts[0] if replicas == 1 else PerReplica(tuple(parts))

        return DistributedDataset(batches, self._concatenate_replicas)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        from keras_mwms.backends.jax_data import DistributedDataset
        from keras_mwms.data import InputContext

        replicas = self.replicas_per_worker
        context = InputContext(self.num_workers, self.worker_index, self.num_replicas_in_sync)
        dataset = dataset_fn(context)

        def batches():
            iterator = dataset.as_numpy_iterator() if hasattr(dataset, "as_numpy_iterator") else dataset
            group = []
            for batch in iterator:
                group.append(batch)
                if len(group) == replicas:
                    yield group[0] if replicas == 1 else PerReplica(tuple(group))
                    group = []

        return DistributedDataset(batches, self._concatenate_replicas)

    @staticmethod
    def _concatenate_replicas(value: Any) -> Any:
        if not isinstance(value, PerReplica):
            return value
        from keras.src import tree

        return tree.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts]),
                                  *value.values)

    # -- primitives for callbacks ---------------------------------------------------------
    def _next_key(self, kind: str) -> str:
        self._collective_counter += 1
        return f"keras_mwms/{kind}/{self._collective_counter}"

    @property
    def _client(self):
        from jax._src import distributed

        return distributed.global_state.client

    def barrier(self, name: str = "barrier") -> None:
        """Waits for every worker, bounded by the collective timeout (`WorkerLostError` after it)."""
        if self.num_workers == 1:
            return
        key = self._next_key(f"barrier/{name}")
        timeout_ms = int(self.collective_timeout_seconds * 1000)
        try:
            self._client.wait_at_barrier(key, timeout_ms)
        except Exception as error:  # noqa: BLE001 - jaxlib raises its own runtime error types
            self.raise_if_worker_lost(error, f"barrier {name!r}")
            raise

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        """Worker `root`'s picklable `value` on every worker (through the coordination service)."""
        if self.num_workers == 1:
            return value
        key = self._next_key("broadcast")
        if self.worker_index == root:
            self._client.key_value_set_bytes(key, pickle.dumps(value))
            return value
        timeout_ms = int(self.collective_timeout_seconds * 1000)
        try:
            data = self._client.blocking_key_value_get_bytes(key, timeout_ms)
        except Exception as error:  # noqa: BLE001
            self.raise_if_worker_lost(error, "broadcast_object")
            raise
        return pickle.loads(data)

    def all_reduce_sum(self, value: np.ndarray) -> np.ndarray:
        """Sum of a host array over workers, in worker order, so every worker gets identical bits."""
        value = np.asarray(value)
        if self.num_workers == 1:
            return value
        from jax.experimental import multihost_utils

        try:
            gathered = np.asarray(multihost_utils.process_allgather(value, tiled=False))
        except Exception as error:  # noqa: BLE001
            self.raise_if_worker_lost(error, "all_reduce_sum")
            raise
        total = gathered[0].copy()
        for part in gathered[1:]:
            total = total + part
        return total

    def all_reduce(self, value: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum, min or max of a host array over workers, in worker order (identical bits)."""
        if op == "sum":
            return self.all_reduce_sum(value)
        gathered = self.all_gather(value)
        return gathered.min(axis=0) if op == "min" else gathered.max(axis=0)

    def broadcast_arrays(self, values: list[np.ndarray], root: int = 0) -> list[np.ndarray]:
        """The chief's numpy arrays on every worker, bit for bit, in one XLA collective.

        The bytes travel padded to a power of two, so a model's variables compile a handful of
        collectives, not one per shape (which made start-up slow).
        """
        if self.num_workers == 1:
            return [np.asarray(value) for value in values]
        if root != 0:
            return super().broadcast_arrays(values, root)
        try:
            return self._collectives.broadcast([np.asarray(value) for value in values])
        except Exception as error:  # noqa: BLE001
            self.raise_if_worker_lost(error, "variable broadcast")
            raise

    def all_gather(self, value: np.ndarray) -> np.ndarray:
        """Every worker's host array stacked in worker order (shape `(num_workers,) + value.shape`)."""
        value = np.asarray(value)
        if self.num_workers == 1:
            return value[None]
        from jax.experimental import multihost_utils

        try:
            return np.asarray(multihost_utils.process_allgather(value, tiled=False))
        except Exception as error:  # noqa: BLE001
            self.raise_if_worker_lost(error, "metric all-gather")
            raise

    # -- faults ---------------------------------------------------------------------------
    def _publish_identity(self) -> None:
        """Shares (host, pid) of every worker, so a lost local peer can be named at once."""
        client = self._client
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        client.key_value_set(f"keras_mwms/identity/{self.worker_index}", json.dumps(me))
        timeout_ms = int(self.collective_timeout_seconds * 1000)
        for index in range(self.num_workers):
            text = client.blocking_key_value_get(f"keras_mwms/identity/{index}", timeout_ms)
            self._peers[index] = json.loads(text)

    def _worker_label(self, index: int) -> str:
        job, task = self.resolver.group_tasks[index]
        return f"worker {index} ({job}:{task} at {self.resolver.worker_addresses[index]})"

    def _announce_survival(self) -> None:
        """Tells peers this worker saw the failure itself, so they do not name it as the lost one."""
        thread = threading.Thread(target=lambda: self._client.key_value_set(
            f"keras_mwms/survivor/{self.worker_index}", "1", allow_overwrite=True), daemon=True)
        thread.start()
        thread.join(2.0)

    def _survivors(self) -> set[int]:
        found: set[int] = set()

        def ask():
            for index in range(self.num_workers):
                try:
                    if self._client.key_value_try_get(f"keras_mwms/survivor/{index}"):
                        found.add(index)
                except Exception:  # noqa: BLE001 - "not found" is an exception in jaxlib
                    pass

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        thread.join(2.0)
        return found

    def _dead_peers(self) -> list[int]:
        here = socket.gethostname()
        dead = []
        remote = []
        survivors = self._survivors()
        for index, peer in self._peers.items():
            if index == self.worker_index or index in survivors:
                continue
            if peer.get("host") == here:
                if not _process_alive(int(peer["pid"])):
                    dead.append(index)
            else:
                remote.append(index)
        if remote:
            dead += [index for index in remote if index not in self._live_nodes(remote)]
        return sorted(dead)

    def _live_nodes(self, indices: list[int]) -> set[int]:
        result: dict = {}

        def ask():
            try:
                result.update(self._client.get_live_nodes(indices))
            except Exception:  # noqa: BLE001 - an unreachable coordinator means the chief is gone
                result["error"] = True

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        thread.join(5.0)
        if "error" in result or thread.is_alive():
            return set(indices) - {0}
        return {int(index) for index in result}

    def raise_if_worker_lost(self, error: BaseException, where: str) -> None:
        """Turns a collective failure caused by a dead peer into `WorkerLostError` (and a bounded exit)."""
        if self.num_workers == 1 or isinstance(error, WorkerLostError):
            return
        text = str(error)
        suspicious = any(word in text for word in (
            "Gloo", "gloo", "Connection reset", "connection", "Connection closed", "UNAVAILABLE",
            "heartbeat", "Socket", "socket", "DEADLINE_EXCEEDED", "Broken pipe", "peer"))
        if not suspicious:
            return
        self._announce_survival()
        dead: list[int] = []
        deadline = time.monotonic() + 5.0
        while not dead and time.monotonic() < deadline:
            dead = self._dead_peers()
            if not dead:
                time.sleep(0.2)
        if dead:
            who = ", ".join(self._worker_label(index) for index in dead)
            message = (f"keras_mwms: lost {who} during {where}; this synchronous job cannot continue "
                       f"without it. ")
        else:
            message = (f"keras_mwms: a collective failed during {where} on "
                       f"{self._worker_label(self.worker_index)}, most likely because a peer worker "
                       "died or the network failed. ")
        first_line = text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__
        message += ("Restart the whole gang (e.g. `python -m keras_mwms.launch --max-restarts N`) and "
                    f"resume with keras_mwms.callbacks.BackupAndRestore. Underlying error: {first_line}")
        self._lost = message
        print(message, file=sys.stderr, flush=True)
        # JAX cannot leave a broken cluster cleanly (its shutdown barrier waits for the dead peer),
        # so the process ends soon after the error is reported, whatever the caller does.
        watchdog = threading.Timer(EXIT_WATCHDOG_SECONDS, os._exit, (LOST_WORKER_EXIT_CODE,))
        watchdog.daemon = True
        watchdog.start()
        raise WorkerLostError(message) from error

    def _exit_now_if_lost(self) -> None:
        if self._lost is None and self.failed is not None:
            # fit/evaluate/predict raised here (e.g. in a callback) and the caller did not recover:
            # JAX's shutdown barrier would hold this exit ~20 s while the peers wait in their next
            # collective and then abort without a name. Leaving now closes the gloo connections,
            # so every peer raises WorkerLostError naming this worker at once.
            print(f"keras_mwms: worker {self.worker_index} exits without JAX's shutdown barrier "
                  f"after {self.failed}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if self._lost is not None:
            if self.is_chief:
                # The chief hosts JAX's coordination service; leaving at once would make the other
                # survivors abort inside JAX before they could name the lost worker.
                time.sleep(CHIEF_LINGER_SECONDS)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(LOST_WORKER_EXIT_CODE)


def _process_alive(pid: int) -> bool:
    """True if `pid` runs on this host and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
