"""The interface every backend adapter implements: an engine with a small collective port.

The facade (`keras_mwms.strategy.MultiWorkerMirroredStrategy`) owns start-up order: it
resolves the cluster, runs the rendezvous, then constructs the backend (handing it what it
needs: the resolver, the options, the TF_CONFIG it saw) and calls `join()`, which starts the
engine; then it installs the backend's `patch_table()` with every other table
(`keras_mwms.active.Session`). `close()` uninstalls them and calls `leave()`.

The **collective port** — `all_reduce` (sum/min/max of NumPy values), `all_gather`,
`broadcast_object`, `broadcast_arrays`, `agreed_seed`, `barrier` — is what the shared policy
(`keras_mwms.backends.policy`) and the callbacks build on; a backend implements
`all_reduce`, `broadcast_object` and `barrier`, the rest has portable defaults it may speed up.
Everything else — mirrored variables, gradient all-reduce, data sharding, the
tf.distribute-style methods — is the backend's own job.
"""

from __future__ import annotations

import abc
import contextlib
import os
import random
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from keras_mwms.backends import consistency, model_scope, policy
from keras_mwms.backends.patches import PatchTable
from keras_mwms.communication import CommunicationOptions
from keras_mwms.startup.cluster import TF_CONFIG_ENV, ClusterResolver

REDUCE_OPS = ("sum", "min", "max")


class Backend(abc.ABC):
    """One backend's engine: join, scope, collective port, data distribution, leave.

    A new backend subclasses this, implements the abstract methods and lists its Keras
    patches as a `PatchTable` in `patch_table()`; see ARCHITECTURE.md.

    Args:
        resolver: the validated cluster and this task.
        options: the user's `CommunicationOptions`.
        tf_config_at_creation: the `TF_CONFIG` text the strategy saw when it was created.
    """

    name: str = ""

    def __init__(self, resolver: ClusterResolver, options: CommunicationOptions,
                 tf_config_at_creation: str = ""):
        self.resolver = resolver
        self.options = options
        self.tf_config_at_creation = tf_config_at_creation

    # -- identity -------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return self.resolver.num_workers

    @property
    def worker_index(self) -> int:
        return self.resolver.worker_index or 0

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    @staticmethod
    @abc.abstractmethod
    def version() -> str:
        """The backend library's version, for the rendezvous fingerprint."""

    def engine_description(self) -> str:
        """The concrete collective engine chosen from `options.implementation` (for the fingerprint)."""
        return self.options.implementation.value

    # -- life cycle -----------------------------------------------------------------------
    @abc.abstractmethod
    def join(self) -> None:
        """Starts the backend's collective engine; called after the rendezvous succeeded."""

    def use_compute_threads(self, threads: int) -> bool:
        """Runs this worker's CPU math on `threads` threads before `join`; False where the
        backend cannot change them once its runtime started (the default)."""
        return False

    def leave(self) -> None:  # noqa: B027 - optional hook, most engines need no teardown
        """Tears the engine down; safe to call twice."""

    def patch_table(self) -> PatchTable:
        """This backend's private-Keras patches (none by default); the strategy installs them
        with its other tables and uninstalls them at `close()`."""
        return PatchTable(self.name or type(self).__name__, [])

    @staticmethod
    def crash_repairs() -> PatchTable:
        """The rows of `patch_table()` that only keep Keras' own multi-worker training from
        crashing, as a table of their own, for Keras with the framework's strategy and no
        keras_mwms (the benchmark's native peer); none by default.

        Example:

        >>> [row.name for row in Backend.crash_repairs()]
        []
        """
        return PatchTable("crash repairs", [])

    def check_tf_config_unchanged(self, stacklevel: int = 3) -> None:
        """Warns when `TF_CONFIG` appeared or changed after the strategy was created."""
        current = os.environ.get(TF_CONFIG_ENV, "")
        if current != self.tf_config_at_creation:
            state = "was set" if not self.tf_config_at_creation else "changed"
            warnings.warn(
                f"TF_CONFIG {state} after keras_mwms.MultiWorkerMirroredStrategy was created; this "
                f"job still trains as {self.num_workers} worker(s) with the cluster it saw at "
                "creation. Set TF_CONFIG before creating the strategy.",
                stacklevel=stacklevel + 1,
            )

    # -- tf.distribute-style surface ------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas across all workers."""

    @abc.abstractmethod
    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which models and optimizers get mirrored variables."""

    @property
    def in_scope(self) -> bool:
        """Whether this thread is inside `scope()` now (models created there train on all workers)."""
        return False

    def uses(self, model: Any) -> bool:
        """Whether `model` was created in this backend's scope (`keras_mwms.backends.model_scope`)."""
        return model_scope.backend_of(model) is self

    @abc.abstractmethod
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs `fn` on every local replica (see `MultiWorkerMirroredStrategy.run`)."""

    @abc.abstractmethod
    def reduce(self, reduce_op: str, value: Any, axis: int | None) -> Any:
        """Reduces per-replica values across all replicas of all workers."""

    @abc.abstractmethod
    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's per-replica components of `value`."""

    @abc.abstractmethod
    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Distributes a dataset batched at the global batch size."""

    @abc.abstractmethod
    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Calls `dataset_fn(InputContext)` for this worker's pipeline and distributes the result."""

    def update_config_proto(self, config_proto: Any) -> Any:
        """compat.v1 `update_config_proto`: only meaningful on TensorFlow."""
        raise NotImplementedError(
            f"update_config_proto configures TensorFlow sessions; the {self.name or type(self).__name__} "
            "backend has none. Remove the call (keras_mwms configures the engine itself), or use "
            "KERAS_BACKEND=tensorflow."
        )

    # -- collective port ------------------------------------------------------------------
    @abc.abstractmethod
    def barrier(self, name: str = "barrier") -> None:
        """Blocks until every worker reached the same barrier (bounded by the collective timeout)."""

    @abc.abstractmethod
    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        """Returns worker `root`'s picklable `value` on every worker."""

    @abc.abstractmethod
    def all_reduce(self, value: np.ndarray, op: str = "sum") -> np.ndarray:
        """Element-wise sum, min or max of a NumPy array over all workers (same dtype and shape)."""

    def all_reduce_sum(self, value: np.ndarray) -> np.ndarray:
        """`all_reduce(value, "sum")`."""
        return self.all_reduce(value, "sum")

    def all_gather(self, value: np.ndarray) -> np.ndarray:
        """Every worker's `value` stacked in worker order: shape `(num_workers, *value.shape)`.

        The default sums a zero-padded stack (exact: adding zeros changes no bits).
        """
        value = np.asarray(value)
        stacked = np.zeros((self.num_workers, *value.shape), value.dtype)
        stacked[self.worker_index] = value
        return np.asarray(self.all_reduce(stacked, "sum")) if self.num_workers > 1 else stacked

    def broadcast_arrays(self, values: list[np.ndarray], root: int = 0) -> list[np.ndarray]:
        """Worker `root`'s arrays on every worker."""
        return [np.asarray(value) for value in self.broadcast_object(
            [np.asarray(value) for value in values], root=root)]

    def agreed_seed(self, own: int | None = None) -> int:
        """One seed for every worker: the chief's `own`, or one the chief draws when it has none."""
        chosen = own if own is not None else random.SystemRandom().randrange(2**31 - 1)
        return int(self.broadcast_object(chosen))

    def trains_on_all_workers(self, model: Any) -> bool:
        """Whether `model` trains synchronously on every worker (a backend may exempt models
        created outside its scope, which train on each worker alone)."""
        return True

    def check_workers_agree(self, model: Any, where: str) -> None:
        """Raises `keras_mwms.WorkersDifferError` on every worker if the workers' model or
        optimizer variables differ (`keras_mwms.backends.consistency`); every worker calls it."""
        if self.trains_on_all_workers(model):
            consistency.check_model(self, model, where)

    def worker_lost(self, where: str, error: BaseException, lost_ranks: list[int]) -> NoReturn:
        """Raises `keras_mwms.WorkerLostError` in the one format, with the bounded exit armed."""
        policy.raise_worker_lost(self, where, error, lost_ranks)
        raise AssertionError("unreachable")
