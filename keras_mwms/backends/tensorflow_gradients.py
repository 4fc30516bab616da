"""One global batch's gradient on TensorFlow, as one process computes it.

Keras 3.15.1 on a `tf.distribute` strategy gets three things wrong that one process gets right,
silently (workers stay bit-identical, so nothing looks broken):

* **Row weights.** Each replica's loss is its *local* mean divided by the number of replicas,
  so with uneven splits a row weighs `1 / (local rows × replicas)` — e.g. 1/33 and 1/30
  instead of 1/32 for a global batch of 32 on 3 workers, 1/8 for a partial batch's lone row
  on its replica. Here each Keras-loop step first sums the replicas' row counts (one scalar
  all-reduce: on the benchmark MLP, 2 workers, 0.92× the Keras 3 + tf.distribute peer with
  it, 1.03× without, in two runs on the 2-core CI machine)
  and scales the loss by `replicas × local rows / global rows`; gradients are then averaged
  over replicas. A row weighs `1 / global rows` on every replica, and a loss a
  custom `train_step` logs is the global batch's mean, as in one process. (Full, evenly split
  batches have a scale of exactly 1.)
* **Clipping.** `clipnorm` / `global_clipnorm` / `clipvalue` ran on each replica's partial
  gradient, before the all-reduce. Here gradients are all-reduced first.
* **Gradient accumulation.** Keras' `tf.cond` around the update contains a `merge_call`, which
  TF forbids in a replica context ("merge_call called while defining a new graph"). Here the
  whole update, accumulation and clipping included, runs after one `merge_call`, in the
  cross-replica context, on the all-reduced gradients.

Example (what `TensorFlowBackend.join` does):

```python
install(backend)      # patches the loss scaling and TFOptimizer._backend_apply_gradients
```
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

_state = threading.local()          # per replica thread: this step's loss scale factor
_keras_loops_running = [0]          # > 0 while our fit/evaluate wrapper runs a Keras loop
_our_strategies: set[int] = set()   # ids of the tf strategies keras_mwms created
_INSTALLED = False


@contextlib.contextmanager
def keras_loop():
    """Marks a Keras fit/evaluate call: its steps are row-weighted (see the module docstring).

    Custom training loops (`strategy.run` outside `fit`) keep Keras' own loss scaling.
    """
    _keras_loops_running[0] += 1
    try:
        yield
    finally:
        _keras_loops_running[0] -= 1


def _row_factor():
    return getattr(_state, "factor", None)


def _rows_of(nest):
    import tensorflow as tf

    leaves = [leaf for leaf in tf.nest.flatten(nest) if leaf is not None and hasattr(leaf, "shape")]
    if not leaves:
        return None
    return tf.cast(tf.shape(leaves[0])[0], tf.float32)


def wrap_run(strategy) -> None:
    """Wraps `strategy.run` so a Keras-loop step knows its replica's row share first."""
    _our_strategies.add(id(strategy))
    original_run = strategy.run

    @functools.wraps(original_run)
    def run(fn: Callable, args=(), kwargs=None, options=None):
        if not _keras_loops_running[0]:
            return original_run(fn, args=args, kwargs=kwargs, options=options)

        @functools.wraps(fn)
        def replica_step(*step_args, **step_kwargs):
            import tensorflow as tf

            rows = _rows_of((step_args, step_kwargs))
            if rows is None:        # no batch to count: every replica's loss counts once
                _state.factor = tf.constant(1.0)
            else:
                context = tf.distribute.get_replica_context()
                global_rows = context.all_reduce(tf.distribute.ReduceOp.SUM, rows)
                _state.factor = tf.math.divide_no_nan(rows * context.num_replicas_in_sync, global_rows)
            try:
                return fn(*step_args, **step_kwargs)
            finally:
                _state.factor = None

        return original_run(replica_step, args=args, kwargs=kwargs, options=options)

    strategy.run = run


def _scale_loss(original: Callable) -> Callable:
    @functools.wraps(original)
    def scale_loss_for_distribution(value):
        factor = _row_factor()
        if factor is None:
            return original(value)
        import tensorflow as tf

        return value * tf.cast(factor, value.dtype)

    return scale_loss_for_distribution


def _unscale_loss(original: Callable) -> Callable:
    @functools.wraps(original)
    def unscale_loss_for_distribution(value):
        factor = _row_factor()
        if factor is None:
            return original(value)
        import tensorflow as tf

        return tf.math.divide_no_nan(value, tf.cast(factor, value.dtype))

    return unscale_loss_for_distribution


def _apply_after_all_reduce(original: Callable) -> Callable:
    """`TFOptimizer._backend_apply_gradients`: all-reduce first, then Keras' whole update."""

    @functools.wraps(original)
    def _backend_apply_gradients(self, grads, trainable_variables):
        import tensorflow as tf

        context = tf.distribute.get_replica_context()
        if context is None or id(self._distribution_strategy) not in _our_strategies:
            return original(self, grads, trainable_variables)
        # In a Keras loop the losses are already row-weighted: average. Elsewhere Keras scaled
        # each replica's loss by 1/replicas: sum, as Keras does. (A global flag, not the
        # replica thread's factor: LossScaleOptimizer applies from a replica thread of its own.)
        operation = (tf.distribute.ReduceOp.MEAN if _keras_loops_running[0]
                     else tf.distribute.ReduceOp.SUM)
        reduced = context.all_reduce(operation, list(grads))

        def update(distribution, reduced_grads):
            local = [distribution.experimental_local_results(grad)[0] for grad in reduced_grads]
            original(self, local, trainable_variables)

        context.merge_call(update, args=(reduced,))

    return _backend_apply_gradients


def _merge_call_in_cross_replica_context(original: Callable) -> Callable:
    """`maybe_merge_call` that calls `fn` directly where the caller is already cross-replica.

    TF's version always asks the replica context for a `merge_call`, so Keras' optimizer
    helpers fail (`'NoneType' object has no attribute 'merge_call'`) when the update itself
    runs inside our one `merge_call`; there, running `fn` directly is what `merge_call` does.
    """

    @functools.wraps(original)
    def maybe_merge_call(fn, strategy, *args, **kwargs):
        import tensorflow as tf

        if tf.distribute.get_replica_context() is None:
            return fn(strategy, *args, **kwargs)
        return original(fn, strategy, *args, **kwargs)

    return maybe_merge_call


def install() -> None:
    """Installs the three repairs once per process (see the module docstring)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from keras.src.backend.tensorflow import optimizer as tensorflow_optimizer
    from keras.src.losses import loss as loss_module

    from keras_mwms.backends.patches import require_tested_keras

    require_tested_keras("tensorflow.row_weighted_loss_scaling")
    loss_module.scale_loss_for_distribution = _scale_loss(loss_module.scale_loss_for_distribution)
    loss_module.unscale_loss_for_distribution = _unscale_loss(loss_module.unscale_loss_for_distribution)
    require_tested_keras("tensorflow.all_reduce_before_update")
    import tensorflow as tf

    interim = tf.__internal__.distribute.interim
    interim.maybe_merge_call = _merge_call_in_cross_replica_context(interim.maybe_merge_call)
    tensorflow_optimizer.TFOptimizer._backend_apply_gradients = _apply_after_all_reduce(
        tensorflow_optimizer.TFOptimizer._backend_apply_gradients)
    _INSTALLED = True
