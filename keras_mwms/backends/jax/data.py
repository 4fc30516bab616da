"""Global batches → what the JAX step consumes, for `model.fit` / `evaluate` / `predict` on several workers.

Keras' multi-process JAX path feeds each process's rows through
`jax.make_array_from_process_local_data`, which needs the *same* local shape on every process:
numpy input is refused, uneven shards hang and a partial last batch crashes. keras_mwms instead
reads the **global** batch on every worker (arrays, `tf.data`, `PyDataset`, generators) through
Keras' own data adapters — so batches, packing and the shuffled order are plain Keras' — and
places it itself, one placer per path:

* the **flat path** (`LocalRowsPlacer`): this worker's rows of every global batch, as numpy,
  following `keras_mwms.data.replica_slices` — the global batch is split in rank order and a
  short last batch fills the workers in order, so trailing workers may get no rows (their step
  runs on a zero-weight row, see `keras_mwms.backends.jax.step`);
* the **DataParallel path** (`GlobalArrayPlacer`): one global `jax.Array` per leaf, sharded when
  the batch divides evenly over all replicas and replicated otherwise (see its docstring for
  why a short batch cannot follow `replica_slices` there);
* **every row** (`IdentityPlacer`): one device, or a multi-worker `predict`, where each worker
  computes every row it is given.

`shuffle=True` draws from NumPy's global RNG (arrays) or Python's `random` (PyDataset), whose
states every worker takes from the chief at `fit` entry — the same global batches on every
worker, in the order one process with the chief's seed draws.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_mwms.backends import fit_call
from keras_mwms.backends.keras_api import internals


class GlobalBatchSource:
    """Iterates one epoch of global batches as numpy structures packed as Keras packs them:
    `(x, y, sample_weight)`, `(x, y)` without sample weights, `x` alone without targets (a
    custom `train_step` may unpack `x, y = data`, as in Keras' guides)."""

    num_batches: int | None = None
    batch_size: int | None = None
    partial_batch_size: int | None = None

    def epoch(self) -> Iterator[Any]:
        raise NotImplementedError

    def on_epoch_begin(self) -> None:
        pass

    def on_epoch_end(self) -> None:
        pass


class AdapterSource(GlobalBatchSource):
    """Global batches from Keras' own data adapter for the input (arrays, tf.data, Python
    generator, `PyDataset`, torch DataLoader, grain), in Keras' own order and packing.

    `local_parts`: each batch is this worker's own part of the step (a tf.data dataset with
    `AutoShardPolicy.OFF`), not a global batch.
    """

    def __init__(self, adapter: Any, local_parts: bool = False):
        self._adapter = adapter
        self.local_parts = local_parts
        self.num_batches = adapter.num_batches
        self.batch_size = adapter.batch_size
        # A generator's adapter knows no batch count, and raises on `has_partial_batch`.
        known = self.num_batches is not None and self.batch_size is not None
        self.partial_batch_size = adapter.partial_batch_size if known and adapter.has_partial_batch else None

    def epoch(self) -> Iterator[Any]:
        return self._adapter.get_numpy_iterator()

    def on_epoch_begin(self) -> None:
        self._adapter.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self._adapter.on_epoch_end()


class GlobalArrayPlacer:
    """Turns one global numpy batch into global `jax.Array`s, sharded or replicated.

    A global batch whose rows divide evenly over all replicas is **sharded**: worker w hands JAX
    only its contiguous block of rows (the `keras_mwms.data.replica_slices` block, equal for
    every replica), and each of its local devices gets its sub-block. Any other batch (a short
    last batch, or one that does not divide by the replica count) is **replicated**: every
    worker feeds all of its rows and each device computes the whole batch.

    Why a short batch does not follow `replica_slices` here: Keras' step is one SPMD program
    over a global array, and a batch-sharded `NamedSharding` gives every device an equal
    shard, so "the first replicas full, the last ones empty" cannot be expressed; padding the
    shards would change the loss denominator and the BatchNormalization statistics. The
    replicated step computes exactly what one process computes on that batch (same rows, same
    loss denominator, same statistics), with no padding and no hang.

    Args:
        mesh: the `jax.sharding.Mesh` of all global devices, ordered worker by worker.
        batch_axis: the mesh axis name the batch is split over.
        num_workers, worker_index: this worker's place.
    """

    def __init__(self, mesh: Any, batch_axis: str, num_workers: int, worker_index: int):
        from jax.sharding import NamedSharding, PartitionSpec

        self._sharded = NamedSharding(mesh, PartitionSpec(batch_axis))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._num_replicas = int(mesh.devices.size)
        self._num_workers = num_workers
        self._worker_index = worker_index

    def is_sharded(self, rows: int) -> bool:
        return rows > 0 and rows % self._num_replicas == 0

    def place(self, batch: Any) -> Any:
        import jax
        from keras import tree

        leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
        rows = int(np.shape(leaves[0])[0]) if leaves else 0
        sharded = self.is_sharded(rows)
        block = rows // self._num_workers
        first = self._worker_index * block

        def place_leaf(leaf):
            if leaf is None:
                return None
            leaf = np.asarray(leaf)
            if sharded:
                return jax.make_array_from_process_local_data(
                    self._sharded, leaf[first:first + block], leaf.shape)
            return jax.make_array_from_process_local_data(self._replicated, leaf, leaf.shape)

        return tree.map_structure(place_leaf, batch, none_is_leaf=True)

    def place_local_part(self, batch: Any) -> Any:
        """Global arrays from this worker's own part of the step (every worker: equal rows)."""
        import jax
        from keras import tree

        def place_leaf(leaf):
            if leaf is None:
                return None
            leaf = np.asarray(leaf)
            shape = (leaf.shape[0] * self._num_workers,) + leaf.shape[1:]
            return jax.make_array_from_process_local_data(self._sharded, leaf, shape)

        return tree.map_structure(place_leaf, batch, none_is_leaf=True)


class LocalRowsPlacer:
    """The flat path's placement: this worker's contiguous rows of each global batch, as numpy.

    Rows follow `keras_mwms.data.replica_slices(global_batch_size, num_workers, rows)`: a full
    batch is split in rank order (the first workers get one row more when it does not
    divide), a short last batch fills the workers in order, so trailing workers may get no row;
    the flat step then runs on a zero-weight row. Each step's gradient is weighted by its rows,
    so the result is one process's. `global_batch_size` defaults to the largest batch seen
    (the first, for every input Keras batches).

    Example:

    >>> placer = LocalRowsPlacer(num_workers=3, worker_index=1)
    >>> placer.place((np.arange(7), None, None))[0].tolist()
    [3, 4]
    >>> placer.place((np.arange(4), None, None))[0].tolist()    # short last batch: 3, 1, 0 rows
    [3]
    """

    def __init__(self, num_workers: int, worker_index: int, global_batch_size: int | None = None):
        self._num_workers = num_workers
        self._worker_index = worker_index
        self._global_batch_size = global_batch_size or 0

    def place(self, batch: Any) -> Any:
        from keras import tree

        from keras_mwms.data import replica_slices

        leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
        rows = int(np.shape(leaves[0])[0]) if leaves else 0
        self._global_batch_size = max(self._global_batch_size, rows)
        first, last = ((0, 0) if not rows else
                       replica_slices(self._global_batch_size, self._num_workers, rows)[self._worker_index])
        return tree.map_structure(lambda leaf: None if leaf is None else np.asarray(leaf)[first:last],
                                  batch, none_is_leaf=True)

    @staticmethod
    def place_local_part(batch: Any) -> Any:
        return batch


class IdentityPlacer:
    """Every row as it comes: one device (plain Keras places the numpy batches itself), or a
    multi-worker `predict`, which computes every row it is given on this worker."""

    @staticmethod
    def place(batch: Any) -> Any:
        return batch

    place_local_part = place


class LocalPartSource(GlobalBatchSource):
    """This worker's parts of every step from a `DistributedDataset` (already sharded)."""

    local_parts = True

    def __init__(self, dataset: DistributedDataset):
        self._dataset = dataset

    def epoch(self) -> Iterator[Any]:
        for batch in self._dataset.local_batches():
            yield tuple(batch) if isinstance(batch, list) else batch


def make_global_batch_adapter(source: GlobalBatchSource, placer: Any):
    """A Keras `DataAdapter` yielding `placer`-placed global batches of `source`."""
    class GlobalBatchAdapter(internals.data_adapter_class()):
        """Feeds Keras' JAX trainer global arrays built by keras_mwms (one global batch a step)."""

        def __init__(self):
            self.source = source

        def get_jax_iterator(self, super_batch=None):
            # Keras 3.16 asks for `steps_per_execution` batches stacked into one "super batch"
            # (scanned in one jit); global batches placed across processes cannot be stacked.
            if super_batch:
                raise ValueError(
                    f"keras_mwms (JAX): steps_per_execution={super_batch} is not supported on "
                    "Keras 3.16 or newer, which stacks that many batches into one array; compile "
                    "the model with steps_per_execution=1.")
            place = placer.place_local_part if getattr(source, "local_parts", False) else placer.place
            for batch in source.epoch():
                yield place(batch)

        def get_numpy_iterator(self):
            return source.epoch()

        @property
        def num_batches(self):
            return source.num_batches

        @property
        def batch_size(self):
            return source.batch_size

        @property
        def has_partial_batch(self):
            return source.partial_batch_size is not None

        @property
        def partial_batch_size(self):
            return source.partial_batch_size

        def on_epoch_begin(self):
            source.on_epoch_begin()

        def on_epoch_end(self):
            source.on_epoch_end()

    return GlobalBatchAdapter()


def make_source(x: Any, y: Any, sample_weight: Any, batch_size: int | None, steps: int | None,
                shuffle: bool | str, class_weight: dict | None) -> GlobalBatchSource:
    """The `GlobalBatchSource` for whatever the user passed to fit/evaluate/predict: Keras' own
    adapter, so batches, packing and shuffled order are plain Keras' (see `shuffles_globally`)."""
    adapter = internals.get_data_adapter(x, y, sample_weight, batch_size, steps, shuffle, class_weight)
    return AdapterSource(adapter, local_parts=fit_call.shard_policy_is_off(x))


def shuffles_globally(x: Any, y: Any = None, sample_weight: Any = None) -> bool:
    """True for the inputs Keras shuffles with a process-global random state: arrays (NumPy's
    global RNG) and a `keras.utils.PyDataset` (Python's `random`). The workers take the chief's
    states at `fit` entry, so each cuts the global batches of one process with the chief's seed.

    Example:

    >>> shuffles_globally(np.zeros((4, 2)), np.zeros(4)), shuffles_globally(iter([]))
    (True, False)
    """
    from keras.utils import PyDataset

    return isinstance(x, PyDataset) or internals.can_convert_arrays((x, y, sample_weight))


def split_local_replicas(batch: Any, replicas_per_worker: int) -> list[Any]:
    """Splits this worker's batch into contiguous per-replica parts (first parts one row longer)."""
    from keras import tree

    from keras_mwms.data import replica_slices

    leaves = [leaf for leaf in tree.flatten(batch) if leaf is not None]
    rows = int(np.shape(leaves[0])[0])
    slices = replica_slices(rows, replicas_per_worker) if rows else [(0, 0)] * replicas_per_worker
    return [tree.map_structure(lambda leaf, s=s: None if leaf is None else np.asarray(leaf)[s[0]:s[1]],
                               batch, none_is_leaf=True) for s in slices]


class DistributedDataset:
    """This worker's view of a distributed dataset: yields a `PerReplica` of local batches per step.

    Built by `strategy.experimental_distribute_dataset` (global batches, split here) or
    `strategy.distribute_datasets_from_function` (per-replica batches, grouped by local replica).
    """

    def __init__(self, make_iterator: Callable[[], Iterator[Any]], local_batch_of: Callable[[Any], Any]):
        self._make_iterator = make_iterator
        self._local_batch_of = local_batch_of

    def __iter__(self):
        return iter(self._make_iterator())

    def local_batches(self) -> Iterator[Any]:
        """This worker's batch of every step, local replicas concatenated (what `fit` consumes)."""
        for value in self._make_iterator():
            yield self._local_batch_of(value)


# -- from fit/evaluate/predict arguments to an adapter ------------------------------------
EVERY_ROW = "every-row"


def adapter_for(backend: Any, path: str, x: Any, y: Any = None, sample_weight: Any = None,
                batch_size: int | None = None, steps: int | None = None, shuffle: bool | str = False,
                class_weight: dict | None = None) -> Any:
    """The Keras `DataAdapter` feeding `path` ("flat", "dataparallel", "single" or `EVERY_ROW`).

    A `DataAdapter` passes through (fit's validation reuses its own); a `DistributedDataset`
    feeds this worker's parts; anything else goes through Keras' own adapter first (a shuffled
    one after `align_shuffle_state`, at the call's entry).
    """
    if internals.is_data_adapter(x):
        return x
    if isinstance(x, DistributedDataset):
        source: GlobalBatchSource = LocalPartSource(x)
    else:
        source = make_source(x, y, sample_weight, batch_size, steps, shuffle, class_weight)
    return make_global_batch_adapter(source, placer_for(backend, path, source.batch_size))


def placer_for(backend: Any, path: str, global_batch_size: int | None = None) -> Any:
    """How a global batch reaches the step: global arrays (DataParallel), this worker's rows
    (flat), or untouched (one device, and `EVERY_ROW`)."""
    from keras_mwms.backends.jax.step import FLAT

    if backend.mesh is None or path == EVERY_ROW:
        return IdentityPlacer()
    if path == FLAT:
        return LocalRowsPlacer(backend.num_workers, backend.worker_index, global_batch_size)
    return GlobalArrayPlacer(backend.mesh, backend.distribution.batch_dim_name,
                             backend.num_workers, backend.worker_index)


def align_shuffle_state(backend: Any) -> None:
    """Keras shuffles arrays with NumPy's global RNG and a PyDataset's batch order with Python's
    `random`: workers take the chief's states (the chief keeps its own, so its order is the one
    plain Keras draws in one process with the same seeds), so every worker cuts the same global
    batches."""
    import random

    python_state, numpy_state = backend.broadcast_object((random.getstate(), np.random.get_state()))
    random.setstate(python_state)
    np.random.set_state(numpy_state)
