"""`TorchBackend`: the torch engine plus the scope, the tf.distribute-style surface and the patches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from keras_mwms.backends.patches import PatchTable
from keras_mwms.backends.torch import data, patches
from keras_mwms.backends.torch.engine import TorchEngine
from keras_mwms.backends.torch.scope import ScopeVariables
from keras_mwms.backends.torch.state import backend_of
from keras_mwms.communication import CommunicationOptions
from keras_mwms.data import InputContext
from keras_mwms.startup.cluster import ClusterResolver


class TorchBackend(TorchEngine):
    """`torch.distributed` engine for `keras_mwms.MultiWorkerMirroredStrategy` on `KERAS_BACKEND=torch`.

    Built by the strategy; use it through the strategy, or directly for the primitives
    (`all_reduce`, `broadcast_object`, `barrier`, and the torch forms `all_reduce_flat`,
    `broadcast_tensors`).

    Example:

    ```python
    strategy = keras_mwms.MultiWorkerMirroredStrategy()     # KERAS_BACKEND=torch
    strategy.backend.broadcast_object({"run_id": 7})         # the chief's value everywhere
    ```

    One worker, not joined: every collective is the identity.

    >>> from keras_mwms.startup.cluster import SimpleClusterResolver
    >>> backend = TorchBackend(SimpleClusterResolver({"worker": ["localhost:2222"]}, "worker", 0),
    ...                        CommunicationOptions())
    >>> backend.reduce("SUM", backend.run(lambda t: t * 2, (torch.tensor([1.0, 2.0]),)), axis=None)
    tensor([2., 4.])
    >>> backend.all_reduce(np.array([3, 4]), "max").tolist(), backend.num_replicas_in_sync
    ([3, 4], 1)

    Args:
        resolver: the validated cluster and this task.
        options: the user's `CommunicationOptions`.
        tf_config_at_creation: the `TF_CONFIG` text the strategy saw when it was created.
    """

    def __init__(self, resolver: ClusterResolver, options: CommunicationOptions,
                 tf_config_at_creation: str = ""):
        super().__init__(resolver, options, tf_config_at_creation)
        self._scope_variables = ScopeVariables(self)

    def patch_table(self) -> PatchTable:
        """The torch rows (`keras_mwms.backends.torch.patches.PATCHES`), one table per process."""
        return patches.patch_table(self)

    # -- scope ----------------------------------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager:
        """Variables created inside take the chief's values when the outermost scope is left.

        See `keras_mwms.backends.torch.scope`: every worker must run the same
        `with strategy.scope():` blocks; a block that differs is a clear error on every worker.
        """
        return self._scope_variables.scope()

    @property
    def in_scope(self) -> bool:
        return self._scope_variables.active

    def trains_on_all_workers(self, model: Any) -> bool:
        return backend_of(model) is self

    def note_new_variable(self, variable) -> None:
        """Called for every new Keras variable; those created in `scope()` are agreed at its exit."""
        self._scope_variables.note(variable)

    # -- tf.distribute-style surface ------------------------------------------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        # One replica per worker: the per-replica value is the plain value.
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: str, value: Any, axis: int | None) -> Any:
        from keras import tree

        leaves = tree.flatten(value)
        tensors = [torch.as_tensor(np.asarray(leaf) if not torch.is_tensor(leaf) else leaf)
                   for leaf in leaves]
        if axis is None:
            sums = self.all_reduce_flat([t.detach().to(torch.float64 if not t.is_floating_point()
                                                       else t.dtype) for t in tensors],
                                        what="strategy.reduce")
            if reduce_op == "MEAN":
                sums = [s / self.num_replicas_in_sync for s in sums]
        else:
            local = [t.detach().sum(dim=axis) for t in tensors]
            counts = [torch.tensor(float(t.shape[axis]), dtype=torch.float64) for t in tensors]
            reduced = self.all_reduce_flat(local + counts, what="strategy.reduce")
            sums, totals = reduced[:len(local)], reduced[len(local):]
            if reduce_op == "MEAN":
                sums = [s / total.to(s.dtype) for s, total in zip(sums, totals)]
        return tree.pack_sequence_as(value, sums)

    def experimental_local_results(self, value: Any) -> tuple:
        return (value,)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return data.shard_global_batches(dataset, self, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        context = InputContext(self.num_workers, self.worker_index, self.num_replicas_in_sync)
        return dataset_fn(context)
