"""The `tf.compat.v1.distribute.MultiWorkerMirroredStrategy` methods, on every backend.

Users arriving from the compat.v1 documentation call `make_dataset_iterator`,
`make_input_fn_iterator`, `experimental_run`, `experimental_make_numpy_dataset` and
`update_config_proto`. They are thin, documented aliases of the v2 calls here, so the old
code keeps working, and each docstring names the v2 call to move to.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any


class InputReplicationMode(enum.Enum):
    """How `make_input_fn_iterator` calls the input function (as `tf.distribute.InputReplicationMode`).

    Only `PER_WORKER` exists: `input_fn` is called once per worker and its dataset is batched
    per replica.

    Example:

    >>> InputReplicationMode.PER_WORKER.value
    'PER_WORKER'
    """

    PER_WORKER = "PER_WORKER"


class CompatV1Methods:
    """Mixin for `MultiWorkerMirroredStrategy`: the compat.v1 surface over the v2 methods."""

    def make_dataset_iterator(self, dataset: Any) -> Iterator:
        """An iterator over `dataset` (batched at the **global** batch) distributed across replicas.

        v2: `iter(strategy.experimental_distribute_dataset(dataset))`.

        Example:

        ```python
        iterator = strategy.make_dataset_iterator(dataset.batch(64))
        per_replica_loss = strategy.experimental_run(step_fn, iterator)
        ```
        """
        return iter(self.experimental_distribute_dataset(dataset))

    def make_input_fn_iterator(self, input_fn: Callable, replication_mode: Any = InputReplicationMode.PER_WORKER) -> Iterator:
        """Calls `input_fn(input_context)` once on this worker and iterates its per-replica batches.

        v2: `iter(strategy.distribute_datasets_from_function(input_fn))`.

        Example:

        ```python
        def input_fn(input_context):
            batch = input_context.get_per_replica_batch_size(64)
            return make_dataset().shard(input_context.num_input_pipelines,
                                        input_context.input_pipeline_id).batch(batch)
        iterator = strategy.make_input_fn_iterator(input_fn)
        ```

        Args:
            input_fn: a function of an `InputContext` returning a dataset batched per replica.
            replication_mode: `InputReplicationMode.PER_WORKER` (the only mode, as in TF).
        """
        mode = getattr(replication_mode, "name", replication_mode)
        if str(mode).upper() != "PER_WORKER":
            raise ValueError(
                f"replication_mode={replication_mode!r} is not supported; only "
                "InputReplicationMode.PER_WORKER exists (input_fn is called once per worker)."
            )
        return iter(self.distribute_datasets_from_function(input_fn))

    def experimental_run(self, fn: Callable, input_iterator: Iterator | None = None) -> Any:
        """Runs `fn` on every replica with the next batch of `input_iterator` (if given).

        v2: `strategy.run(fn, args=(next(iterator),))`.

        Example:

        ```python
        per_replica = strategy.experimental_run(lambda batch: model(batch), iterator)
        ```
        """
        if input_iterator is None:
            return self.run(fn)
        return self.run(fn, args=(next(input_iterator),))

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> Any:
        """A `tf.data.Dataset` of the rows of `numpy_input` (an array or a nest of arrays).

        Batch it at the global batch size and pass it to `make_dataset_iterator`,
        `experimental_distribute_dataset` or `fit`. v2: `tf.data.Dataset.from_tensor_slices`.
        Needs TensorFlow installed (any Keras backend).

        Example:

        ```python
        dataset = strategy.experimental_make_numpy_dataset((x, y)).batch(64)
        ```
        """
        try:
            import tensorflow as tf
        except ImportError:
            raise ImportError(
                "experimental_make_numpy_dataset builds a tf.data.Dataset and needs TensorFlow "
                "(pip install tensorflow-cpu). Without it, pass the NumPy arrays to model.fit "
                "directly: keras_mwms shards them per worker."
            ) from None
        return tf.data.Dataset.from_tensor_slices(numpy_input)

    def update_config_proto(self, config_proto: Any) -> Any:
        """Returns a copy of a TF `ConfigProto` updated for this strategy (TensorFlow backend only).

        On JAX and torch there is no session config: a `NotImplementedError` says so.

        Example:

        ```python
        config = strategy.update_config_proto(tf.compat.v1.ConfigProto())
        ```
        """
        return self.backend.update_config_proto(config_proto)
