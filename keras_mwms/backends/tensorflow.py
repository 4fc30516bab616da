"""The TensorFlow backend: `tf.distribute.MultiWorkerMirroredStrategy` under Keras 3, repaired.

On TensorFlow the collective engine is TF's own `MultiWorkerMirroredStrategy` (gRPC ring or
NCCL collectives, mirrored variables, initial values broadcast from the chief). This module

* builds it from our validated resolver, after our rendezvous proved every worker is up — TF's
  own start-up waits for a missing peer forever;
* maps `CommunicationOptions` onto TF's (NCCL without a GPU: a warning, then RING); lost
  peers are detected by TF's heartbeats, and `timeout_seconds` adds a per-collective bound;
* repairs Keras 3.15.1's TensorFlow trainer under multi-worker strategies (two crashes, see
  `apply_keras_patches`), each patch named, linked to its upstream issue and guarded by
  `require_tested_keras`;
* wraps `fit` / `evaluate` / `predict` of models built in our scope, to keep the equivalence
  contract: no progress bar on non-chief workers, one shuffle order on every worker,
  `AutoShardPolicy.OFF` datasets run their full length, `TF_CONFIG` drift detected;
* offers the `barrier` and `broadcast_object` primitives the callbacks build on.

Example (in a worker started by `python -m keras_mwms.launch --workers 2 train.py`):

```python
import keras, keras_mwms

strategy = keras_mwms.MultiWorkerMirroredStrategy()        # KERAS_BACKEND=tensorflow
with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=64, epochs=2)                   # 64 = the global batch
```
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import inspect
import pickle
import re
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms.backends import tensorflow_gradients
from keras_mwms.backends.base import Backend
from keras_mwms.backends.patches import require_tested_keras
from keras_mwms.cluster import ClusterResolver
from keras_mwms.communication import CommunicationImplementation, CommunicationOptions

# TF's per-collective timeout starts one sleeping thread per collective for its whole duration
# (≈2,500 live threads per worker after a short benchmark at 300 s), so by default we set none:
# TF's coordination-service heartbeats already end every worker ≈10 s after a peer dies or is
# stopped (SIGSTOP stops its heartbeat thread too). A user's `timeout_seconds` is passed on.
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = None
# After a lost peer TF's own teardown can take tens of seconds (gRPC, coordination service);
# the process ends at most this long after the `WorkerLostError`, whatever it waits for.
_EXIT_WATCHDOG_SECONDS = 20
_TASK_PATTERN = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")

_KERAS_PATCHED = False
_backends_by_tf_strategy: dict[int, TensorFlowBackend] = {}


class WorkerLostError(RuntimeError):
    """A peer crashed, hung or left during `fit` / `evaluate` / `predict` on TensorFlow.

    The message names the lost worker(s) as `worker R (job:index at host:port)`; TF's own
    error is chained as the cause. The process ends at most `_EXIT_WATCHDOG_SECONDS` later.

    >>> issubclass(WorkerLostError, RuntimeError)
    True
    """


def resolve_engine(implementation: CommunicationImplementation, gpu_count: int) -> CommunicationImplementation:
    """The TF collective implementation actually used for a request on this machine.

    NCCL needs GPUs; on a CPU-only worker it falls back to RING, with a warning that says so.

    Example:

    >>> resolve_engine(CommunicationImplementation.AUTO, 0)
    <CommunicationImplementation.AUTO: 'AUTO'>
    """
    if implementation is CommunicationImplementation.NCCL and gpu_count == 0:
        warnings.warn(
            "CommunicationImplementation.NCCL was requested but this worker has no GPU: "
            "TensorFlow collectives use RING (gRPC) instead. Request RING or AUTO to silence this.",
            stacklevel=3,
        )
        return CommunicationImplementation.RING
    return implementation


def tf_cluster_resolver(resolver: ClusterResolver):
    """Our resolver as a TF `SimpleClusterResolver` over the training jobs (`chief`, `worker`).

    `ps` and `evaluator` tasks are left out: a mirrored strategy never talks to them, and TF
    would otherwise wait for them at start-up.
    """
    import tensorflow as tf

    spec = resolver.cluster_spec().as_dict()
    training_jobs = {job: tasks for job, tasks in spec.items() if job in ("chief", "worker")}
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(training_jobs), task_type=resolver.task_type,
        task_id=resolver.task_id, rpc_layer=resolver.rpc_layer or "grpc")


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
    """

    name = "tensorflow"

    def __init__(self, resolver: ClusterResolver, options: CommunicationOptions,
                 tf_config_at_creation: str = ""):
        super().__init__(resolver, options, tf_config_at_creation)
        from keras_mwms import devices

        self._gpu_count = devices.local_gpu_count()
        self.implementation = resolve_engine(options.implementation, self._gpu_count)
        self.strategy = None

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
    def join(self) -> None:
        import tensorflow as tf

        apply_keras_patches()
        tf_options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.options.bytes_per_pack,
            timeout_seconds=self.collective_timeout_seconds,
            implementation=getattr(tf.distribute.experimental.CommunicationImplementation,
                                   self.implementation.value),
        )
        if self.num_workers > 1:
            cluster_resolver = tf_cluster_resolver(self.resolver)
        else:
            # One worker: a local strategy (no gRPC server), i.e. plain Keras behaviour.
            cluster_resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec({}), task_type="worker", task_id=0)
        try:
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=cluster_resolver, communication_options=tf_options)
        except RuntimeError as error:
            if "configured at program startup" not in str(error):
                raise
            raise RuntimeError(
                "TensorFlow already ran an operation in this process (a tensor, a Keras layer or "
                "variable, keras.utils.set_random_seed(), ...) before "
                "keras_mwms.MultiWorkerMirroredStrategy() was created, so its collectives can no "
                "longer be configured. Create the strategy first, right after the imports, and "
                "build models, seeds and data afterwards."
            ) from error
        _backends_by_tf_strategy[id(self.strategy)] = self
        tensorflow_gradients.install()
        tensorflow_gradients.wrap_run(self.strategy)

    @property
    def replicas_per_worker(self) -> int:
        return len(self.strategy.extended.worker_devices)

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

    # -- primitives for callbacks ---------------------------------------------------------
    def _all_reduce_sum(self, array: np.ndarray, contributing_replica: int | None = None) -> np.ndarray:
        """SUM of `array` over workers; only `contributing_replica` adds it if given (others add 0)."""
        import tensorflow as tf

        first_local_replica = self.worker_index * self.replicas_per_worker

        def value_for(context):
            replica = context.replica_id_in_sync_group
            if contributing_replica is None:
                keep = replica == first_local_replica
            else:
                keep = replica == contributing_replica
            return tf.constant(array if keep else np.zeros_like(array))

        per_replica = self.strategy.experimental_distribute_values_from_function(value_for)
        return np.asarray(self._traced_sum(per_replica))

    @functools.cached_property
    def _traced_sum(self):
        """SUM across replicas inside a `tf.function`: eagerly, TF logs "Using
        CollectiveAllReduceStrategy eagerly has significant overhead" on every call (every
        epoch of BackupAndRestore)."""
        import tensorflow as tf

        return tf.function(lambda per_replica: self.strategy.reduce("SUM", per_replica, axis=None),
                           reduce_retracing=True)

    def all_reduce_sum(self, array: np.ndarray) -> np.ndarray:
        """SUM of every worker's `array` (numpy in, numpy out)."""
        return self._all_reduce_sum(np.asarray(array))

    def all_reduce(self, value: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum, min or max of a host array over workers (min/max from one all-gather)."""
        value = np.asarray(value)
        if op == "sum":
            return self.all_reduce_sum(value)
        gathered = self.all_gather(value)
        return gathered.min(axis=0) if op == "min" else gathered.max(axis=0)

    def update_config_proto(self, config_proto: Any) -> Any:
        """compat.v1: a copy of `config_proto` with this strategy's collective settings."""
        return self.strategy.extended._update_config_proto(config_proto)

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


# -- Keras trainer wrappers ---------------------------------------------------------------

def _backend_for_model(model) -> TensorFlowBackend | None:
    strategy = getattr(model, "_distribute_strategy", None)
    return _backends_by_tf_strategy.get(id(strategy)) if strategy is not None else None


def _active_facade():
    from keras_mwms.strategy import get_strategy

    facade = get_strategy()
    return facade if facade is not None and isinstance(facade.backend, TensorFlowBackend) else None


def _shard_policy_is_off(dataset) -> bool:
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset):
        return False
    policy = dataset.options().experimental_distribute.auto_shard_policy
    return policy == tf.data.experimental.AutoShardPolicy.OFF


def _unsharded_steps(dataset, cardinality: int, num_replicas: int, replicas_per_worker: int) -> int:
    """Steps a worker runs over its whole `AutoShardPolicy.OFF` dataset of `cardinality` batches.

    TF splits every batch into one piece per replica (`replica_slices`) and drops empty pieces,
    so a partial last batch may give fewer pieces; this worker's replicas take
    `replicas_per_worker` pieces per step.
    """
    from keras_mwms.data import replica_slices

    if cardinality == 0:
        return 0
    global_batch = int(next(iter(dataset.take(1).map(_batch_rows))))
    last_rows = int(next(iter(dataset.skip(cardinality - 1).map(_batch_rows))))
    last_pieces = sum(stop > start for start, stop in replica_slices(global_batch, num_replicas, last_rows))
    pieces = (cardinality - 1) * num_replicas + last_pieces
    return -(-pieces // replicas_per_worker)


def _batch_rows(*batch):
    import tensorflow as tf

    return tf.shape(tf.nest.flatten(batch)[0])[0]


def _distribute_unsharded_dataset(backend: TensorFlowBackend, dataset, what: str):
    """An `AutoShardPolicy.OFF` dataset, distributed, so that Keras runs all of it.

    With OFF each worker's dataset is its own data, batched at the global batch; TF splits every
    such batch into one piece per replica, and this worker feeds all of the pieces — so an
    epoch has `cardinality × num_workers` steps. Keras counts `cardinality` and silently stops
    halfway; here the distributed dataset reports the true length. Every worker must run the
    same number of steps, so the lengths are compared first.
    """
    cardinality = int(dataset.cardinality())
    if cardinality < 0:
        raise ValueError(
            f"{what}: a tf.data dataset with AutoShardPolicy.OFF and unknown length cannot run on "
            "a multi-worker strategy: every worker must run the same number of steps. Make the "
            "length known with dataset.apply(tf.data.experimental.assert_cardinality(n)), or "
            "shard with AutoShardPolicy.DATA instead.")
    steps = _unsharded_steps(dataset, cardinality, backend.num_replicas_in_sync,
                             backend.replicas_per_worker)
    distributed = backend.strategy.experimental_distribute_dataset(dataset)
    if not hasattr(distributed, "_cardinality"):
        raise NotImplementedError(
            f"{what}: AutoShardPolicy.OFF needs TensorFlow 2.21's DistributedDataset, which this "
            "TensorFlow lacks. Shard with AutoShardPolicy.DATA, or distribute the input with "
            "strategy.distribute_datasets_from_function.")
    # TF 2.21 reports the *input* dataset's cardinality for the distributed one
    # (input_lib.DistributedDataset.build), which is what Keras counts steps with.
    distributed._cardinality = steps
    # sum(s) and sum(s²) over workers equal n·s and n·s² only when every worker has s steps.
    totals = backend._all_reduce_sum(np.array([steps, steps * steps], np.int64))
    if totals.tolist() != [steps * backend.num_workers, steps * steps * backend.num_workers]:
        raise ValueError(
            f"{what}: the workers' AutoShardPolicy.OFF datasets have different lengths (this "
            f"worker: {steps} steps), so they would run different numbers of steps and hang. "
            "Give every worker the same number of batches.")
    return distributed


def _prepare_call(model, method: str, bound: inspect.BoundArguments) -> None:
    """Adjusts one fit/evaluate/predict call of a model built in our scope (see module doc)."""
    import tensorflow as tf

    facade = _active_facade()
    if facade is not None:
        facade.check_tf_config_unchanged()
    backend = _backend_for_model(model)
    arguments = bound.arguments
    if backend is None:
        if facade is not None and facade.num_workers > 1:
            warnings.warn(
                f"model.{method}() runs on this worker alone: the model was not created inside "
                "keras_mwms strategy.scope(). Create the model (and compile it) under "
                "`with strategy.scope():` to train on all workers.", stacklevel=4)
        return
    if not backend.is_chief:
        # The chief's progress bar and epoch lines are the job's (logs are global): N identical
        # copies would interleave in one log.
        arguments["verbose"] = 0
    x = arguments.get("x")
    if method == "fit" and arguments.get("shuffle", True) and not isinstance(x, tf.data.Dataset):
        # Also on one worker, so that N workers and one process draw the same permutation.
        _align_shuffle_seed(backend)
    if backend.num_workers == 1:
        return
    if method in ("fit", "evaluate"):
        _check_same_rows(backend, x, f"model.{method}()")
    if method == "fit":
        from keras_mwms.data import warn_if_first_batches_differ

        warn_if_first_batches_differ(backend, x, f"model.{method}()", _shard_policy_is_off(x), stacklevel=5)
        if inspect.isgenerator(x):
            warnings.warn(
                "keras_mwms (TensorFlow): model.fit() on a Python generator with several workers "
                "can intermittently lose batches (TF's prefetching iterators share the one "
                "generator; seen in a few runs of the test suite, never in the row-count "
                "checks). Wrap the data in a keras.utils.PyDataset or a tf.data.Dataset for "
                "exact results.", stacklevel=4)
    if model.jit_compile and backend._gpu_count == 0:
        _compile_without_xla(model)
    if getattr(model, "steps_per_execution", 1) > 1:
        raise NotImplementedError(
            f"model.{method}() with steps_per_execution={model.steps_per_execution} is not "
            "supported on a multi-worker TensorFlow strategy with Keras 3.15: Keras' multi-step "
            "loop puts collectives inside tf.cond/tf.while_loop, which fails with 'You must feed "
            "a value for placeholder tensor'. Compile with steps_per_execution=1.")
    if _shard_policy_is_off(x) and method != "predict":
        arguments["x"] = _distribute_unsharded_dataset(backend, x, f"model.{method}()")


def _compile_without_xla(model) -> None:
    """`jit_compile=True` on CPU workers: TF's XLA has no CPU collectives, so train unjitted.

    TensorFlow 2.21 fails such a step with "Collectives are not yet implemented for CPU devices
    when compiling with XLA" (b/194942685), and a worker may abort with a double free. Keras'
    default `jit_compile="auto"` already picks False on CPU-only machines; an explicit True is
    turned off here, with a warning, before Keras builds its step functions.
    """
    warnings.warn(
        "jit_compile=True is ignored on this multi-worker TensorFlow job: TensorFlow's XLA cannot "
        "compile cross-worker collectives on CPU devices (b/194942685), so keras_mwms trains "
        "with jit_compile=False. Use GPU workers for XLA, or compile with jit_compile='auto'.",
        stacklevel=4)
    model.jit_compile = False
    model.train_function = model.test_function = model.predict_function = None


def _check_same_rows(backend: TensorFlowBackend, x, what: str) -> None:
    """Every worker must pass arrays of one length; else a clear error everywhere (one all-reduce).

    Different lengths give workers different step counts: a collective mismatch, not a hang
    we could name, so it is caught before the first step.
    """
    from keras_mwms.data import leading_rows, uneven_rows_error

    rows = leading_rows(x)
    mine = np.zeros((backend.num_workers,), np.int64)
    mine[backend.worker_index] = 0 if rows is None else rows + 1   # 0 encodes "not arrays"
    everyone = [int(value) - 1 if value else None for value in backend._all_reduce_sum(mine)]
    error = uneven_rows_error(everyone, backend.worker_index, what)
    if error is not None:
        raise error


def _align_shuffle_seed(backend: TensorFlowBackend) -> None:
    """Makes Keras' shuffles draw the chief's order on every worker.

    Keras shuffles arrays inside a tf.data graph whose random ops are seeded from TF's global
    seed, and a PyDataset's batch order with Python's `random`; workers seeded differently
    would each take their slice of a *different* order (rows duplicated and lost). The chief's
    global seed (one drawn from NumPy when it has none) and Python `random` state are set on
    the workers where they differ; the chief's own state is left as it is, so its order is
    the one plain Keras draws in one process with the same seeds.
    """
    import random

    import tensorflow as tf
    from tensorflow.python.eager import context

    own_seed = context.global_seed()
    chosen = own_seed if own_seed is not None else int(np.random.randint(0, 2**31 - 1))
    seed, python_state = backend.broadcast_object((chosen, random.getstate()))
    if seed != own_seed:
        tf.random.set_seed(seed)
    if python_state != random.getstate():
        random.setstate(python_state)


def _wrap_trainer_method(method_name: str, original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        _prepare_call(self, method_name, bound)
        backend = _backend_for_model(self)
        if method_name == "predict" and backend is not None and backend.num_workers > 1:
            return _predict_on_this_worker(self, original, bound)
        in_keras_loop = (tensorflow_gradients.keras_loop() if backend is not None
                         and method_name in ("fit", "evaluate") else contextlib.nullcontext())
        try:
            with in_keras_loop:
                return original(*bound.args, **bound.kwargs)
        except Exception as error:
            _raise_if_worker_lost(_backend_for_model(self), f"model.{method_name}()", error)
            raise

    method.__keras_mwms_original__ = original
    return method


_local_predict_functions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _predict_on_this_worker(model, original: Callable, bound: inspect.BoundArguments):
    """`model.predict` of a multi-worker model, on this worker alone, without any collective.

    Predictions need no collective: every worker predicts all rows itself (the variables are
    identical everywhere). So `if strategy.is_chief: model.predict(...)`, a path one worker
    runs alone, cannot hang or abort the peers' collectives, and every worker gets the whole
    result in order. The model's strategy is set aside for the call; its local predict
    function is kept for the next call.
    """
    saved_strategy, saved_function = model._distribute_strategy, model.predict_function
    model._distribute_strategy = None
    model.predict_function = _local_predict_functions.get(model)
    try:
        return original(*bound.args, **bound.kwargs)
    finally:
        _local_predict_functions[model] = model.predict_function
        model._distribute_strategy, model.predict_function = saved_strategy, saved_function


def _raise_if_worker_lost(backend: TensorFlowBackend | None, what: str, error: Exception) -> None:
    """Turns TF's lost-peer errors (heartbeats, aborted collectives) into `WorkerLostError`.

    TF names the lost task as `/job:worker/replica:0/task:1` deep inside a graph traceback;
    we name it like the other backends do, and bound the exit (TF's teardown may linger).
    """
    import tensorflow as tf

    lost_peer_errors = (tf.errors.UnavailableError, tf.errors.AbortedError,
                        tf.errors.DeadlineExceededError)
    if backend is None or backend.num_workers == 1 or not isinstance(error, lost_peer_errors):
        return
    text = str(error)
    # "... The following tasks are unhealthy (stopped sending heartbeats): /job:worker/...task:1"
    listed = text.split("unhealthy", 1)[1] if "unhealthy" in text else text
    ranks = []
    for job, index in _TASK_PATTERN.findall(listed):
        task = (job, int(index))
        if task in backend.resolver.group_tasks:
            rank = backend.resolver.group_tasks.index(task)
            if rank != backend.worker_index and rank not in ranks:
                ranks.append(rank)
    names = [f"worker {rank} ({job}:{index} at {backend.resolver.worker_addresses[rank]})"
             for rank in ranks for job, index in [backend.resolver.group_tasks[rank]]]
    reason = next((line.strip() for line in text.splitlines()
                   if "unhealthy" in line or "aborted" in line.lower()), text.splitlines()[0])
    message = (
        f"keras_mwms worker {backend.worker_index}: lost {', '.join(names) or 'a peer worker'} "
        f"during {what}: {type(error).__name__}: {reason[:300]} Synchronous training cannot "
        "continue; every worker stops. Restart the job (`python -m keras_mwms.launch "
        "--max-restarts N`) and use keras_mwms.callbacks.BackupAndRestore to resume.")
    print(message, file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(_EXIT_WATCHDOG_SECONDS, exit=True)
    raise WorkerLostError(message) from error


# -- Keras 3.15.1 patches -----------------------------------------------------------------

def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Keras' `TensorFlowTrainer._maybe_symbolic_build`, building from one local replica's batch.

    keras-team/keras#20585, tensorflow/tensorflow#72388: Keras 3.15.1 calls
    `strategy.reduce("MEAN", whole_batch_tuple, axis=None)`; the collective strategy cannot
    reduce a nest (`ValueError: Attempt to convert a value (PerReplica...)`). The build only
    needs shapes and dtypes, so this takes this worker's first replica's batch, leaf by leaf,
    without any collective.
    """
    import tensorflow as tf
    from keras.src import tree

    if self._distribute_strategy is None:
        return
    if iterator is not None:
        data_batch = _batch_without_iterating(getattr(iterator, "data_adapter", None))
    if iterator is not None and data_batch is None:
        for _, _, batches in iterator:
            batch = next(batches)
            data_batch = tree.map_structure(
                lambda leaf: self.distribute_strategy.experimental_local_results(leaf)[0]
                if isinstance(leaf, tf.distribute.DistributedValues) else leaf, batch)
            break
    with self.distribute_strategy.scope():
        self._symbolic_build(data_batch=data_batch)


def _batch_without_iterating(adapter):
    """A batch for the symbolic build that consumes nothing from a generator or a PyDataset.

    Iterating the epoch iterator for the build, as Keras does, pulls batches out of a Python
    generator through tf.data's prefetch thread (an unknown number of them, lost for the
    epoch), and draws one more PyDataset shuffle from Python's `random`; one process of plain
    Keras does neither.
    """
    from keras.src.trainers.data_adapters.generator_data_adapter import GeneratorDataAdapter
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter

    if isinstance(adapter, GeneratorDataAdapter):
        return adapter._first_batches[0]
    if isinstance(adapter, PyDatasetAdapter):
        batch = adapter.py_dataset[0]
        return batch if isinstance(batch, tuple) else (batch,)
    if isinstance(adapter, TFDatasetAdapter):
        # A new iterator of a dataset shuffled with `reshuffle_each_iteration` advances its
        # seed: training would start at the *second* shuffle order. Zeros of the element spec
        # have the shapes and dtypes the build needs.
        return _zeros_like_spec(adapter._dataset.element_spec)
    return None


def _zeros_like_spec(spec):
    """A batch of zeros matching a dataset's dense `element_spec` (batch dimension 1), else None."""
    import tensorflow as tf

    leaves = tf.nest.flatten(spec)
    if not all(isinstance(leaf, tf.TensorSpec) for leaf in leaves):
        return None
    batch = tf.nest.map_structure(
        lambda leaf: tf.zeros([1 if size is None else size for size in leaf.shape], leaf.dtype), spec)
    return batch if isinstance(batch, tuple) else (batch,)


def _make_reduce_per_replica(original: Callable) -> Callable:
    """Keras' `reduce_per_replica`, reducing scalar logs with `axis=None` on multi-worker strategies.

    keras-team/keras#20585: for `MultiWorkerMirroredStrategy` Keras 3.15.1 reduces every log
    value with `strategy.reduce("MEAN", value, axis=0)`, which fails on the scalar loss and
    metrics (`Invalid reduction dimension 0 for input with 0 dimensions`); its `"sum"` branch
    omits the required `axis`. Rank-0 values are reduced across replicas only.
    """
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tensorflow_trainer

    def rank(value):
        import tensorflow as tf

        if isinstance(value, tf.distribute.DistributedValues):
            value = value.values[0]
        return getattr(getattr(value, "shape", None), "rank", None)

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if reduction == "auto":
            reduction = "mean"
        if reduction in ("mean", "sum") and tensorflow_trainer._collective_all_reduce_multi_worker(strategy):
            operation = reduction.upper()
            return tree.map_structure(
                lambda value: strategy.reduce(operation, value,
                                              axis=None if rank(value) == 0 or operation == "SUM" else 0),
                values)
        return original(values, strategy, reduction)

    reduce_per_replica.__keras_mwms_original__ = original
    return reduce_per_replica


def apply_keras_patches() -> None:
    """Applies the Keras 3.15.1 repairs and the fit/evaluate/predict wrappers, once per process."""
    global _KERAS_PATCHED
    if _KERAS_PATCHED:
        return
    from keras.src.backend.tensorflow import trainer as tensorflow_trainer

    require_tested_keras("tensorflow.maybe_symbolic_build_per_leaf")
    tensorflow_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    require_tested_keras("tensorflow.reduce_per_replica_scalar_axis")
    tensorflow_trainer.reduce_per_replica = _make_reduce_per_replica(tensorflow_trainer.reduce_per_replica)
    require_tested_keras("tensorflow.trainer_call_wrappers")
    for method_name in ("fit", "evaluate", "predict"):
        original = getattr(tensorflow_trainer.TensorFlowTrainer, method_name)
        setattr(tensorflow_trainer.TensorFlowTrainer, method_name, _wrap_trainer_method(method_name, original))
    _KERAS_PATCHED = True
