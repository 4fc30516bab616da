"""Global batches → this worker's shard, for `fit`/`evaluate` on the torch backend.

Every input the user gives is batched at the **global** batch size; each worker keeps its
slice of every global batch (`keras_mwms.data.replica_slices` / `worker_row_indices`), so all
workers run the same number of steps and pair their collectives, whatever the data:

| input | how it is sharded |
|---|---|
| numpy arrays / torch tensors | a `PyDataset` of row indices; the epoch's permutation is drawn from a seed broadcast by the chief, so `shuffle=True` shuffles identically everywhere |
| `tf.data.Dataset` | `dataset.map` keeps the worker's slice (AutoShardPolicy DATA; OFF: untouched) |
| `keras.utils.PyDataset` | a wrapping `PyDataset` slicing every item; `shuffle=True` shuffles the batch order as Keras does, from the chief's Python `random` state |
| `torch.utils.data.DataLoader` | a wrapping loader slicing every batch; a shuffling sampler gets a generator seeded from the chief |
| other iterables / generators | a generator slicing every batch |

A short last global batch may leave a worker with zero rows; the trainer patch runs such a
step on a zero-weight dummy row so collectives stay paired.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_mwms.data import AutoShardPolicy, replica_slices, worker_row_indices

if TYPE_CHECKING:
    from keras_mwms.backends.torch import TorchBackend

DEFAULT_BATCH_SIZE = 32


class Sharded:
    """Marker: this input is already this worker's shard (never sharded twice)."""


def _keras_pydataset():
    import keras

    return keras.utils.PyDataset


def _is_arrays(x, y, sample_weight) -> bool:
    from keras.src.trainers.data_adapters import array_data_adapter

    return x is not None and array_data_adapter.can_convert_arrays((x, y, sample_weight))


def _to_numpy(structure):
    from keras.src import tree

    def convert(leaf):
        if leaf is None:
            return None
        if hasattr(leaf, "detach"):
            return leaf.detach().cpu().numpy()
        return np.asarray(leaf)

    return tree.map_structure(convert, structure)


def _num_rows(structure) -> int:
    from keras.src import tree

    for leaf in tree.flatten(structure):
        if leaf is not None:
            return int(leaf.shape[0])
    raise ValueError("keras_mwms: the input arrays are empty; give at least one row.")


def shared_seed(backend: TorchBackend, python_random: bool = False) -> int:
    """A seed drawn by the chief (from NumPy's global RNG) and known to every worker.

    With `python_random`, every worker also takes the chief's Python `random` state (in the
    same broadcast): Keras shuffles a PyDataset's batch order with `random.shuffle`, so workers
    then draw the chief's order, which is the order one process of plain Keras seeded alike
    draws.
    """
    import random

    mine = (int(np.random.randint(0, 2**31 - 1)), random.getstate() if python_random else None) \
        if backend.is_chief else None
    seed, python_state = backend.broadcast_object(mine)
    if python_state is not None and not backend.is_chief:
        random.setstate(python_state)
    return int(seed)


def _make_sharded_arrays(backend, arrays, global_batch_size, shuffle, seed):
    base = _keras_pydataset()

    class ShardedArrays(base, Sharded):
        """This worker's rows of each global batch of in-memory arrays, reshuffled each epoch."""

        def __init__(self):
            super().__init__()
            self.arrays = arrays
            self.num_rows = _num_rows(arrays)
            self.epoch = 0
            self._plan()

        def _plan(self):
            order = None
            if shuffle:
                order = np.random.default_rng([seed, self.epoch]).permutation(self.num_rows)
            self.steps = worker_row_indices(self.num_rows, global_batch_size, backend.num_workers,
                                            backend.worker_index, order)

        def __len__(self):
            return math.ceil(self.num_rows / global_batch_size)

        def __getitem__(self, index):
            from keras.src import tree

            rows = self.steps[index]
            picked = tree.map_structure(lambda a: None if a is None else a[rows], self.arrays)
            while picked and picked[-1] is None:
                picked = picked[:-1]
            return tuple(picked)

        def on_epoch_end(self):
            self.epoch += 1
            self._plan()

    return ShardedArrays()


def _slice_rows(batch, global_batch_size: int, backend: TorchBackend):
    from keras.src import tree

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

    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy == tf.data.experimental.AutoShardPolicy.OFF or backend.num_workers == 1:
        return dataset
    global_batch_size = _num_rows(next(iter(dataset)))
    start, stop = replica_slices(global_batch_size, backend.num_workers)[backend.worker_index]

    def keep_slice(*batch):
        structure = batch if len(batch) > 1 else batch[0]
        rows = tf.shape(tf.nest.flatten(structure)[0])[0]
        low, high = tf.minimum(start, rows), tf.minimum(stop, rows)
        return tf.nest.map_structure(lambda t: t[low:high], structure)

    return dataset.map(keep_slice, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _shard_torch_loader(backend, loader, seed):
    import torch
    from torch.utils.data import DataLoader, IterableDataset, RandomSampler

    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, RandomSampler):
        # Every worker must draw the same global order: seed the sampler from the chief.
        sampler.generator = torch.Generator().manual_seed(seed)
    global_batch_size = loader.batch_size

    class SlicedBatches(IterableDataset, Sharded):
        def __iter__(self):
            size = global_batch_size
            for batch in loader:
                size = size or _num_rows(batch)
                yield _slice_rows(batch, size, backend)

        def __len__(self):
            return len(loader)

    sharded = DataLoader(SlicedBatches(), batch_size=None)
    return sharded


def _shard_iterable(backend, iterable):
    def sliced():
        size = None
        for batch in iterable:
            size = size or _num_rows(batch)
            yield _slice_rows(batch, size, backend)

    return sliced()


def shard_global_batches(data: Any, backend: TorchBackend, options: Any = None,
                         seed: int | None = None) -> Any:
    """This worker's shard of a dataset batched at the global batch size.

    Example:

    ```python
    local = strategy.experimental_distribute_dataset(global_batches)   # any backend input
    ```
    """
    if isinstance(data, Sharded) or data is None:
        return data
    policy = getattr(options, "auto_shard_policy", None) if options is not None else None
    if policy == AutoShardPolicy.OFF or backend.num_workers == 1 and seed is None:
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
        return _shard_torch_loader(backend, data, shared_seed(backend) if seed is None else seed)
    if hasattr(data, "__iter__") or hasattr(data, "__next__"):
        return _shard_iterable(backend, data)
    raise TypeError(
        f"keras_mwms cannot shard an input of type {type(data).__name__}: give numpy arrays, "
        "torch tensors, a tf.data.Dataset, a keras.utils.PyDataset, a torch DataLoader or an "
        "iterable of global batches."
    )


def bind_arguments(method, args: tuple, kwargs: dict) -> dict:
    """`method(self, *args, **kwargs)`'s arguments by name, defaults filled in (without self)."""
    return _bind(_original(method), args, kwargs)


def _bind(method, args, kwargs) -> dict:
    signature = inspect.signature(method)
    bound = signature.bind_partial(None, *args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    values.pop(next(iter(signature.parameters)))
    extra = values.pop("kwargs", None)
    if extra:
        values.update(extra)
    return values


def _shard_arrays_or_data(backend, x, y, sample_weight, batch_size, shuffle, seed):
    if _is_arrays(x, y, sample_weight):
        arrays = _to_numpy((x, y, sample_weight))
        return _make_sharded_arrays(backend, arrays, batch_size or DEFAULT_BATCH_SIZE,
                                    bool(shuffle), seed)
    return shard_global_batches(x, backend, seed=seed)


def shard_fit_inputs(backend: TorchBackend, args: tuple, kwargs: dict) -> dict:
    """`fit`'s arguments with every input replaced by this worker's shard."""
    from keras.src.backend.torch.trainer import TorchTrainer
    from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

    values = _bind(_original(TorchTrainer.fit), args, kwargs)
    x, y, sample_weight = values["x"], values["y"], values["sample_weight"]
    if isinstance(x, Sharded):
        return values
    # Keras shuffles a PyDataset's batches itself, with Python's `random`: keep its shuffle.
    shuffles_batches = bool(values["shuffle"]) and isinstance(x, _keras_pydataset())
    seed = shared_seed(backend, python_random=shuffles_batches)
    check_same_rows(backend, x, "model.fit()", compare_first_batch=True)
    if _is_arrays(x, y, sample_weight):
        x, y, sample_weight = _to_numpy((x, y, sample_weight))
        if values["class_weight"] is not None:
            sample_weight = data_adapter_utils.class_weight_to_sample_weights(
                y, values["class_weight"])
        if values["validation_split"] and values["validation_data"] is None:
            (x, y, sample_weight), values["validation_data"] = array_slicing.train_validation_split(
                (x, y, sample_weight), validation_split=values["validation_split"])
    elif values["class_weight"] is not None:
        raise ValueError("keras_mwms: class_weight is supported with array inputs only; "
                         "add sample weights to your dataset instead.")
    values["x"] = _shard_arrays_or_data(backend, x, y, sample_weight, values["batch_size"],
                                        values["shuffle"], seed)
    validation = values["validation_data"]
    if validation is not None and not isinstance(validation, Sharded):
        if isinstance(validation, (tuple, list)):
            val_x, val_y, val_sample_weight = data_adapter_utils.unpack_x_y_sample_weight(
                tuple(validation))
        else:
            val_x, val_y, val_sample_weight = validation, None, None
        values["validation_data"] = _shard_arrays_or_data(
            backend, val_x, val_y, val_sample_weight,
            values["validation_batch_size"] or values["batch_size"], False, seed)
    values.update(y=None, sample_weight=None, class_weight=None, batch_size=None,
                  validation_split=0.0, validation_batch_size=None, shuffle=shuffles_batches)
    return values


def shard_evaluate_inputs(backend: TorchBackend, args: tuple, kwargs: dict) -> dict:
    """`evaluate`'s arguments with the data replaced by this worker's shard (no shuffling)."""
    from keras.src.backend.torch.trainer import TorchTrainer

    values = _bind(_original(TorchTrainer.evaluate), args, kwargs)
    x = values["x"]
    if isinstance(x, Sharded):
        return values
    check_same_rows(backend, x, "model.evaluate()")
    values["x"] = _shard_arrays_or_data(backend, x, values["y"], values["sample_weight"],
                                        values["batch_size"], False, seed=0)
    values.update(y=None, sample_weight=None, batch_size=None)
    return values


def check_same_rows(backend: TorchBackend, x, what: str, compare_first_batch: bool = False) -> None:
    """Every worker must pass arrays of one length; else a clear error everywhere (one all-reduce).

    Different lengths give workers different step counts: the next collective would mismatch
    (gloo aborts the process), so it is caught before the first step. With
    `compare_first_batch`, a tf.data input's first-batch digest (`keras_mwms.data.
    first_batch_digest`) rides in the same all-reduce, and every worker warns when the workers'
    datasets start differently (a shuffle seeded differently per worker, or not at all).
    """
    import torch

    from keras_mwms.data import (
        different_first_batches_warning,
        first_batch_digest,
        leading_rows,
        uneven_rows_error,
    )

    if not backend.distributed:
        return
    rows = leading_rows(x)
    digest = first_batch_digest(x) if compare_first_batch and not _sharding_off(x) else None
    # Per worker: rows + 1 (0: not arrays), then the 64-bit digest as two exact 32-bit halves
    # (-1: none).
    mine = torch.zeros((backend.num_workers, 3), dtype=torch.float64)
    mine[backend.worker_index, 0] = 0 if rows is None else rows + 1
    value = -1 if digest is None else int(digest, 16)
    mine[backend.worker_index, 1:] = torch.tensor(
        [-1.0, -1.0] if value < 0 else [float(value >> 32), float(value & 0xFFFFFFFF)],
        dtype=torch.float64)
    (everyone,) = backend.all_reduce_flat([mine], what="row-count check")
    error = uneven_rows_error([int(value) - 1 if value else None for value in everyone[:, 0].tolist()],
                              backend.worker_index, what)
    if error is not None:
        raise error
    digests = [None if high < 0 else f"{int(high):08x}{int(low):08x}"
               for high, low in everyone[:, 1:].tolist()]
    message = different_first_batches_warning(digests, what)
    if message is not None:
        warnings.warn(message, stacklevel=4)


def _sharding_off(x) -> bool:
    """Whether `x` is a tf.data.Dataset with AutoShardPolicy.OFF (per-worker data by intent)."""
    module = type(x).__module__
    if not (module.startswith("tensorflow") and hasattr(x, "options")):
        return False
    import tensorflow as tf

    return x.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF


def _original(method):
    return getattr(method, "__wrapped__", method)
