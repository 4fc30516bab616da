"""The TensorFlow engine: TF's own `MultiWorkerMirroredStrategy`, started safely and watched.

On TensorFlow keras_mwms does not replace the collective engine: TF's gRPC ring or NCCL
collectives, mirrored variables and chief-broadcast initial values are what TF users already
run. What TF lacks, and what this module adds, is

* a bounded start-up: TF's own waits for a missing peer forever, so the strategy is built from
  our validated resolver only after the rendezvous proved every worker is up;
* the request mapping: `CommunicationOptions` become TF's (NCCL without a GPU: a warning, then
  RING); lost peers are detected by TF's heartbeats, `timeout_seconds` adds a per-collective
  bound;
* a name for a lost peer: TF buries `/job:worker/replica:0/task:1` in a graph traceback;
  `keras_mwms.backends.tensorflow.faults` reads the ranks, and the flow of
  `keras_mwms.backends.faults` raises `keras_mwms.WorkerLostError`;
* the collective port the shared policy and the callbacks build on (`all_reduce`,
  `broadcast_object`, `barrier`) as tiny TF collectives.

TF collectives cannot be torn down inside a process, so `leave()` does nothing: `close()`
uninstalls the Keras patches, and the process can go on with plain Keras, or a single-worker
strategy (not with a second multi-worker strategy). A strategy created while another is open
ends that one's patches first (`keras_mwms.active.begin`), so Keras' methods are never wrapped
twice.

Example:

>>> resolve_engine(CommunicationImplementation.AUTO, gpu_count=0)
'ring'
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms.backends import policy
from keras_mwms.backends.base import Backend
from keras_mwms.backends.keras_api import attributes
from keras_mwms.backends.patches import PatchTable
from keras_mwms.backends.tensorflow import patches
from keras_mwms.backends.tensorflow.faults import TensorFlowFaults
from keras_mwms.backends.tensorflow.step import RowWeighting
from keras_mwms.communication import CommunicationImplementation, CommunicationOptions
from keras_mwms.diagnostics import LEDGER
from keras_mwms.errors import StrategyCreatedTooLateError
from keras_mwms.startup.cluster import ClusterResolver

# TF's per-collective timeout starts one sleeping thread per collective for its whole duration
# (≈2,500 live threads per worker after a short benchmark at 300 s), so by default we set none:
# TF's coordination-service heartbeats already end every worker ≈10 s after a peer dies or is
# stopped (SIGSTOP stops its heartbeat thread too). A user's `timeout_seconds` is passed on.
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = None


def resolve_engine(implementation: CommunicationImplementation, gpu_count: int) -> str:
    """The TF collective implementation a request gets on a worker with `gpu_count` GPUs.

    `policy.choose_implementation` decides (NCCL without a GPU: a warning, then RING); the
    answer is TF's `CommunicationImplementation` member name in lower case.

    Example:

    >>> resolve_engine(CommunicationImplementation.AUTO, 0), resolve_engine(CommunicationImplementation.AUTO, 1)
    ('ring', 'nccl')
    """
    return policy.choose_implementation(implementation, gpu_count, "TensorFlow", "gRPC").value.lower()


def tf_cluster_resolver(resolver: ClusterResolver, gpus: int = 0):
    """Our resolver as a TF `SimpleClusterResolver` over the training jobs (`chief`, `worker`).

    `ps` and `evaluator` tasks are left out: a mirrored strategy never talks to them, and TF
    would otherwise wait for them at start-up. `gpus` is this worker's GPU count: TF's strategy
    takes its local replicas from the resolver's `num_accelerators()` (not from the visible
    devices), so without it a GPU worker would train on its CPU.

    Example:

    ```python
    tf_resolver = tf_cluster_resolver(strategy.cluster_resolver)
    tf_resolver.cluster_spec().jobs          # ['worker'] (or ['chief', 'worker'])
    ```
    """
    import tensorflow as tf

    spec = resolver.cluster_spec().as_dict()
    training_jobs = {job: tasks for job, tasks in spec.items() if job in ("chief", "worker")}
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(training_jobs), task_type=resolver.task_type,
        task_id=resolver.task_id, rpc_layer=resolver.rpc_layer or "grpc",
        num_accelerators={"GPU": gpus} if gpus else None)


class TensorFlowBackend(Backend):
    """Multi-worker training on the TensorFlow backend, through TF's own collectives.

    Created by `keras_mwms.MultiWorkerMirroredStrategy` (the facade); users rarely touch it.
    Its `strategy` is the underlying `tf.distribute.MultiWorkerMirroredStrategy`.

    Example:

    ```python
    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    strategy.backend.strategy          # the tf.distribute strategy
    strategy.backend.broadcast_object({"epoch": 3})   # chief's value everywhere
    ```

    Args:
        resolver: the validated cluster and this task.
        options: the user's `CommunicationOptions`.
        tf_config_at_creation: the `TF_CONFIG` text the strategy saw when it was created.
    """

    name = "tensorflow"

    def __init__(self, resolver: ClusterResolver, options: CommunicationOptions,
                 tf_config_at_creation: str = ""):
        super().__init__(resolver, options, tf_config_at_creation)
        from keras_mwms import devices

        # This worker's GPUs (`keras_mwms.devices.assignment`): its local replicas, or the CPU.
        self.gpu_assignment = devices.gpu_assignment("tensorflow", self.num_workers)
        self.gpu_count = len(self.gpu_assignment.gpus)
        self.implementation = CommunicationImplementation(
            resolve_engine(options.implementation, self.gpu_count).upper())
        self.strategy = None
        self.row_weighting: RowWeighting | None = None
        self.faults = TensorFlowFaults(self)   # lost peers: `keras_mwms.backends.faults`

    @staticmethod
    def version() -> str:
        import tensorflow as tf

        return tf.__version__

    def engine_description(self) -> str:
        return f"tf-collective-{self.implementation.value.lower()}"

    @property
    def collective_timeout_seconds(self) -> float | None:
        """The per-collective bound: the user's `timeout_seconds`, else none (heartbeats bound)."""
        return self.options.timeout_seconds or DEFAULT_COLLECTIVE_TIMEOUT_SECONDS

    # -- life cycle -----------------------------------------------------------------------
    def use_compute_threads(self, threads: int) -> bool:
        import tensorflow as tf

        try:   # only an op's own threads: collectives keep TF's inter-op pool
            tf.config.threading.set_intra_op_parallelism_threads(threads)
        except RuntimeError:   # TF already ran an op; join() says how to fix the order
            return False
        return True

    def join(self) -> None:
        import tensorflow as tf

        tf_options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.options.bytes_per_pack,
            timeout_seconds=self.collective_timeout_seconds,
            implementation=getattr(tf.distribute.experimental.CommunicationImplementation,
                                   self.implementation.value),
        )
        if self.gpu_assignment.narrows:
            physical = tf.config.list_physical_devices("GPU")
            tf.config.set_visible_devices([physical[i] for i in self.gpu_assignment.gpus], "GPU")
        if self.num_workers > 1:
            cluster_resolver = tf_cluster_resolver(self.resolver, self.gpu_count)
        else:
            # One worker: a local strategy (no gRPC server), i.e. plain Keras behaviour.
            cluster_resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec({}), task_type="worker", task_id=0,
                num_accelerators={"GPU": self.gpu_count} if self.gpu_count else None)
        try:
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=cluster_resolver, communication_options=tf_options)
        except RuntimeError as error:
            if "configured at program startup" not in str(error):
                raise
            raise StrategyCreatedTooLateError(
                "TensorFlow already ran an operation in this process (a tensor, a Keras layer or "
                "variable, keras.utils.set_random_seed(), ...) before "
                "keras_mwms.MultiWorkerMirroredStrategy() was created, so its collectives can no "
                "longer be configured. Create the strategy first, right after the imports, and "
                "build models, seeds and data afterwards."
            ) from error
        self.row_weighting = RowWeighting(self.strategy, compression=lambda: self.options.compression)

    def leave(self) -> None:
        """Nothing to do: TF collectives, once configured, stay with the process."""

    def patch_table(self) -> PatchTable:
        """The Keras repairs, the fit/evaluate/predict wrappers and the row weighting."""
        return patches.patch_table(self)

    @staticmethod
    def crash_repairs() -> PatchTable:
        """Keras 3.15.1's two crashes under `tf.distribute.MultiWorkerMirroredStrategy` repaired."""
        return patches.crash_repairs()

    @property
    def replicas_per_worker(self) -> int:
        return len(self.strategy.extended.worker_devices)

    @property
    def in_scope(self) -> bool:
        import tensorflow as tf

        return (self.strategy is not None and tf.distribute.has_strategy()
                and tf.distribute.get_strategy() is self.strategy)

    def uses(self, model: Any) -> bool:
        """Whether `model` was built in this backend's scope (it then trains on all workers)."""
        return self.strategy is not None and attributes.distribute_strategy(model) is self.strategy

    def trains_on_all_workers(self, model: Any) -> bool:
        return self.uses(model)

    # -- tf.distribute-style surface ------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    def scope(self):
        return self.strategy.scope()

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.strategy.run(fn, args=tuple(args), kwargs=kwargs or {})

    def reduce(self, reduce_op: str, value: Any, axis: int | None) -> Any:
        import tensorflow as tf

        # TF's collective strategy reduces one tensor at a time; map over nests like
        # MirroredStrategy does, so `reduce("SUM", (loss, count), None)` works too.
        return tf.nest.map_structure(lambda leaf: self.strategy.reduce(reduce_op, leaf, axis), value)

    def experimental_local_results(self, value: Any) -> tuple:
        return self.strategy.experimental_local_results(value)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return self.strategy.experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        # TF passes its own tf.distribute.InputContext, whose num_input_pipelines,
        # input_pipeline_id, num_replicas_in_sync and get_per_replica_batch_size are
        # keras_mwms.InputContext's: user functions work unchanged with either.
        return self.strategy.distribute_datasets_from_function(dataset_fn, options)

    def update_config_proto(self, config_proto: Any) -> Any:
        """compat.v1: a copy of `config_proto` with this strategy's collective settings."""
        return self.strategy.extended._update_config_proto(config_proto)

    # -- collective port ------------------------------------------------------------------
    def _all_reduce_sum(self, array: np.ndarray, contributing_replica: int | None = None) -> np.ndarray:
        """SUM of `array` over workers; only `contributing_replica` adds it if given (others add 0).

        Every call travels as one flat float64 vector, so the one traced function below is
        traced twice in a job (its first shape, then any length) instead of once per dtype,
        rank and size, which made TF warn of retracing. Exact for what the port carries:
        integers below 2**53 (counts, flags, int32 words of a broadcast) and float32/float64
        values gathered between zeros.
        """
        import tensorflow as tf

        array = np.asarray(array)
        flat = array.astype(np.float64).reshape(-1)
        first_local_replica = self.worker_index * self.replicas_per_worker

        def value_for(context):
            replica = context.replica_id_in_sync_group
            if contributing_replica is None:
                keep = replica == first_local_replica
            else:
                keep = replica == contributing_replica
            return tf.constant(flat if keep else np.zeros_like(flat))

        per_replica = self.strategy.experimental_distribute_values_from_function(value_for)
        with LEDGER.collective("all-reduce (sum)", array.nbytes):
            total = np.asarray(self._traced_sum(per_replica))
        return total.reshape(array.shape).astype(array.dtype)

    @functools.cached_property
    def _traced_sum(self):
        """SUM across replicas inside a `tf.function`: eagerly, TF logs "Using
        CollectiveAllReduceStrategy eagerly has significant overhead" on every call (every
        epoch of BackupAndRestore)."""
        import tensorflow as tf

        return tf.function(lambda per_replica: self.strategy.reduce("SUM", per_replica, axis=None),
                           reduce_retracing=True)

    def all_reduce_sum(self, value: np.ndarray) -> np.ndarray:
        """SUM of every worker's `value` (NumPy in, NumPy out)."""
        return self._all_reduce_sum(np.asarray(value))

    def all_reduce(self, value: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum, min or max of a host array over workers (min/max from one all-gather)."""
        value = np.asarray(value)
        if op == "sum":
            return self.all_reduce_sum(value)
        gathered = self.all_gather(value)
        return gathered.min(axis=0) if op == "min" else gathered.max(axis=0)

    def barrier(self, name: str = "barrier") -> None:
        """Returns once every worker called it (one tiny all-reduce, bounded by the timeout)."""
        arrived = self._all_reduce_sum(np.ones((), np.int32))
        if int(arrived) != self.num_workers:
            raise RuntimeError(f"barrier {name!r}: {int(arrived)} of {self.num_workers} workers arrived")

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        """Worker `root`'s picklable `value`, on every worker (two all-reduces: size, bytes)."""
        if self.num_workers == 1:
            return value
        if not 0 <= root < self.num_workers:
            raise ValueError(f"root must be a worker index in 0..{self.num_workers - 1}, got {root}")
        root_replica = root * self.replicas_per_worker
        payload = pickle.dumps(value) if self.worker_index == root else b""
        size = int(self._all_reduce_sum(np.array(len(payload), np.int64), root_replica))
        # int32 words: collectives sum them exactly, and zeros from the other workers add nothing.
        padded = payload.ljust((size + 3) // 4 * 4, b"\0")
        words = np.frombuffer(padded, np.int32) if self.worker_index == root else \
            np.zeros(((size + 3) // 4,), np.int32)
        received = self._all_reduce_sum(words, root_replica)
        return pickle.loads(received.astype(np.int32).tobytes()[:size])
