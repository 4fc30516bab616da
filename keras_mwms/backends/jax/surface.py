"""The tf.distribute-style surface on JAX: `run`, `reduce`, local results and distributed datasets.

For custom training loops. A worker's replicas are its local JAX devices; `run` calls the
function once per local replica (a `PerReplica` of the results when there are several), and
`reduce` sums or averages over all replicas of all workers with the engine's worker-order
all-reduce, so every worker gets identical bits. Datasets follow
`keras_mwms.data.replica_slices`: a global batch is split over all replicas in rank order, a
short last batch fills the replicas in order (trailing ones may get no rows).

`backend` below offers `num_workers`, `worker_index`, `num_replicas_in_sync`,
`replicas_per_worker` and `all_reduce_sum(array)` (a `JaxBackend`).

Example (one worker, one device):

>>> from types import SimpleNamespace as Object
>>> backend = Object(num_workers=1, worker_index=0, num_replicas_in_sync=1, replicas_per_worker=1,
...                  all_reduce_sum=lambda value: value)
>>> run(backend, lambda v: v * 2, args=(3,))
6
>>> [batch.tolist() for batch in distribute_dataset(backend, [np.arange(4)])]
[[0, 1, 2, 3]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms.backends.jax.data import DistributedDataset, split_local_replicas
from keras_mwms.data import InputContext, replica_slices


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


def run(backend: Any, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
    """`fn(*args, **kwargs)` once per local replica, each with its component of `PerReplica` arguments."""
    kwargs = kwargs or {}
    replicas = backend.replicas_per_worker

    def component(value, index):
        return value.values[index] if isinstance(value, PerReplica) else value

    results = []
    for index in range(replicas):
        call_args = tuple(component(arg, index) for arg in args)
        call_kwargs = {key: component(value, index) for key, value in kwargs.items()}
        results.append(fn(*call_args, **call_kwargs))
    return results[0] if replicas == 1 else PerReplica(tuple(results))


def local_results(value: Any) -> tuple:
    """This worker's per-replica components of `value`.

    Example:

    >>> local_results(PerReplica((1, 2))), local_results(3)
    ((1, 2), (3,))
    """
    return value.values if isinstance(value, PerReplica) else (value,)


def reduce(backend: Any, reduce_op: str, value: Any, axis: int | None) -> Any:
    """`"SUM"` or `"MEAN"` of a per-replica value (or a nest of them) over all replicas of all workers."""
    import jax

    # A nest (e.g. `(loss, gradients)` from a custom training step) is reduced leaf by leaf,
    # as on TensorFlow and torch, in one flat all-reduce per dtype.
    components = local_results(value)
    structure = jax.tree_util.tree_structure(components[0])
    per_leaf = zip(*[[np.asarray(jax.device_get(leaf)) for leaf in jax.tree_util.tree_leaves(part)]
                     for part in components])
    local_sums, local_counts = [], []
    for parts in per_leaf:
        if isinstance(value, PerReplica) or backend.replicas_per_worker == 1:
            local_counts.append(len(parts) if axis is None else sum(p.shape[axis] for p in parts))
        else:
            local_counts.append(1)
        summed = [part.sum(axis=axis) if axis is not None else part for part in parts]
        local_sums.append(np.sum(np.stack(summed), axis=0))
    totals = all_reduce_sum_nest(backend, local_sums)
    if reduce_op == "MEAN":
        counts = backend.all_reduce_sum(np.asarray(local_counts, dtype=np.float64))
        totals = [(total / count).astype(local.dtype)
                  for total, count, local in zip(totals, counts, local_sums)]
    return jax.tree_util.tree_unflatten(structure, totals)


def all_reduce_sum_nest(backend: Any, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """`all_reduce_sum` of several arrays: one flat collective per dtype, same bits as one by one.

    Example:

    >>> from types import SimpleNamespace as Object
    >>> one = Object(all_reduce_sum=lambda value: value)
    >>> [a.tolist() for a in all_reduce_sum_nest(one, [np.ones(2), np.zeros(1, "int32"), np.ones(1)])]
    [[1.0, 1.0], [0], [1.0]]
    """
    if len(arrays) == 1:
        return [backend.all_reduce_sum(arrays[0])]
    totals: list[Any] = [None] * len(arrays)
    for dtype in dict.fromkeys(array.dtype for array in arrays):  # same order on every worker
        indices = [i for i, array in enumerate(arrays) if array.dtype == dtype]
        flat = backend.all_reduce_sum(np.concatenate([arrays[i].ravel() for i in indices]))
        offset = 0
        for i in indices:
            totals[i] = flat[offset:offset + arrays[i].size].reshape(arrays[i].shape)
            offset += arrays[i].size
    return totals


def distribute_dataset(backend: Any, dataset: Any) -> DistributedDataset:
    """This worker's replicas' rows of every global batch (`experimental_distribute_dataset`).

    The global batch size is the first batch's row count; a shorter (last) batch fills the
    replicas in rank order, as `keras_mwms.data.replica_slices` says.
    """
    workers, index, replicas = backend.num_workers, backend.worker_index, backend.replicas_per_worker
    from keras import tree

    def local_part(batch, global_rows):
        leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
        rows = int(np.shape(leaves[0])[0])
        slices = (replica_slices(global_rows, workers * replicas, rows) if global_rows
                  else [(0, 0)] * (workers * replicas))
        first, last = slices[index * replicas][0], slices[(index + 1) * replicas - 1][1]
        return tree.map_structure(
            lambda leaf: None if leaf is None else np.asarray(leaf)[first:last], batch, none_is_leaf=True)

    def batches():
        iterator = dataset.as_numpy_iterator() if hasattr(dataset, "as_numpy_iterator") else dataset
        global_rows = 0
        for batch in iterator:
            leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
            global_rows = max(global_rows, int(np.shape(leaves[0])[0]))
            parts = split_local_replicas(local_part(batch, global_rows), replicas)
            yield parts[0] if replicas == 1 else PerReplica(tuple(parts))

    return DistributedDataset(batches, concatenate_replicas)


def datasets_from_function(backend: Any, dataset_fn: Callable) -> DistributedDataset:
    """`dataset_fn(InputContext)`'s per-replica batches, grouped by local replica (`distribute_datasets_from_function`)."""
    replicas = backend.replicas_per_worker
    context = InputContext(backend.num_workers, backend.worker_index, backend.num_replicas_in_sync)
    dataset = dataset_fn(context)

    def batches():
        iterator = dataset.as_numpy_iterator() if hasattr(dataset, "as_numpy_iterator") else dataset
        group = []
        for batch in iterator:
            group.append(batch)
            if len(group) == replicas:
                yield group[0] if replicas == 1 else PerReplica(tuple(group))
                group = []

    return DistributedDataset(batches, concatenate_replicas)


def concatenate_replicas(value: Any) -> Any:
    """This worker's batch of a step: its replicas' parts concatenated (what `fit` consumes)."""
    if not isinstance(value, PerReplica):
        return value
    from keras import tree

    return tree.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts]),
                              *value.values)
