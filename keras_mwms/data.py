"""Global batches → per-replica shards: `InputContext`, `AutoShardPolicy` and the split rules.

The contract, the same on every backend: the batch the user gives (`batch_size`, or a
dataset's batch) is the **global** batch. Each step consumes one global batch, split over all replicas in rank
order: replica r of n takes a contiguous slice of every global batch. When the global batch is
not divisible by n the first `G % n` replicas take one row more; a partial last batch fills
replicas in order, so trailing replicas may get fewer (even zero) rows — exactly
`tf.distribute`'s rebatching, which is what makes N workers equal one process.
"""

from __future__ import annotations

import enum

import numpy as np


class AutoShardPolicy(enum.Enum):
    """How a `tf.data` input is split between workers (as `tf.data.experimental.AutoShardPolicy`).

    * `AUTO`: shard by files when the dataset reads files, else by data.
    * `FILE`: each worker reads a disjoint subset of the input files.
    * `DATA`: every worker reads everything and keeps its slice of each global batch.
    * `OFF`: no sharding: each worker's dataset is already its own part of the data.

    Example:

    >>> AutoShardPolicy["DATA"]
    <AutoShardPolicy.DATA: 'DATA'>
    """

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


class InputContext:
    """What an input function needs to build its worker's part of the input pipeline.

    Passed to the `dataset_fn` of `strategy.distribute_datasets_from_function`, as in
    `tf.distribute.InputContext`.

    Example:

    >>> context = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    >>> context.get_per_replica_batch_size(64)
    16

    Args:
        num_input_pipelines: how many input pipelines (workers) there are.
        input_pipeline_id: this pipeline's index (the worker index).
        num_replicas_in_sync: replicas across all workers.
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        if num_input_pipelines < 1 or not 0 <= input_pipeline_id < num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id {input_pipeline_id} must be in 0..{num_input_pipelines - 1}"
            )
        if num_replicas_in_sync < 1:
            raise ValueError(f"num_replicas_in_sync must be >= 1, got {num_replicas_in_sync}")
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size // num_replicas_in_sync`; `ValueError` if it does not divide."""
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(
                f"The global batch size ({global_batch_size}) must be divisible by "
                f"num_replicas_in_sync ({self._num_replicas_in_sync}). Choose a multiple of "
                f"{self._num_replicas_in_sync}."
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
                f"input_pipeline_id={self._input_pipeline_id}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


def replica_slices(global_batch_size: int, num_replicas: int,
                   rows: int | None = None) -> list[tuple[int, int]]:
    """`(start, stop)` of each replica's rows within one global batch of `rows` rows.

    Example:

    >>> replica_slices(8, 2)
    [(0, 4), (4, 8)]
    >>> replica_slices(8, 2, rows=6)          # partial last batch
    [(0, 4), (4, 6)]
    >>> replica_slices(5, 2)                  # not divisible: first replica takes one more
    [(0, 3), (3, 5)]
    """
    if global_batch_size < 1 or num_replicas < 1:
        raise ValueError("global_batch_size and num_replicas must be >= 1")
    rows = global_batch_size if rows is None else rows
    base, extra = divmod(global_batch_size, num_replicas)
    slices, start = [], 0
    for replica in range(num_replicas):
        size = base + (1 if replica < extra else 0)
        stop = min(start + size, rows)
        slices.append((min(start, rows), stop))
        start += size
    return slices


def worker_row_indices(num_rows: int, global_batch_size: int, num_workers: int,
                       worker_index: int, order: np.ndarray | None = None,
                       replicas_per_worker: int = 1) -> list[np.ndarray]:
    """Row indices of every step's local batch for one worker.

    Step k covers rows `order[k*G:(k+1)*G]` (the global batch; `order` is a permutation
    shared by all workers when shuffling, else identity). The worker takes the contiguous
    slice belonging to its replicas. Every worker gets the same number of steps; on a partial
    last batch a worker's slice may be empty.

    Example:

    >>> [step.tolist() for step in worker_row_indices(10, 4, 2, 1)]
    [[2, 3], [6, 7], []]
    """
    order = np.arange(num_rows) if order is None else np.asarray(order)
    num_replicas = num_workers * replicas_per_worker
    steps = []
    for step_start in range(0, num_rows, global_batch_size):
        rows = min(global_batch_size, num_rows - step_start)
        slices = replica_slices(global_batch_size, num_replicas, rows)
        first = slices[worker_index * replicas_per_worker][0]
        last = slices[(worker_index + 1) * replicas_per_worker - 1][1]
        steps.append(order[step_start + first : step_start + last])
    return steps


def leading_rows(x) -> int | None:
    """Rows of array input `x` (an array, tensor, or list/tuple/dict of them); None otherwise.

    Datasets, generators and `PyDataset`s have no row count known up front: None.

    Example:

    >>> leading_rows({"a": np.zeros((5, 2)), "b": np.zeros((5,))}), leading_rows(iter([]))
    (5, None)
    """
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return next((rows for rows in map(leading_rows, x) if rows is not None), None)
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "__len__") or len(shape) == 0:
        return None
    return int(shape[0])


def global_batch_rows(x, batch_size: int | None) -> int | None:
    """Rows of fit's first global batch when known without reading data: arrays (`batch_size`,
    Keras' default 32, capped by the rows) or a tf.data dataset with a static batch dimension.

    Example:

    >>> import numpy as np
    >>> global_batch_rows(np.zeros((100, 3)), 1), global_batch_rows(np.zeros((5, 3)), None)
    (1, 5)
    """
    rows = leading_rows(x)
    if rows is not None:
        return min(batch_size or 32, rows)
    spec = getattr(x, "element_spec", None)
    leaves = spec if isinstance(spec, (tuple, list)) else [spec]
    shape = getattr(leaves[0], "shape", None) if leaves else None
    if shape is not None and shape.rank:
        return shape[0]
    return None


def uneven_rows_error(rows_per_worker, worker_index: int, what: str) -> ValueError | None:
    """A clear error if workers passed different amounts of array data, else None.

    `rows_per_worker[w]` is worker w's `leading_rows(x)` (None for a dataset). Every worker
    must pass the same global arrays: each takes its rows of every global batch, so different
    lengths would give workers different step counts (a hang or an aborted collective).

    Example:

    >>> print(uneven_rows_error([256, 200], 0, "model.fit()"))  # doctest: +ELLIPSIS
    keras_mwms worker 0: model.fit() got different data on the workers: worker 0: 256 rows, worker 1: 200 rows...
    >>> uneven_rows_error([256, 256], 1, "model.fit()") is None
    True
    """
    if len(set(rows_per_worker)) <= 1:
        return None
    listing = ", ".join(f"worker {index}: " + ("a dataset" if rows is None else f"{rows} rows")
                        for index, rows in enumerate(rows_per_worker))
    return ValueError(
        f"keras_mwms worker {worker_index}: {what} got different data on the workers: {listing}. "
        "Pass the same (global) arrays on every worker: keras_mwms gives each worker its rows of "
        "every global batch. For per-worker data, use a dataset with "
        "AutoShardPolicy.OFF or strategy.distribute_datasets_from_function, and the same number "
        "of batches on every worker.")


def first_batch_digest(x) -> str | None:
    """A short digest of what decides the first global batch of a `tf.data.Dataset` input, else None.

    Every worker reads the same global batches and keeps its slice, so the first batch must be
    the same everywhere; a dataset shuffled with a different seed on each worker (or with none)
    breaks that silently — each worker slices a *different* order, and an epoch trains on some
    rows twice and others never. When the pipeline shuffles, the digest covers the shuffles'
    seeds (a shuffle without any seed gets a random one per process, so it never matches):
    reading a batch from a fresh iterator would advance a reshuffling dataset to its next
    order, and training would start one shuffle later than in one process. Otherwise it covers
    the first batch itself, read from a fresh iterator (nothing is consumed from training's).

    Example:

    >>> first_batch_digest(np.zeros(3)) is None
    True
    """
    import sys

    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(x, tf.data.Dataset):
        return None
    import hashlib

    digest = hashlib.sha256()
    shuffles = _shuffle_seeds(x)
    if shuffles:
        digest.update(repr(shuffles).encode())
    else:
        for leaf in tf.nest.flatten(next(iter(_below_caches(x).take(1)))):
            digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()[:16]


def _below_caches(dataset):
    """The input of the topmost `cache()` of a linear pipeline (repeatedly), else `dataset`.

    A partly read iterator over a cache makes TF warn "The calling iterator did not fully read
    the dataset being cached" (plain Keras never does that); the rows below the cache tell
    whether the workers' data agree just as well.
    """
    current, readable = dataset, dataset
    while current is not None:
        if type(current).__name__ == "CacheDataset":
            readable = current._input_dataset
        try:
            inputs = current._inputs()
        except (NotImplementedError, AttributeError):
            break
        current = inputs[0] if len(inputs) == 1 else None
    return readable


def tf_shuffles(dataset) -> list:
    """Every `shuffle` of a tf.data pipeline, found by walking its inputs from `dataset`.

    Example:

    >>> import tensorflow as tf
    >>> pipeline = tf.data.Dataset.range(8).shuffle(8, seed=1).batch(2).shuffle(4, seed=2)
    >>> len(tf_shuffles(pipeline))
    2
    """
    shuffles, pending, seen = [], [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if type(current).__name__ == "_ShuffleDataset":
            shuffles.append(current)
        try:
            pending.extend(current._inputs())
        except (NotImplementedError, AttributeError):
            continue
    return shuffles


def _shuffle_seeds(dataset) -> list:
    """The (seed, seed2) of every `shuffle` in a tf.data pipeline; unseeded ones get a random pair."""
    import os

    seeds = []
    for shuffle in tf_shuffles(dataset):
        pair = tuple(None if value is None else int(np.asarray(value))
                     for value in (shuffle._seed, shuffle._seed2))
        # No seed at all is stored as (0, 0) (TF then draws a random seed per iterator).
        unseeded = pair in ((None, None), (0, 0))
        seeds.append(("unseeded", os.urandom(8).hex()) if unseeded else pair)
    return seeds


def different_first_batches_warning(digests: list[str | None], what: str) -> str | None:
    """The warning when workers' first global batches differ (see `first_batch_digest`), else None.

    Example:

    >>> print(different_first_batches_warning(["a1", "a1", "b2"], "model.fit()"))  # doctest: +ELLIPSIS
    keras_mwms: model.fit(): the workers' datasets start with different global batches (worker 2 differs from worker 0)...
    >>> different_first_batches_warning(["a1", "a1"], "model.fit()") is None
    True
    """
    if len(set(digests)) <= 1:
        return None
    odd = ", ".join(str(index) for index, digest in enumerate(digests) if digest != digests[0])
    return (
        f"keras_mwms: {what}: the workers' datasets start with different global batches (worker "
        f"{odd} differs from worker 0), so each worker takes its slice of a different order and "
        "an epoch trains on some rows twice and on others never. Usually a `shuffle` without a "
        "seed, or with a different seed per worker: use `.shuffle(buffer, seed=S)` with the same "
        "S everywhere (or call keras.utils.set_random_seed(S) with the same S on every worker "
        "before building the dataset).")
