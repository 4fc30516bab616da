"""The interface every backend adapter implements, and helpers they share.

The facade (`keras_mwms.strategy.MultiWorkerMirroredStrategy`) owns start-up order: it
resolves the cluster, runs the rendezvous, then constructs the backend and calls `join()`.
Everything after that — mirrored variables, gradient all-reduce, data sharding, global metrics,
the tf.distribute-style methods — is the backend's job.
"""

from __future__ import annotations

import abc
import contextlib
import os
import warnings
from collections.abc import Callable
from typing import Any

from keras_mwms.cluster import ClusterResolver
from keras_mwms.communication import CommunicationOptions

TESTED_KERAS_VERSIONS = ("3.15.1",)


def require_tested_keras(patch_name: str) -> None:
    """Fails loudly before applying a private-Keras patch to an untested Keras release.

    Set `KERAS_MWMS_ALLOW_UNTESTED_KERAS=1` to try anyway (at your own risk).

    Example:

    >>> require_tested_keras("example")   # passes on the tested Keras
    """
    import keras

    if keras.__version__ in TESTED_KERAS_VERSIONS:
        return
    if os.environ.get("KERAS_MWMS_ALLOW_UNTESTED_KERAS") == "1":
        warnings.warn(f"keras_mwms patch {patch_name!r} applied to untested Keras {keras.__version__}.",
                      stacklevel=2)
        return
    raise RuntimeError(
        f"keras_mwms patch {patch_name!r} patches private Keras internals and is tested only with "
        f"Keras {', '.join(TESTED_KERAS_VERSIONS)}; this is Keras {keras.__version__}. Install a "
        "tested Keras (pip install keras==3.15.1) or set KERAS_MWMS_ALLOW_UNTESTED_KERAS=1 to try."
    )


class Backend(abc.ABC):
    """One backend's engine: join, scope, collectives, data distribution, leave.

    Args:
        resolver: the validated cluster and this task.
        options: the user's `CommunicationOptions`.
    """

    name: str = ""

    def __init__(self, resolver: ClusterResolver, options: CommunicationOptions):
        self.resolver = resolver
        self.options = options

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

    def leave(self) -> None:  # noqa: B027 - optional hook, most engines need no teardown
        """Tears the engine down; safe to call twice."""

    # -- tf.distribute-style surface ------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas across all workers."""

    @abc.abstractmethod
    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which models and optimizers get mirrored variables."""

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

    # -- primitives for callbacks ---------------------------------------------------------
    @abc.abstractmethod
    def barrier(self, name: str = "barrier") -> None:
        """Blocks until every worker reached the same barrier (bounded by the collective timeout)."""

    @abc.abstractmethod
    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        """Returns worker `root`'s picklable `value` on every worker."""
