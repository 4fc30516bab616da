"""All-reduce bandwidth and latency of the engine keras_mwms uses on each backend.

Measured inside the workers of a keras_mwms gang, on the strategy's own engine, the way a
training step uses it:

* TensorFlow: `tf.distribute` collective all-reduce (`ReplicaContext.all_reduce("SUM")` inside
  a `tf.function`, through the strategy's `CommunicationOptions`: gRPC ring on CPU) — the path
  Keras' optimizer takes for gradients under the strategy.
* JAX: the XLA all-reduce (`psum` in a jitted `shard_map` over the strategy's device mesh, gloo
  on CPU) — the collective XLA inserts for the gradients of `DataParallel`.
* torch: `TorchBackend.all_reduce_flat` (flat buckets on `torch.distributed`, gloo on CPU) — the
  gradient all-reduce of keras_mwms' torch train step.

Every worker runs the same sizes and iteration counts (from the shared config), timing each
operation; a size's time is the slowest worker's median operation (the median, because other
processes on a shared machine inflate a few operations a lot). `summarize` adds nccl-tests' algbw/busbw columns and the
ring lower bound from the measured link bandwidth (`keras_mwms.benchmark.bandwidth`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from keras_mwms.benchmark.bandwidth import bus_bandwidth, ring_lower_bound_seconds

WARMUP_ITERATIONS = 2


def tensorflow_all_reduce(strategy, elements: int) -> Callable[[], float]:
    """One compiled TF collective all-reduce of `elements` float32; the callable returns element 0."""
    import tensorflow as tf

    tf_strategy = strategy.backend.strategy
    with tf_strategy.scope():
        value = tf.ones([elements], tf.float32)

    @tf.function
    def all_reduce_once():
        def replica_fn():
            reduced = tf.distribute.get_replica_context().all_reduce("SUM", value)
            return reduced[:1]

        return tf_strategy.run(replica_fn)

    def run() -> float:
        return float(tf_strategy.experimental_local_results(all_reduce_once())[0].numpy()[0])

    return run


def jax_all_reduce(strategy, elements: int) -> Callable[[], float]:
    """One jitted XLA `psum` over the strategy's mesh of `elements` float32 per device."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = strategy.backend.mesh
    if mesh is None:
        raise ValueError("the JAX all-reduce benchmark needs several devices; run it with --workers >= 2")
    axis = mesh.axis_names[0]
    local = np.ones((jax.local_device_count(), elements), np.float32)
    value = jax.make_array_from_process_local_data(NamedSharding(mesh, P(axis)), local)
    all_reduce_once = jax.jit(jax.shard_map(lambda block: jax.lax.psum(block, axis), mesh=mesh,
                                            in_specs=P(axis), out_specs=P(axis)))

    def run() -> float:
        reduced = all_reduce_once(value)
        reduced.block_until_ready()
        return float(np.asarray(reduced.addressable_shards[0].data[0, 0]))

    return run


def torch_all_reduce(strategy, elements: int) -> Callable[[], float]:
    """One `TorchBackend.all_reduce_flat` of `elements` float32 (the gradient path)."""
    import torch

    value = torch.ones(elements, dtype=torch.float32)
    backend = strategy.backend

    def run() -> float:
        return float(backend.all_reduce_flat([value], what="benchmark all-reduce")[0][0])

    return run


ENGINES = {"tensorflow": tensorflow_all_reduce, "jax": jax_all_reduce, "torch": torch_all_reduce}


def measure(strategy, backend_name: str, sizes: Sequence[int], iterations_for: Callable[[int], int],
            label: str = "sweep") -> list[dict]:
    """Times the engine at each size (bytes); every worker must call it with the same arguments.

    Returns one row per size: `bytes`, `iterations`, `seconds` (median all-reduce time on this
    worker), `mean_seconds` and `correct` (the reduced value equals the number of replicas).
    """
    make_engine = ENGINES[backend_name]
    replicas = strategy.num_replicas_in_sync
    rows = []
    for nbytes in sizes:
        elements = max(1, nbytes // 4)
        run = make_engine(strategy, elements)
        value = 0.0
        for _ in range(WARMUP_ITERATIONS):
            value = run()
        iterations = iterations_for(nbytes)
        strategy.barrier(f"all-reduce {nbytes}")
        times = []
        for _ in range(iterations):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        rows.append({"label": label, "bytes": elements * 4, "iterations": iterations,
                     "seconds": statistics.median(times), "mean_seconds": statistics.fmean(times),
                     "correct": bool(value == replicas)})
    return rows


def summarize(per_worker_rows: Sequence[Sequence[dict]], workers: int, link_bandwidth: float) -> list[dict]:
    """Merges the workers' rows (slowest worker per size) and adds the nccl-tests columns.

    Example:

    >>> rows = summarize([[{"label": "sweep", "bytes": 1_000_000, "iterations": 5, "seconds": 0.004,
    ...                     "correct": True}],
    ...                   [{"label": "sweep", "bytes": 1_000_000, "iterations": 5, "seconds": 0.005,
    ...                     "correct": True}]], workers=2, link_bandwidth=1e9)
    >>> [(row["time_us"], row["algbw_gbps"], row["busbw_gbps"], row["bound_us"], row["of_bound"])
    ...  for row in rows]
    [(5000.0, 0.2, 0.2, 1000.0, 0.2)]
    """
    merged = []
    for position, first in enumerate(per_worker_rows[0]):
        seconds = max(rows[position]["seconds"] for rows in per_worker_rows)
        algorithm_bandwidth = first["bytes"] / seconds
        bound = ring_lower_bound_seconds(first["bytes"], workers, link_bandwidth)
        merged.append({
            "label": first["label"],
            "bytes": first["bytes"],
            "iterations": first["iterations"],
            "time_us": round(seconds * 1e6, 3),
            "algbw_gbps": round(algorithm_bandwidth / 1e9, 6),
            "busbw_gbps": round(bus_bandwidth(algorithm_bandwidth, workers) / 1e9, 6),
            "bound_us": round(bound * 1e6, 3),
            "of_bound": round(bound / seconds, 6),
            "correct": all(rows[position]["correct"] for rows in per_worker_rows),
        })
    return merged
