"""`MultiWorkerMirroredStrategy`: the facade users see, on every Keras backend.

Construction order is the whole point of this module:

1. **resolve** — take the given resolver, else detect the orchestrator (`TF_CONFIG`, a Slurm
   step, torchrun, MPI: `keras_mwms.resolvers.detect`) and log the chosen source on the chief;
2. **check Keras** — every private Keras name the backend needs, and the releases
   (`keras_mwms.backends.keras_api.usability.require_usable`): a Keras keras_mwms cannot serve
   fails every worker here, in seconds, not after the rendezvous;
3. **rendezvous** — meet every worker over plain TCP, bounded and fingerprinted, so a missing
   or misconfigured worker is named instead of hanging a backend forever;
4. **join** — start the backend's real collective engine (TF collectives, `jax.distributed`,
   `torch.distributed`) on the chief's address;
5. **patch** — begin the strategy's `keras_mwms.active.Session`: every Keras patch table and
   service, in one order (`MultiWorkerMirroredStrategy._patch`); `close()` ends the session
   (everything undone in reverse, every piece of process-wide state reset) and leaves the engine.

Everything after construction is delegated to the backend adapter in `keras_mwms.backends`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from keras_mwms import active, devices, diagnostics, settings
from keras_mwms.backends import backend_class, callback_list, forked_children, model_scope, policy, resume
from keras_mwms.backends.keras_api.usability import require_usable
from keras_mwms.communication import CommunicationOptions
from keras_mwms.compat_v1 import CompatV1Methods
from keras_mwms.devices import threads
from keras_mwms.diagnostics import patches as diagnostics_patches
from keras_mwms.log import get_logger
from keras_mwms.resolvers.detect import describe_source, detect_cluster_resolver
from keras_mwms.startup.advice import advice_for
from keras_mwms.startup.cluster import TF_CONFIG_ENV, ClusterResolver
from keras_mwms.startup.rendezvous import Rendezvous
from keras_mwms.version import __version__

logger = get_logger(__name__)


def build_fingerprint(resolver: ClusterResolver, options: CommunicationOptions,
                      backend_name: str, backend_version: str, engine: str) -> dict[str, Any]:
    """The facts that must be identical on every worker, compared during the rendezvous.

    Example:

    >>> from keras_mwms.startup.cluster import SimpleClusterResolver
    >>> resolver = SimpleClusterResolver({"worker": ["h0:1", "h1:1"]}, "worker", 1)
    >>> build_fingerprint(resolver, CommunicationOptions(), "jax", "0.10.2", "gloo")["cluster"]
    ['worker:0@h0:1', 'worker:1@h1:1']
    """
    import keras

    return {
        "cluster": [f"{job}:{index}@{address}" for (job, index), address
                    in zip(resolver.group_tasks, resolver.worker_addresses)],
        "keras_mwms": __version__,
        "keras": keras.__version__,
        "backend": backend_name,
        "backend_version": backend_version,
        "engine": engine,
        "implementation": options.implementation.value,
    }


class MultiWorkerMirroredStrategy(CompatV1Methods):
    """Synchronous data-parallel training across workers, for Keras 3 on any backend.

    Each worker runs the same script; `TF_CONFIG` tells it the cluster and its place in it.
    Creating the strategy meets every other worker (a bounded rendezvous that names missing or
    misconfigured workers), then starts the backend's collective engine. Models and optimizers
    created inside `scope()` get mirrored variables, identical on every worker from step 0;
    `model.fit` then consumes one global batch per step, split across all replicas, with
    gradients all-reduced and global metrics in the logs.

    Without `TF_CONFIG` it reads the job from Slurm (`srun`), torchrun / PyTorchJob or MPI
    variables (`keras_mwms.resolvers`); without any, it runs a single worker, like plain Keras,
    and warns once.

    Example:

    ```python
    import keras, keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=64, epochs=2)   # 64 = the global batch
    ```

    Launch it locally with `python -m keras_mwms.launch --workers 2 train.py`.

    `strategy.close()` (or leaving a `with MultiWorkerMirroredStrategy() as strategy:` block)
    restores every Keras internal keras_mwms patched, resets keras_mwms' process-wide state and
    leaves the backend's process group or distributed runtime; without it, that happens when
    the process exits.

    Args:
        communication_options: a `CommunicationOptions` (engine, collective timeout, packing,
            rendezvous timeout). Default: AUTO.
        cluster_resolver: any resolver of `keras_mwms` or `keras_mwms.resolvers`. Default:
            detected from the environment: `TF_CONFIG`, else a Slurm job step, else torchrun,
            else MPI, else JAX's variables, else SkyPilot, else a single worker. The chief logs
            the source once when it was detected or the resolver read a launcher's variables.

    Raises:
        TFConfigError: `TF_CONFIG` (or the resolver's cluster) cannot describe a valid job.
        ClusterEnvironmentError: a launcher's variables (Slurm, torchrun, MPI, JAX, SkyPilot) cannot describe a valid job.
        EnvironmentVariableError: a `KERAS_MWMS_*` variable holds a value it cannot read.
        GpuAssignmentError: the GPUs this worker should use cannot be decided.
        RendezvousError: the workers did not all arrive in time, or disagree on the configuration.
        StrategyCreatedTooLateError: TensorFlow or JAX already ran a computation in this process.
        NcclUnavailableError: torch with `NCCL` requested where NCCL cannot run.

    All of them are `keras_mwms.errors.KerasMwmsError`s; during `fit`, a lost peer raises
    `WorkerLostError` and workers whose variables differ raise `WorkersDifferError`.
    """

    def __init__(self, communication_options: CommunicationOptions | None = None,
                 cluster_resolver: ClusterResolver | None = None):
        detected = cluster_resolver is None
        if detected:
            cluster_resolver = detect_cluster_resolver()
        # The chief names where the cluster came from: detected, or a resolver that read a
        # launcher itself (RayTrainClusterResolver under JaxTrainer is never detected).
        if ((detected or getattr(cluster_resolver, "source", None))
                and cluster_resolver.is_chief and cluster_resolver.num_workers > 1):
            logger.info(f"keras_mwms: cluster of {cluster_resolver.num_workers} workers from "
                        f"{describe_source(cluster_resolver)}", worker=cluster_resolver)
        self._resolver = cluster_resolver
        self._options = communication_options if communication_options is not None else CommunicationOptions()
        if not isinstance(self._options, CommunicationOptions):
            raise TypeError(
                "communication_options must be a keras_mwms.CommunicationOptions, got "
                f"{type(self._options).__name__}; build one with "
                "keras_mwms.CommunicationOptions(implementation=...)."
            )
        self._tf_config_at_creation = os.environ.get(TF_CONFIG_ENV, "")
        if self._resolver.worker_index is None:
            raise ValueError(
                f"This process is task {self._resolver.task_name}, which does not train: only "
                "`chief` and `worker` tasks join a MultiWorkerMirroredStrategy. Run evaluators "
                "without the strategy."
            )
        self._backend_name = devices.backend_name()
        missing = devices.missing_backend_error({"KERAS_BACKEND": self._backend_name})
        if missing is not None:
            raise missing
        # Before the rendezvous: a Keras keras_mwms cannot serve fails every worker at once.
        require_usable(self._backend_name)
        backend_type = backend_class(self._backend_name)
        self._backend = backend_type(self._resolver, self._options, self._tf_config_at_creation)
        # One worker by choice (`keras_mwms.launch --workers 1`, e.g. one TensorFlow worker with
        # every GPU of its host) is not the mistake the warning is about.
        launched_alone = bool(self._tf_config_at_creation) and settings.LOCAL_WORKERS.is_set() and settings.LOCAL_WORKERS.read() == 1
        if self._resolver.num_workers == 1 and not launched_alone:
            warnings.warn(
                "keras_mwms.MultiWorkerMirroredStrategy is running a single worker "
                + ("(TF_CONFIG lists one worker). " if self._tf_config_at_creation else
                   f"({self._resolver.source} has one worker). " if getattr(self._resolver, "source", None)
                   else "(TF_CONFIG is not set, nor a Slurm step, torchrun, MPI, JAX or SkyPilot variables). ")
                + "Set TF_CONFIG on every worker, start them with srun, torchrun or mpirun, or "
                "with `python -m keras_mwms.launch --workers N script.py`, to train on several.",
                stacklevel=2,
            )
        else:
            fingerprint = build_fingerprint(self._resolver, self._options, self._backend_name,
                                            backend_type.version(),
                                            self._backend.engine_description())
            names = [f"{job}:{index}" for job, index in self._resolver.group_tasks]
            # Host and GPUs differ per worker: not fingerprint, but two NCCL workers on one GPU
            # fail here, naming both, instead of in NCCL's "Duplicate GPU" minutes later.
            identity = devices.worker_identity(self._backend_name, self._resolver.num_workers)
            exclusive = policy.exclusive_gpus_reason(self._backend_name, self._options.implementation,
                                                     len(identity["gpus"]))
            hints = advice_for(self._resolver)
            Rendezvous(self._resolver.worker_addresses, self._resolver.worker_index, fingerprint,
                       timeout=self._options.rendezvous_timeout_seconds, names=names,
                       port_advice=hints.ports, members_advice=hints.members,
                       identity=identity, exclusive_gpus=exclusive).run()
        split = threads.plan(self._resolver.worker_addresses, self._resolver.worker_index)
        if split.threads and self._backend.use_compute_threads(split.threads) and self._resolver.is_chief:
            logger.info(split.announcement(), worker=self._resolver)
        forked_children.install()   # before the runtime's own SIGTERM handler exists
        self._backend.join()
        self._closed = False
        active.begin(self, self._backend, self._patch)

    def _patch(self, session: active.Session) -> None:
        """Every change a strategy makes to Keras and the process, in this order; `close()`
        undoes them in reverse. Nothing else installs a patch while a strategy is open."""
        backend = self._backend
        session.install(backend.patch_table())
        session.install(model_scope.PATCHES)
        if backend.num_workers > 1 and diagnostics.LEDGER.enabled:
            session.install(diagnostics_patches.PATCHES)
            labels = [policy.worker_label(self._resolver, rank) for rank in range(backend.num_workers)]
            session.start(lambda: diagnostics.start(backend, labels), diagnostics.stop)
        # Installed now but a no-op until a BackupAndRestore restore arms it
        # (`resume.skip_steps_in_next_training_epoch`).
        session.install(resume.PATCHES)
        # Imported here: keras_mwms.callbacks imports Keras, which the backend has now loaded.
        from keras_mwms.callbacks import agreement, worker_aware

        session.start(lambda: callback_list.convert_with(
            lambda callbacks: agreement.with_agreement(worker_aware.worker_aware(callbacks))),
            lambda: callback_list.convert_with(None))
        session.install(callback_list.PATCHES)

    def close(self) -> None:
        """Restores the Keras internals keras_mwms patched, resets keras_mwms' process-wide state
        (`keras_mwms.active`) and leaves the collective engine.

        Safe to call twice. After `close()` this strategy cannot train; create a new one (one
        worker: in the same process; TensorFlow's multi-worker collectives stay with the process).

        Example: `with keras_mwms.MultiWorkerMirroredStrategy() as strategy: ...`.
        """
        if self._closed:
            return
        self._closed = True
        try:
            active.end(self)
        finally:
            self._backend.leave()

    def __enter__(self) -> MultiWorkerMirroredStrategy:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        # A failed collective leaving the block is diagnosed before close() stops the watchdog
        # (TensorFlow's mismatched collectives raise on every worker: a desync, not a crash).
        diagnostics.on_escaping_error(error, traceback)
        self.close()
        return False

    # -- identity -------------------------------------------------------------------------
    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver: `task_type`, `task_id`, `cluster_spec()`, `is_chief`, `worker_index`."""
        return self._resolver

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas across all workers (workers × local devices)."""
        return self._backend.num_replicas_in_sync

    @property
    def is_chief(self) -> bool:
        """True on the worker that writes checkpoints and logs (`chief:0`, else `worker:0`)."""
        return self._resolver.is_chief

    @property
    def worker_index(self) -> int:
        """This worker's rank in the collective group (chief = 0)."""
        return self._resolver.worker_index

    @property
    def num_workers(self) -> int:
        """How many worker processes train together."""
        return self._resolver.num_workers

    @property
    def backend(self):
        """The backend adapter (advanced use: `keras_mwms.backends.*`)."""
        return self._backend

    def check_tf_config_unchanged(self) -> None:
        """Warns when `TF_CONFIG` appeared or changed after the strategy was created."""
        self._backend.check_tf_config_unchanged(stacklevel=3)

    # -- tf.distribute surface ------------------------------------------------------------
    def scope(self):
        """Context manager: models, optimizers and metrics created inside are mirrored.

        Example: `with strategy.scope(): model = make_model(); model.compile(...)`.
        """
        return self._backend.scope()

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs `fn(*args, **kwargs)` on every local replica; returns per-replica results.

        Example: `per_replica_loss = strategy.run(train_step, args=(batch,))`.
        """
        return self._backend.run(fn, args, kwargs)

    def reduce(self, reduce_op: Any, value: Any, axis: int | None) -> Any:
        """Reduces a per-replica `value` across all replicas of all workers.

        Args:
            reduce_op: `"SUM"` or `"MEAN"` (or a `tf.distribute.ReduceOp`).
            value: a per-replica value from `run`, or a plain tensor.
            axis: also reduce along this axis of each replica's value (None: only across replicas).
        """
        name = getattr(reduce_op, "value", reduce_op)
        name = str(name).upper()
        if name not in ("SUM", "MEAN"):
            raise ValueError(f"reduce_op must be 'SUM' or 'MEAN', got {reduce_op!r}")
        return self._backend.reduce(name, value, axis)

    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's per-replica components of `value` as a tuple."""
        return self._backend.experimental_local_results(value)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Distributes a dataset batched at the **global** batch size across replicas."""
        return self._backend.experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Calls `dataset_fn(input_context)` on each worker; the dataset must be batched per replica.

        Example:

        ```python
        def dataset_fn(input_context):
            batch = input_context.get_per_replica_batch_size(64)
            return make_dataset().shard(input_context.num_input_pipelines,
                                        input_context.input_pipeline_id).batch(batch)
        dist_dataset = strategy.distribute_datasets_from_function(dataset_fn)
        ```
        """
        return self._backend.distribute_datasets_from_function(dataset_fn, options)

    def barrier(self, name: str = "barrier") -> None:
        """Waits until every worker reaches this point (bounded by the collective timeout)."""
        self._backend.barrier(name)

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(backend={self._backend_name}, "
                f"worker={self.worker_index}/{self.num_workers}, "
                f"replicas={self.num_replicas_in_sync})")


def get_strategy() -> MultiWorkerMirroredStrategy | None:
    """The most recently created strategy of this process, or None (used by callbacks).

    Example:

    >>> strategy = object()
    >>> session = active.begin(strategy, None); get_strategy() is strategy
    True
    >>> active.end(strategy); get_strategy() is None
    True
    """
    return active.active_strategy()
