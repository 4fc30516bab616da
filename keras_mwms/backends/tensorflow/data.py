"""Input handling on TensorFlow that Keras gets wrong on a multi-worker strategy.

**Datasets each worker feeds whole.** With `AutoShardPolicy.OFF` every worker's dataset is its own data, batched at the global batch
size. TF splits every such batch into one piece per replica and this worker feeds all of the
pieces, so an epoch has about `cardinality × num_workers` steps; Keras counts `cardinality` and
silently stops halfway. `distribute_unsharded_dataset` distributes the dataset with its true
step count, after checking that every worker runs the same number of steps (else their
collectives would pair wrongly or hang).

**Resumable ordered streams** (`keras_mwms.resume.resumable_inputs`) are fed as a tf.data pipeline
whose element `i` is the stream's item `i`, read by a `tf.py_function` (`stream_dataset`), not
through Keras' `PyDataset` adapter: that adapter's `from_generator` keeps each epoch's position
in a Python generator, read ahead in TF's threads; a pure function of the element index gives
element `i` whatever TF prefetches.

**A PyDataset read by batch index** (`pydataset_read_by_index`): a finite, shuffled or plain
`keras.utils.PyDataset` in `fit` is `range(num_batches)` mapped by its batch index, the epoch's
order drawn on the main thread at `on_epoch_begin`, not Keras' `from_generator` pipeline.

**Batches made in Python are copied before TensorFlow gets them** (`copy_python_batches`,
`owned_copy`). TF wraps a NumPy array a `py_function` or `from_generator` returns without
copying it, and a kernel whose input buffer it believes unshared may write its output into
that buffer: with several workers the user's own arrays changed under training (a generator
yielding slices `y[start:stop]` of one array: 128 of its 256 targets overwritten in epoch 1,
so epoch 2 and every later fit on that array trained on the damaged targets).

**A batch for the model's symbolic build.** Keras pulls one from the epoch iterator, which
consumes batches of a Python generator and advances shuffles; `batch_without_iterating` gives
one with the same shapes and dtypes without touching the data.

Example:

>>> unsharded_steps(48, 14, 3, num_replicas=2, replicas_per_worker=1)
5
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms import active
from keras_mwms.backends.keras_api import attributes, internals
from keras_mwms.backends.patches import ObjectState
from keras_mwms.data import replica_slices
from keras_mwms.diagnostics.ledger import LEDGER


def unsharded_steps(global_batch: int, last_rows: int, cardinality: int, num_replicas: int,
                    replicas_per_worker: int) -> int:
    """Steps a worker runs over its whole `AutoShardPolicy.OFF` dataset of `cardinality` batches.

    TF splits every batch into one piece per replica (`keras_mwms.data.replica_slices`) and
    drops empty pieces, so a partial last batch may give fewer pieces; this worker's replicas
    take `replicas_per_worker` pieces per step.

    Example (110 rows, global batch 48, 2 workers of one replica: 24+24, 24+24, 14):

    >>> unsharded_steps(48, 14, 3, num_replicas=2, replicas_per_worker=1)
    5
    """
    if cardinality == 0:
        return 0
    last_pieces = sum(stop > start for start, stop in replica_slices(global_batch, num_replicas, last_rows))
    pieces = (cardinality - 1) * num_replicas + last_pieces
    return -(-pieces // replicas_per_worker)


def _batch_rows(*batch):
    import tensorflow as tf

    return tf.shape(tf.nest.flatten(batch)[0])[0]


def distribute_unsharded_dataset(backend: Any, dataset: Any, what: str) -> Any:
    """`dataset` (AutoShardPolicy.OFF), distributed by `backend.strategy` with its true length.

    Every worker must run the same number of steps: the lengths are compared first (one
    all-reduce), and a dataset of unknown length is refused.
    """
    cardinality = int(dataset.cardinality())
    if cardinality < 0:
        raise ValueError(
            f"{what}: a tf.data dataset with AutoShardPolicy.OFF and unknown length cannot run on "
            "a multi-worker strategy: every worker must run the same number of steps. Make the "
            "length known with dataset.apply(tf.data.experimental.assert_cardinality(n)), or "
            "shard with AutoShardPolicy.DATA instead.")
    steps = 0
    if cardinality:
        global_batch = int(next(iter(dataset.take(1).map(_batch_rows))))
        last_rows = int(next(iter(dataset.skip(cardinality - 1).map(_batch_rows))))
        steps = unsharded_steps(global_batch, last_rows, cardinality, backend.num_replicas_in_sync,
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
    totals = backend.all_reduce(np.array([steps, steps * steps], np.int64), "sum")
    if totals.tolist() != [steps * backend.num_workers, steps * steps * backend.num_workers]:
        raise ValueError(
            f"{what}: the workers' AutoShardPolicy.OFF datasets have different lengths (this "
            f"worker: {steps} steps), so they would run different numbers of steps and hang. "
            "Give every worker the same number of batches.")
    return distributed


def batch_without_iterating(adapter: Any) -> Any:
    """A batch for the symbolic build that consumes nothing from a generator or a PyDataset.

    Iterating the epoch iterator for the build, as Keras does, pulls batches out of a Python
    generator through tf.data's prefetch thread (an unknown number of them, lost for the
    epoch), and draws one more PyDataset shuffle from Python's `random`; one process of plain
    Keras does neither. None for other adapters (Keras then iterates as usual).

    Example:

    >>> batch_without_iterating(None) is None
    True
    """
    if isinstance(adapter, internals.generator_adapter_class()):
        return attributes.generator_first_batches(adapter)[0]
    if isinstance(adapter, internals.py_dataset_adapter_class()):
        batch = adapter.py_dataset[0]
        return batch if isinstance(batch, tuple) else (batch,)
    if isinstance(adapter, internals.tf_dataset_adapter_class()):
        # A new iterator of a dataset shuffled with `reshuffle_each_iteration` advances its
        # seed: training would start at the *second* shuffle order. The element spec has the
        # shapes and dtypes the build needs.
        return symbolic_batch_of_spec(attributes.tf_dataset_of(adapter).element_spec)
    return None


def symbolic_batch_of_spec(spec: Any) -> Any:
    """Keras tensors with a dataset's dense `element_spec`, unknown dimensions kept unknown, else None.

    The symbolic build needs only shapes and dtypes. A concrete batch would have to give every
    unknown dimension a size, and a non-batch one (the time axis of
    `keras.utils.timeseries_dataset_from_array`, `(None, None, 3)`) filled with 1 fails a model
    whose `Input` fixes it ("expected shape=(None, 12, 3), found shape=(1, 1, 3)").

    Example:

    >>> import tensorflow as tf
    >>> batch = symbolic_batch_of_spec((tf.TensorSpec([None, None, 3], tf.float32),
    ...                                 tf.TensorSpec([None], tf.int64)))
    >>> [(leaf.shape, leaf.dtype) for leaf in batch]
    [((None, None, 3), 'float32'), ((None,), 'int64')]
    """
    import keras
    import tensorflow as tf

    leaves = tf.nest.flatten(spec)
    if not all(isinstance(leaf, tf.TensorSpec) for leaf in leaves):
        return None
    batch = tf.nest.map_structure(lambda leaf: keras.KerasTensor(tuple(leaf.shape), leaf.dtype.name), spec)
    return batch if isinstance(batch, tuple) else (batch,)


def stream_dataset(stream: Any) -> Any:
    """An ordered stream as an endless tf.data pipeline: element `i` is `stream[i]`.

    Each element is read by a `tf.py_function` of its index alone, so whatever TF's iterators
    prefetch or repeat, element `i` is always the same global batch. Every worker reads every
    element and keeps its slice (AutoShardPolicy.DATA).

    Example:

    >>> import numpy as np
    >>> dataset = stream_dataset([(np.ones((2, 3), "float32"), np.zeros(2, "int64"))] * 3)
    >>> [tuple(leaf.shape) for leaf in next(iter(dataset))]
    [(2, 3), (2,)]
    """
    import tensorflow as tf

    sample = stream[0]
    leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(sample)]
    dtypes = [tf.as_dtype(leaf.dtype) for leaf in leaves]
    shapes = [[None, *leaf.shape[1:]] for leaf in leaves]

    def read(index):
        return [owned_copy(leaf) for leaf in tf.nest.flatten(stream[int(index)])]

    def load(index):
        tensors = tf.py_function(read, [index], dtypes)
        for tensor, shape in zip(tensors, shapes):
            tensor.set_shape(shape)
        return tf.nest.pack_sequence_as(sample, tensors)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = True
    return tf.data.Dataset.range(2**62).map(load).with_options(options)


# -- Python batches TensorFlow may write into -------------------------------------------------

def owned_copy(leaf: Any, dtype: Any = None) -> np.ndarray:
    """A new NumPy array of `leaf` that nothing else references, for TF to wrap (see module doc).

    Example:

    >>> rows = np.arange(4.0)
    >>> copy = owned_copy(rows[:2], "float32")
    >>> copy[0] = 9.0; rows[0], copy.dtype.name
    (np.float64(0.0), 'float32')
    """
    return np.array(leaf, dtype=dtype, copy=True)


def copy_python_batches(original: Callable) -> Callable:
    """`GeneratorDataAdapter.get_tf_dataset`: every batch the generator yields is copied in the graph.

    A generator's batches are often views of the user's arrays (`y[start:stop]`); TF wraps
    them without copying, and a kernel may write into that memory (see the module doc). A
    `DeepCopy` right after Keras' `from_generator` gives the step buffers TF owns; the
    generator's arrays are only read.

    Example (a stand-in for Keras' dataset: the same elements come out):

    >>> import tensorflow as tf
    >>> get_tf_dataset = copy_python_batches(lambda adapter: tf.data.Dataset.from_tensors((np.ones(2),)))
    >>> [leaf.numpy().tolist() for leaf in next(iter(get_tf_dataset(None)))]
    [[1.0, 1.0]]
    """
    @functools.wraps(original)
    def get_tf_dataset(self, *args, **kwargs):
        return copied_in_graph(original(self, *args, **kwargs))

    return get_tf_dataset


def copied_in_graph(dataset: Any) -> Any:
    """`dataset` with every tensor of every element `DeepCopy`'d: buffers TF owns, not Python's.

    Example:

    >>> import tensorflow as tf
    >>> [int(value) for value in copied_in_graph(tf.data.Dataset.range(3))]
    [0, 1, 2]
    """
    import tensorflow as tf

    def copied(*batch):
        batch = tf.nest.map_structure(
            lambda leaf: tf.raw_ops.DeepCopy(x=leaf) if isinstance(leaf, tf.Tensor) else leaf, batch)
        return batch if isinstance(dataset.element_spec, tuple) else batch[0]

    return dataset.map(copied)


# -- A PyDataset read by batch index ---------------------------------------------------------

_PY_DATASETS = ObjectState()
active.register(__name__, "_PY_DATASETS", reset=_PY_DATASETS.clear, state=_PY_DATASETS.__len__)


def read_pydataset_by_index(arguments: dict) -> None:
    """Marks `fit`'s PyDataset `x` to be read by batch index (`pydataset_read_by_index`).

    Only when `steps_per_epoch` is None: each epoch then reads a fresh iterator made after
    the epoch began, so an order drawn at `on_epoch_begin` is the one that epoch reads. (With
    `steps_per_epoch` Keras carries one iterator across epochs; that keeps Keras' path.)

    Example:

    >>> arguments = {"x": [1, 2], "steps_per_epoch": None}
    >>> read_pydataset_by_index(arguments)   # not a PyDataset: nothing to mark
    """
    from keras.utils import PyDataset

    x = arguments.get("x")
    if isinstance(x, PyDataset) and arguments.get("steps_per_epoch") is None:
        _PY_DATASETS.of(x).by_index = True


def pydataset_read_by_index(original: Callable) -> Callable:
    """`PyDatasetAdapter.get_tf_dataset`: element `i` of an epoch is `py_dataset[order[i]]`.

    Keras feeds a PyDataset to tf.data through `from_generator`, one Python generator per epoch
    that draws the epoch's shuffle and walks it in TF's threads. Under a multi-worker strategy
    that path sometimes ended a shuffled fit differently from one process (the second epoch,
    whose short batch fell mid-epoch; workers agreed with each other). Here a finite PyDataset
    without Keras' enqueuer (`workers <= 1`, no multiprocessing) is `range(num_batches)`
    mapped by a `tf.py_function` of the index alone: the epoch's order is drawn on the main
    thread when the epoch begins (`pydataset_order_at_epoch_begin`), with Python's `random` as
    Keras draws it, so every element is a fixed batch whatever TF prefetches. Other
    PyDatasets (endless, read by Keras' enqueuer, or a fit with `steps_per_epoch`) keep
    Keras' path (its batches copied in the graph, `copied_in_graph`).

    Example (a PyDataset `fit` did not mark keeps Keras' dataset, its batches copied in the graph):

    >>> import keras, numpy as np, tensorflow as tf
    >>> from keras_mwms.backends.keras_api.internals import py_dataset_adapter_class
    >>> class Batches(keras.utils.PyDataset):
    ...     def __len__(self): return 2
    ...     def __getitem__(self, index): return np.ones((2, 3), "float32"), np.zeros(2, "float32")
    >>> get_tf_dataset = pydataset_read_by_index(lambda adapter: tf.data.Dataset.range(2))
    >>> [int(value) for value in get_tf_dataset(py_dataset_adapter_class()(Batches()))]
    [0, 1]
    """
    @functools.wraps(original)
    def get_tf_dataset(self, *args, **kwargs):
        dataset = original(self, *args, **kwargs)
        if (self.enqueuer is not None or self.py_dataset.num_batches is None
                or not _PY_DATASETS.get(self.py_dataset, "by_index", False)):
            # Keras' `from_generator` of the PyDataset's batches: copied, as a generator's are.
            return copied_in_graph(dataset)
        return _indexed_dataset(self, attributes.py_dataset_output_signature(self))

    return get_tf_dataset


def pydataset_order_at_epoch_begin(original: Callable) -> Callable:
    """`PyDatasetAdapter.on_epoch_begin`: also draws the epoch's batch order (main thread).

    Example (an adapter not read by index: only Keras' hook runs, nothing is drawn):

    >>> import random
    >>> state = random.getstate()
    >>> on_epoch_begin = pydataset_order_at_epoch_begin(lambda adapter: "Keras' hook")
    >>> on_epoch_begin(object()), random.getstate() == state
    ("Keras' hook", True)
    """
    @functools.wraps(original)
    def on_epoch_begin(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _PY_DATASETS.get(self, "indexed", False):
            order = list(range(self.py_dataset.num_batches))
            if self.shuffle:
                random.shuffle(order)
            _PY_DATASETS.of(self).order = order
        return result

    return on_epoch_begin


def _indexed_dataset(adapter: Any, signature: Any) -> Any:
    import tensorflow as tf

    state = _PY_DATASETS.of(adapter)
    state.indexed = True
    state.order = list(range(adapter.py_dataset.num_batches))
    specs = tf.nest.flatten(signature)

    def read(index):
        with LEDGER.data(int(index)):   # the hang report's and straggler table's data phase
            batch = attributes.standardize_batch(adapter, adapter.py_dataset[state.order[int(index)]])
        return [owned_copy(leaf, spec.dtype.as_numpy_dtype) for leaf, spec in zip(tf.nest.flatten(batch), specs)]

    def load(index):
        tensors = tf.py_function(read, [index], [spec.dtype for spec in specs])
        for tensor, spec in zip(tensors, specs):
            tensor.set_shape(spec.shape)
        return tf.nest.pack_sequence_as(signature, tensors)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = True
    dataset = tf.data.Dataset.range(adapter.py_dataset.num_batches).map(load)
    return dataset.prefetch(tf.data.AUTOTUNE).with_options(options)


# -- One replica: Keras' tf.data iterator, not a distributed one ------------------------------

class _KeepDataset:
    """Stands in for the strategy in `TFEpochIterator.__init__`: the dataset is not distributed."""

    @staticmethod
    def experimental_distribute_dataset(dataset: Any, options: Any = None) -> Any:
        return dataset


def feed_one_replica_undistributed(backend: Any) -> Callable[[Callable], Callable]:
    """`TFEpochIterator.__init__`: with one worker and one replica, iterate the plain dataset.

    Distributing a dataset over one replica changes no batch (no shard, no rebatch), but each
    step then passes a `DistributedIterator` into Keras' `tf.function`, whose specs TF rebuilds
    in Python on every call, and reads through a multi-device iterator: one process of
    keras_mwms measured 0.87-0.97x plain Keras 3 on the benchmark MLP (batch 128, 1 thread)
    with this per-step cost and no collective in the step's graph. A plain `tf.data` iterator
    gives the step the same tensors; `strategy.run` hands them to the one replica.

    Example (a strategy of several workers or replicas keeps Keras' behaviour):

    >>> from types import SimpleNamespace as Backend
    >>> calls = []
    >>> wrapped = feed_one_replica_undistributed(Backend(strategy="s", num_workers=2))(
    ...     lambda iterator, distribute_strategy=None: calls.append(distribute_strategy))
    >>> wrapped(object(), "s"); calls
    ['s']
    """
    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def __init__(iterator, distribute_strategy=None, *args, **kwargs):
            one_replica = (distribute_strategy is not None and distribute_strategy is backend.strategy
                           and backend.num_workers == 1 and backend.num_replicas_in_sync == 1)
            if not one_replica:
                return original(iterator, distribute_strategy, *args, **kwargs)
            original(iterator, _KeepDataset(), *args, **kwargs)
            attributes.set_distribute_strategy(iterator, distribute_strategy)

        return __init__

    return wrap
