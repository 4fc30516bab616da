"""Input handling on TensorFlow that Keras gets wrong on a multi-worker strategy.

**Datasets each worker feeds whole.** With `AutoShardPolicy.OFF` every worker's dataset is its own data, batched at the global batch
size. TF splits every such batch into one piece per replica and this worker feeds all of the
pieces, so an epoch has about `cardinality × num_workers` steps; Keras counts `cardinality` and
silently stops halfway. `distribute_unsharded_dataset` distributes the dataset with its true
step count, after checking that every worker runs the same number of steps (else their
collectives would pair wrongly or hang).

**Resumable ordered streams** (`keras_mwms.resumable_inputs`) are fed as a tf.data pipeline
whose element `i` is the stream's item `i`, read by a `tf.py_function` (`stream_dataset`), not
through Keras' `PyDataset` adapter: that adapter's `from_generator` keeps each epoch's position
in a Python generator, and with several workers TF's prefetching iterators lost batches of it
(README "Known gaps"); a pure function of the element index cannot.

**A batch for the model's symbolic build.** Keras pulls one from the epoch iterator, which
consumes batches of a Python generator and advances shuffles; `batch_without_iterating` gives
one with the same shapes and dtypes without touching the data.

Example:

>>> import numpy as np
>>> shard_policy_is_off(np.zeros(3))
False
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_mwms.data import replica_slices


def shard_policy_is_off(dataset: Any) -> bool:
    """Whether `dataset` is a `tf.data.Dataset` whose auto-shard policy is OFF.

    Example:

    >>> shard_policy_is_off([1, 2, 3])
    False
    """
    import sys

    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(dataset, tf.data.Dataset):
        return False
    policy = dataset.options().experimental_distribute.auto_shard_policy
    return policy == tf.data.experimental.AutoShardPolicy.OFF


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
        return zeros_like_spec(adapter._dataset.element_spec)
    return None


def zeros_like_spec(spec: Any) -> Any:
    """A batch of zeros matching a dataset's dense `element_spec` (batch dimension 1), else None.

    Example:

    >>> import tensorflow as tf
    >>> batch = zeros_like_spec((tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int64)))
    >>> [(tuple(leaf.shape), leaf.dtype.name) for leaf in batch]
    [((1, 3), 'float32'), ((1,), 'int64')]
    """
    import tensorflow as tf

    leaves = tf.nest.flatten(spec)
    if not all(isinstance(leaf, tf.TensorSpec) for leaf in leaves):
        return None
    batch = tf.nest.map_structure(
        lambda leaf: tf.zeros([1 if size is None else size for size in leaf.shape], leaf.dtype), spec)
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
        return [np.asarray(leaf) for leaf in tf.nest.flatten(stream[int(index)])]

    def load(index):
        tensors = tf.py_function(read, [index], dtypes)
        for tensor, shape in zip(tensors, shapes):
            tensor.set_shape(shape)
        return tf.nest.pack_sequence_as(sample, tensors)

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = True
    return tf.data.Dataset.range(2**62).map(load).with_options(options)
