"""What a callback needs from the job: am I the chief, wait for all, share the chief's value.

Callbacks work with or without a strategy: without one (plain single-process Keras) this
process is the chief and the collectives are no-ops, so the Keras single-worker behaviour
of every callback is kept.
"""

from __future__ import annotations

from typing import Any

from keras_mwms import active


def is_chief() -> bool:
    """True on the worker that writes files (or when no strategy exists).

    Example:

    >>> is_chief()
    True
    """
    strategy = active.active_strategy()
    return strategy is None or strategy.is_chief


def num_workers() -> int:
    """Workers in the job (1 without a strategy)."""
    strategy = active.active_strategy()
    return 1 if strategy is None else strategy.num_workers


def worker_index() -> int:
    """This worker's rank (0 without a strategy)."""
    strategy = active.active_strategy()
    return 0 if strategy is None else strategy.worker_index


def any_worker(flag: bool) -> bool:
    """True on every worker if `flag` is true on at least one (one tiny all-reduce).

    Example:

    >>> any_worker(False)
    False
    """
    strategy = active.active_strategy()
    if strategy is None or strategy.num_workers == 1:
        return bool(flag)
    import keras
    import numpy as np

    value = np.asarray([1.0 if flag else 0.0], dtype="float32")
    all_reduce_sum = getattr(strategy.backend, "all_reduce_sum", None)
    if all_reduce_sum is not None:     # one traced collective: no eager-collective warning on TF
        return float(np.asarray(all_reduce_sum(value)).sum()) > 0
    total = strategy.reduce("SUM", strategy.run(lambda: keras.ops.convert_to_tensor(value)), axis=None)
    return float(keras.ops.convert_to_numpy(total).sum()) > 0


def barrier(name: str) -> None:
    """Waits for every worker (bounded by the collective timeout); no-op on one worker."""
    strategy = active.active_strategy()
    if strategy is not None and strategy.num_workers > 1:
        strategy.backend.barrier(name)


def broadcast_from_chief(value: Any) -> Any:
    """The chief's `value` on every worker; returns `value` itself on one worker.

    Example:

    >>> broadcast_from_chief({"epoch": 3})
    {'epoch': 3}
    """
    strategy = active.active_strategy()
    if strategy is None or strategy.num_workers == 1:
        return value
    return strategy.backend.broadcast_object(value, 0)


def sync_model_state(model) -> None:
    """Writes the JAX trainer's in-flight state back into the model's variables, if any."""
    sync = getattr(model, "jax_state_sync", None)
    if callable(sync):
        sync()


def check_workers_agree(model, where: str) -> None:
    """Raises `keras_mwms.WorkersDifferError` on every worker if their variables differ
    (see `keras_mwms.backends.consistency`); nothing without a multi-worker strategy."""
    strategy = active.active_strategy()
    if strategy is not None and strategy.num_workers > 1:
        strategy.backend.check_workers_agree(model, where)
