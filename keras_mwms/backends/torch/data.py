"""Global batches → this worker's shard, for `fit`/`evaluate` on the torch backend.

Every input the user gives is batched at the **global** batch size; each worker keeps its
slice of every global batch (`keras_mwms.data.replica_slices` / `worker_row_indices`), so all
workers run the same number of steps and pair their collectives, whatever the data:

| input | how it is sharded |
|---|---|
| numpy arrays / torch tensors | a `PyDataset` of row indices; with `shuffle=True` or no `y`, Keras' own array loader (torch's `RandomSampler` on torch's global RNG, as plain Keras), each global batch sliced |
| `tf.data.Dataset` | `dataset.scan` keeps the worker's slice (AutoShardPolicy DATA; OFF: untouched); the user's dataset is never iterated (a new iterator of a reshuffling dataset would advance its order) |
| `keras.utils.PyDataset` | a wrapping `PyDataset` slicing every item; `shuffle=True` shuffles the batch order as Keras does, from the chief's Python `random` state |
| `torch.utils.data.DataLoader` | a wrapping loader slicing every batch; a shuffling sampler draws from torch's global RNG, as plain torch does |
| other iterables / generators | a generator slicing every batch |

At `fit` entry every worker takes the chief's Python and torch random states (the chief keeps
its own), so every shuffle above draws the chief's order: the order one process of plain Keras
with the chief's seed draws.

A short last global batch may leave a worker with zero rows; the trainer patch runs such a
step on a zero-weight dummy row (`keras_mwms.backends.policy.dummy_row`) so collectives stay
paired. Before the first step every worker checks that all passed arrays of one length
(`keras_mwms.backends.policy.check_same_rows`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_mwms.backends import fit_call
from keras_mwms.backends.keras_api import internals
from keras_mwms.data import AutoShardPolicy, replica_slices, worker_row_indices

if TYPE_CHECKING:
    from keras_mwms.backends.torch.engine import TorchEngine

DEFAULT_BATCH_SIZE = 32


class Sharded:
    """Marker: this input is already this worker's shard (never sharded twice)."""


def _keras_pydataset():
    import keras

    return keras.utils.PyDataset


def _to_numpy(structure):
    from keras import tree

    def convert(leaf):
        if leaf is None:
            return None
        if hasattr(leaf, "detach"):
            return leaf.detach().cpu().numpy()
        return np.asarray(leaf)

    return tree.map_structure(convert, structure)


def _num_rows(structure) -> int:
    from keras import tree

    for leaf in tree.flatten(structure):
        if leaf is not None:
            return int(leaf.shape[0])
    raise ValueError("keras_mwms: the input arrays are empty; give at least one row.")


def align_random_states(backend: TorchEngine, python_random: bool = False,
                        torch_random: bool = False) -> None:
    """Every worker takes the chief's Python `random` and/or torch global RNG state (one
    broadcast, made by every worker; the chief keeps its own states).

    Keras shuffles a PyDataset's batch order with `random.shuffle`, shuffled arrays with torch's
    `RandomSampler` / `randperm`, and a torch `DataLoader`'s `RandomSampler` draws its seed from
    torch's default generator when its iterator starts: workers then draw the chief's order,
    which is the order one process of plain Keras seeded alike draws.
    """
    import random

    import torch

    mine = (random.getstate() if python_random else None,
            torch.get_rng_state() if torch_random else None) if backend.is_chief else None
    python_state, torch_state = backend.broadcast_object(mine)
    if backend.is_chief:
        return
    if python_state is not None:
        random.setstate(python_state)
    if torch_state is not None:
        torch.set_rng_state(torch_state)


def _shuffling_loader(data) -> bool:
    """True for a torch `DataLoader` whose sampler shuffles (draws from torch's global RNG)."""
    try:
        from torch.utils.data import DataLoader, RandomSampler
    except ImportError:  # pragma: no cover - torch is always there on this backend
        return False
    if not isinstance(data, DataLoader):
        return False
    batch_sampler = getattr(data, "batch_sampler", None)
    return isinstance(getattr(data, "sampler", None), RandomSampler) or isinstance(
        getattr(batch_sampler, "sampler", None), RandomSampler)


def _make_shuffled_arrays(backend, arrays, global_batch_size, shuffle):
    """Keras' own array loader at the global batch size (its shuffle draws from torch's global
    RNG, as plain Keras does), each global batch sliced to this worker's rows."""
    x, y, sample_weight = arrays
    adapter = internals.array_data_adapter(x, y, sample_weight, batch_size=global_batch_size, shuffle=shuffle)
    return _sliced_loader(backend, adapter.get_torch_dataloader(), global_batch_size)


def _make_sharded_arrays(backend, arrays, global_batch_size):
    base = _keras_pydataset()

    class ShardedArrays(base, Sharded):
        """This worker's rows of each global batch of in-memory arrays, in order."""

        def __init__(self):
            super().__init__()
            self.arrays = arrays
            self.num_rows = _num_rows(arrays)
            self.steps = worker_row_indices(self.num_rows, global_batch_size, backend.num_workers,
                                            backend.worker_index)

        def __len__(self):
            return math.ceil(self.num_rows / global_batch_size)

        def __getitem__(self, index):
            from keras import tree

            rows = self.steps[index]
            picked = tree.map_structure(lambda a: None if a is None else a[rows], self.arrays)
            while picked and picked[-1] is None:
                picked = picked[:-1]
            return tuple(picked)

    return ShardedArrays()


def _slice_rows(batch, global_batch_size: int, backend: TorchEngine):
    from keras import tree

    rows = _num_rows(batch)
    start, stop = replica_slices(global_batch_size, backend.num_workers, rows)[backend.worker_index]
    return tree.map_structure(lambda a: None if a is None else a[start:stop], batch)


def _make_sharded_pydataset(backend, dataset):
    base = _keras_pydataset()

    class ShardedPyDataset(base, Sharded):
        """This worker's slice of every global batch of a `PyDataset`."""

        def __init__(self):
            super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                             max_queue_size=dataset.max_queue_size)
            self.inner = dataset
            self.global_batch_size = None

        def __len__(self):
            return len(self.inner)

        @property
        def num_batches(self):
            return self.inner.num_batches

        def __getitem__(self, index):
            if self.global_batch_size is None:
                self.global_batch_size = _num_rows(self.inner[0])
            return _slice_rows(self.inner[index], self.global_batch_size, backend)

        def on_epoch_begin(self):
            self.inner.on_epoch_begin()

        def on_epoch_end(self):
            self.inner.on_epoch_end()

    return ShardedPyDataset()


def _shard_tf_dataset(backend, dataset):
    import tensorflow as tf

    shard_policy = dataset.options().experimental_distribute.auto_shard_policy
    if shard_policy == tf.data.experimental.AutoShardPolicy.OFF or backend.num_workers == 1:
        return dataset
    # The global batch size is the first batch's rows. It is read while training reads the
    # batches (the state of a `scan`), never by iterating the dataset here: a new iterator of a
    # dataset shuffled with `reshuffle_each_iteration` advances its order, and training would
    # start one shuffle later than plain Keras.
    num_workers, worker_index = backend.num_workers, backend.worker_index
    static = tf.nest.flatten(dataset.element_spec)[0].shape
    known = static.rank and static[0] is not None
    initial = tf.constant(int(static[0]) if known else 0, dtype=tf.int64)

    def keep_slice(size, batch):
        rows = tf.cast(tf.shape(tf.nest.flatten(batch)[0])[0], tf.int64)
        size = tf.where(size > 0, size, rows)
        # replica_slices: the first `size % num_workers` workers take one row more.
        base, extra = size // num_workers, size % num_workers
        start = worker_index * base + tf.minimum(tf.constant(worker_index, tf.int64), extra)
        stop = start + base + tf.cast(worker_index < extra, tf.int64)
        low, high = tf.minimum(start, rows), tf.minimum(stop, rows)
        return size, tf.nest.map_structure(lambda t: t[low:high], batch)

    return dataset.scan(initial, keep_slice)


def _sliced_loader(backend, loader, global_batch_size):
    """A loader of this worker's slice of every global batch of `loader`.

    `loader` (a shuffling one draws from torch's global RNG, as in plain torch) is iterated
    exactly as plain Keras iterates it: its iterator is made when the wrapper's is (a
    `DataLoader` iterator draws its base seed from torch's global RNG when made, even one Keras
    makes at an epoch's end and never reads), its sampler draws at the first batch. The wrapping
    loader draws its own base seed from a private generator: nothing from torch's global RNG.
    """
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    def sliced(batches):
        size = global_batch_size
        for batch in batches:
            size = size or _num_rows(batch)
            yield _slice_rows(batch, size, backend)

    class SlicedBatches(IterableDataset, Sharded):
        def __iter__(self):
            return sliced(iter(loader))

        def __len__(self):
            return len(loader)

    return DataLoader(SlicedBatches(), batch_size=None, generator=torch.Generator())


def _shard_iterable(backend, iterable):
    def sliced():
        size = None
        for batch in iterable:
            size = size or _num_rows(batch)
            yield _slice_rows(batch, size, backend)

    return sliced()


def shard_global_batches(data: Any, backend: TorchEngine, options: Any = None,
                         aligned: bool = False) -> Any:
    """This worker's shard of a dataset batched at the global batch size.

    Example:

    ```python
    local = strategy.experimental_distribute_dataset(global_batches)   # any backend input
    ```

    `aligned`: the workers' random states are already the chief's (`fit`/`evaluate` entry);
    otherwise a shuffling torch `DataLoader` takes the chief's torch RNG state here.
    """
    if isinstance(data, Sharded) or data is None:
        return data
    shard_policy = getattr(options, "auto_shard_policy", None) if options is not None else None
    if shard_policy == AutoShardPolicy.OFF or backend.num_workers == 1 and not aligned:
        return data
    module = type(data).__module__
    if module.startswith("tensorflow") and hasattr(data, "element_spec"):
        return _shard_tf_dataset(backend, data)
    if isinstance(data, _keras_pydataset()):
        return _make_sharded_pydataset(backend, data)
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover - torch is always there on this backend
        DataLoader = ()
    if isinstance(data, DataLoader):
        if not aligned and _shuffling_loader(data):
            align_random_states(backend, torch_random=True)
        return _sliced_loader(backend, data, data.batch_size)
    if hasattr(data, "__iter__") or hasattr(data, "__next__"):
        return _shard_iterable(backend, data)
    raise TypeError(
        f"keras_mwms cannot shard an input of type {type(data).__name__}: give numpy arrays, "
        "torch tensors, a tf.data.Dataset, a keras.utils.PyDataset, a torch DataLoader or an "
        "iterable of global batches."
    )


def _shard_arrays_or_data(backend, x, y, sample_weight, batch_size, shuffle):
    if fit_call.is_arrays(x, y, sample_weight):
        arrays = _to_numpy((x, y, sample_weight))
        # x alone goes through Keras' own loader too, which hands a step the batch itself, as
        # one process does: a PyDataset's batch is always a tuple, so keras.io's VAE (`fit(x)`,
        # a custom train_step using `data` as the batch) got the list `[x]`.
        if shuffle or (y is None and sample_weight is None):
            return _make_shuffled_arrays(backend, arrays, batch_size or DEFAULT_BATCH_SIZE, shuffle)
        return _make_sharded_arrays(backend, arrays, batch_size or DEFAULT_BATCH_SIZE)
    return shard_global_batches(x, backend, aligned=True)


class TorchFitHooks(fit_call.FitHooks):
    """torch's part of a `fit`/`evaluate` call: every input becomes this worker's shard.

    The policy (binding, scope, TF_CONFIG, row checks, validation_split, class weights of
    arrays, `prepare_fit`, chief-only progress) is `keras_mwms.backends.fit_call`'s.
    """

    def fed(self, x: Any) -> bool:
        return isinstance(x, Sharded)

    def align_shuffles(self, call: fit_call.FitCall) -> None:
        # Keras shuffles a PyDataset's batches itself, with Python's `random`; shuffled arrays
        # and a shuffling DataLoader draw from torch's global RNG. Every worker takes the
        # chief's states (one broadcast, always made), so all draw the chief's order.
        values = call.arguments
        x, shuffle = values["x"], bool(values["shuffle"])
        align_random_states(
            call.backend, python_random=shuffle and isinstance(x, _keras_pydataset()),
            torch_random=shuffle and fit_call.is_arrays(x, values["y"], values["sample_weight"])
            or _shuffling_loader(x) or _shuffling_loader(values["validation_data"]))

    def feed(self, call: fit_call.FitCall) -> None:
        backend, values = call.backend, call.arguments
        if call.method == "evaluate":
            if _shuffling_loader(values["x"]):
                align_random_states(backend, torch_random=True)
            values["x"] = _shard_arrays_or_data(backend, values["x"], values["y"], values["sample_weight"],
                                                values["batch_size"], False)
            values.update(y=None, sample_weight=None, batch_size=None)
        elif call.method == "fit":
            _shard_fit_inputs(backend, values)


def _shard_fit_inputs(backend: TorchEngine, values: dict) -> None:
    """`fit`'s arguments with every input replaced by this worker's shard (in place)."""
    x, y, sample_weight = values["x"], values["y"], values["sample_weight"]
    if values["class_weight"] is not None:   # arrays' class weights are sample weights by now
        raise ValueError("keras_mwms: class_weight is supported with array inputs only; "
                         "add sample weights to your dataset instead.")
    if fit_call.is_arrays(x, y, sample_weight):
        x, y, sample_weight = _to_numpy((x, y, sample_weight))
    shuffles_batches = bool(values["shuffle"]) and isinstance(x, _keras_pydataset())
    values["x"] = _shard_arrays_or_data(backend, x, y, sample_weight, values["batch_size"], values["shuffle"])
    validation = values["validation_data"]
    if validation is not None and not isinstance(validation, Sharded):
        if isinstance(validation, (tuple, list)):
            val_x, val_y, val_sample_weight = internals.unpack_x_y_sample_weight(
                tuple(validation))
        else:
            val_x, val_y, val_sample_weight = validation, None, None
        values["validation_data"] = _shard_arrays_or_data(
            backend, val_x, val_y, val_sample_weight,
            values["validation_batch_size"] or values["batch_size"], False)
    values.update(y=None, sample_weight=None, class_weight=None, batch_size=None,
                  validation_batch_size=None, shuffle=shuffles_batches)
