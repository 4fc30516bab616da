"""One global batch's gradient on TensorFlow, as one process computes it.

Keras 3.15.1 on a `tf.distribute` strategy gets three things wrong that one process gets right,
silently (workers stay bit-identical, so nothing looks broken):

* **Row weights.** Each replica's loss is its *local* mean divided by the number of replicas,
  so with uneven splits a row weighs `1 / (local rows × replicas)` — e.g. 1/33 and 1/30
  instead of 1/32 for a global batch of 32 on 3 workers, 1/8 for a partial batch's lone row
  on its replica. Here a row weighs `1 / global rows` on every replica, in one of two ways:

  - Keras' own `train_step` / `test_step` (the loss is used only for the gradient and the
    loss trackers, which divide the scale out again): the loss is scaled by the local row
    count, so backward yields rows × the local mean gradient; the count rides as one more
    float32 value in the gradient all-reduce (a sum), and the sums are divided by the global
    row count — what the JAX flat path and torch do. One collective per step; `evaluate`
    sends none. (One replica in all: no scaling, its rows are the global batch.)
  - A custom `train_step` / `test_step` (it may log the loss it computes) or a
    `LossScaleOptimizer`: each step first sums the replicas' row counts (one scalar
    all-reduce) and scales the loss by `replicas × local rows / global rows`; gradients are
    then averaged over replicas, so a loss a custom `train_step` logs is the global batch's
    mean, as in one process. (Full, evenly split batches have a scale of exactly 1.) Under a
    `LossScaleOptimizer` the scale is the row share, `local rows / global rows`, and gradients
    are summed: per row, the float16 values of each replica's scaled backward are then one
    process's, so steps overflow as in one process.

  On the benchmark MLP, 2 workers, the scalar all-reduce cost ≈ 7 % of the step.
* **Clipping.** `clipnorm` / `global_clipnorm` / `clipvalue` ran on each replica's partial
  gradient, before the all-reduce. Here gradients are all-reduced first.
* **Gradient accumulation.** Keras' `tf.cond` around the update contains a `merge_call`, which
  TF forbids in a replica context ("merge_call called while defining a new graph"). Here the
  whole update, accumulation and clipping included, runs after one `merge_call`, in the
  cross-replica context, on the all-reduced gradients.
* **Loss scaling.** `LossScaleOptimizer` checks each replica's partial gradient for inf/NaN
  and all-reduces inside a `tf.cond`: mixed_float16 hangs in the first step. Here it decides
  on the all-reduced gradient, the same on every worker.

* **Compression.** With `CommunicationOptions(compression=...)` the float32 gradients are cast
  to bf16/fp16 for the all-reduce (summed in 16 bits by TF's collective) and back to float32,
  where a mean divides by the replicas (`keras_mwms.backends.compression`); the row counts stay
  float32.

`RowWeighting` holds the replacements; `keras_mwms.backends.tensorflow.patches` lists them as
rows of the backend's patch table.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

from keras_mwms.backends import policy
from keras_mwms.backends.compression import WIRE, wire_dtype
from keras_mwms.backends.keras_api import internals, optimizer_attributes
from keras_mwms.backends.tensorflow.accumulation import (
    accumulate_or_apply,
    accumulates_locally,
    count_window_all_reduce,
    on_first_replica,
    worker_share,
)


def _rows_of(nest):
    import tensorflow as tf

    leaves = [leaf for leaf in tf.nest.flatten(nest) if leaf is not None and hasattr(leaf, "shape")]
    if not leaves:
        return None
    return tf.cast(tf.shape(leaves[0])[0], tf.float32)


def keras_own_steps(model: Any) -> bool:
    """Whether `model` trains and evaluates with Keras' own `train_step` and `test_step`.

    Those use the loss only for the gradient and (unscaled) for the loss trackers, so the row
    weighting may move from the loss to the gradient all-reduce. A subclass overriding either
    may log the loss it computes: it keeps the row-count all-reduce and the scaled loss.

    Example:

    >>> import keras
    >>> keras_own_steps(keras.Sequential([keras.layers.Dense(1)]))
    True
    >>> class Custom(keras.Model):
    ...     def train_step(self, data):
    ...         return super().train_step(data)
    >>> keras_own_steps(Custom())
    False
    """
    return model is not None and internals.keras_own_train_step(model) and internals.keras_own_test_step(model)


def _wires(compression: str | None, values: list) -> list:
    """Each value's 16-bit wire dtype name under `compression`, else None."""
    return [wire_dtype(compression, value.dtype.name) for value in values]


def _wire_bytes(values: list, wires: list) -> int:
    """The bytes `values` take on the wire, each in its wire dtype (None: its own)."""
    import tensorflow as tf

    return sum((value.shape.num_elements() or 0) * (tf.as_dtype(wire) if wire else value.dtype).size
               for value, wire in zip(values, wires))


def _times(value, factor):
    return value * factor


def _divided(value, factor):
    """`value / factor` (0 where the factor is 0), for a tensor or IndexedSlices."""
    import tensorflow as tf

    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(_divided(value.values, factor), value.indices, value.dense_shape)
    return tf.math.divide_no_nan(value, tf.cast(factor, value.dtype))


def merged_repeated_slices(slices, replicas: int):
    """An all-reduced IndexedSlices gradient as one process computes it, when every replica's
    part names the same rows once each: those parts summed row by row.

    TF all-reduces IndexedSlices by gathering every replica's (indices, values). A lookup that
    does not depend on the batch — keras.io's position embedding, `Embedding(maxlen, dim)` of
    `ops.arange(maxlen)` inside `call()` — gives every replica all positions once, so the
    gathered gradient names each position once per replica, where one process names it once.
    Keras' sparse optimizer updates treat each entry apart (Adam squares each copy: the sum of
    squares, not the square of the sum), so the workers trained away from one process
    (0.01-0.14 after a few epochs), while SGD stayed exact. A batch-dependent lookup (token ids)
    keeps its gathered entries: one process has one per occurrence too. The test is made on the
    gathered tensor, the same on every worker: `replicas` equal blocks of indices, each with no
    repeats.

    Example:

    >>> import tensorflow as tf
    >>> gathered = tf.IndexedSlices(tf.constant([[1.0], [2.0], [3.0], [4.0]]), tf.constant([0, 1, 0, 1]),
    ...                             tf.constant([2, 1]))
    >>> merged = merged_repeated_slices(gathered, 2)
    >>> merged.indices.numpy().tolist(), merged.values.numpy().ravel().tolist()
    ([0, 1], [4.0, 6.0])
    >>> tokens = tf.IndexedSlices(tf.constant([[1.0], [2.0]]), tf.constant([3, 5]), tf.constant([8, 1]))
    >>> merged_repeated_slices(tokens, 2).indices.numpy().tolist()
    [3, 5]
    """
    import tensorflow as tf

    if replicas < 2:
        return slices
    indices, values = slices.indices, slices.values
    count = tf.shape(indices)[0]
    block = count // replicas

    def repeated_per_replica():
        blocks = tf.reshape(indices[:block * replicas], [replicas, -1])
        return tf.logical_and(tf.reduce_all(tf.equal(blocks, blocks[:1])),
                              tf.equal(tf.size(tf.unique(blocks[0]).y), block))

    whole_blocks = tf.logical_and(tf.equal(count % replicas, 0), block > 0)
    merge = tf.cond(whole_blocks, repeated_per_replica, lambda: tf.constant(False))

    def summed():
        parts = tf.reshape(values, tf.concat([[replicas, block], tf.shape(values)[1:]], 0))
        return tf.reduce_sum(parts, axis=0), indices[:block]

    merged_values, merged_indices = tf.cond(merge, summed, lambda: (values, indices))
    return tf.IndexedSlices(merged_values, merged_indices, slices.dense_shape)


class RowWeighting:
    """Row-weighted loss scaling and all-reduce-before-update for one tf strategy's Keras loops.

    Each method taking `original` is a patch replacement factory (see the module docstring);
    `keras_loop()` marks a fit/evaluate call whose steps are row-weighted. Custom training
    loops (`strategy.run` outside `fit`) keep Keras' own loss scaling.

    Example (outside a Keras loop every replacement defers to the original):

    >>> weighting = RowWeighting(strategy=None)
    >>> weighting.scale_loss(lambda value: value / 2)(3.0)
    1.5
    >>> with weighting.keras_loop():
    ...     weighting.loops_running
    1

    Args:
        strategy: the `tf.distribute` strategy keras_mwms created; optimizers of other
            strategies keep Keras' update.
        compression: returns `CommunicationOptions.compression` when a step is traced
            (default: no compression).
    """

    def __init__(self, strategy: Any, compression: Callable[[], str | None] = lambda: None):
        self.strategy = strategy
        self.compression = compression
        self.loop_models: list = []              # models of the Keras loops our fit/evaluate runs, innermost last
        self._replica = threading.local()        # per replica thread: this step's loss scale factor

    @contextlib.contextmanager
    def keras_loop(self, model: Any = None):
        """Marks a Keras fit/evaluate call of `model`: its steps are row-weighted."""
        self.loop_models.append(model)
        try:
            yield
        finally:
            self.loop_models.pop()

    @property
    def loops_running(self) -> int:
        """How many Keras loops of ours are running (> 0: steps are row-weighted)."""
        return len(self.loop_models)

    def _loop_model(self) -> Any:
        """The innermost running Keras loop's model, or None."""
        return self.loop_models[-1] if self.loop_models else None

    def _loss_scaled(self) -> bool:
        """Whether the innermost Keras loop's model trains with a LossScaleOptimizer."""
        from keras.optimizers import LossScaleOptimizer

        return isinstance(getattr(self._loop_model(), "optimizer", None), LossScaleOptimizer)

    def _counts_in_gradient_all_reduce(self) -> bool:
        """Whether this loop's steps may carry the row count in the gradient all-reduce.

        Keras' own train/test steps without accumulation: an accumulating optimizer weighs each
        micro-step by its own global row count, so it needs the count before the window's sum.
        """
        model = self._loop_model()
        optimizer = getattr(model, "optimizer", None)
        return keras_own_steps(model) and not getattr(optimizer, "gradient_accumulation_steps", None)

    def _factor(self):
        return getattr(self._replica, "factor", None)

    def run(self, original: Callable) -> Callable:
        """`strategy.run` that lets a Keras-loop step know its replica's row share first."""
        @functools.wraps(original)
        def run(fn: Callable, *args, **kwargs):
            if not self.loops_running:
                return original(fn, *args, **kwargs)

            @functools.wraps(fn)
            def replica_step(*step_args, **step_kwargs):
                import tensorflow as tf

                rows = _rows_of((step_args, step_kwargs))
                context = tf.distribute.get_replica_context()
                loss_scaled = self._loss_scaled()
                replicas = 1 if loss_scaled else context.num_replicas_in_sync
                if rows is None:        # no batch to count: every replica's loss counts alike
                    self._replica.factor = tf.constant(replicas / context.num_replicas_in_sync)
                elif context.num_replicas_in_sync == 1:   # its rows are the global batch
                    self._replica.factor = tf.constant(1.0)
                elif not loss_scaled and self._counts_in_gradient_all_reduce():
                    # The loss times the local row count: backward yields rows × the local mean
                    # gradient at no extra cost; the count rides in the gradient all-reduce
                    # (`apply_after_all_reduce`), and the loss trackers divide it out again.
                    self._replica.factor = rows
                    self._replica.rows = rows
                else:
                    WIRE.trace("row count", 4)
                    global_rows = context.all_reduce(tf.distribute.ReduceOp.SUM, rows)
                    self._replica.factor = tf.math.divide_no_nan(rows * replicas, global_rows)
                    self._replica.counted = (rows, global_rows)
                try:
                    return fn(*step_args, **step_kwargs)
                finally:
                    self._replica.factor = None
                    self._replica.rows = None
                    self._replica.counted = None

            return original(replica_step, *args, **kwargs)

        return run

    def scale_loss(self, original: Callable) -> Callable:
        """`scale_loss_for_distribution`: multiply by the row factor inside a Keras-loop step."""
        return self._with_factor(original, _times)

    def unscale_loss(self, original: Callable) -> Callable:
        """`unscale_loss_for_distribution`: divide by the row factor inside a Keras-loop step."""
        return self._with_factor(original, _divided)

    def _with_factor(self, original: Callable, combine: Callable) -> Callable:
        @functools.wraps(original)
        def replacement(value, *args, **kwargs):
            factor = self._factor()
            if factor is None:
                return original(value, *args, **kwargs)
            import tensorflow as tf

            return combine(value, tf.cast(factor, value.dtype))

        return replacement

    def row_share(self, context):
        """This replica's rows × replicas ÷ the global rows inside a Keras-loop step (1 without a
        batch to count); the fast path learns the global rows with one scalar all-reduce."""
        import tensorflow as tf

        counted = getattr(self._replica, "counted", None)
        if counted is not None:
            rows, global_rows = counted
        else:
            rows = getattr(self._replica, "rows", None)
            if rows is None:
                return tf.constant(1.0)
            WIRE.trace("row count", 4)
            global_rows = context.all_reduce(tf.distribute.ReduceOp.SUM, rows)
        return tf.math.divide_no_nan(rows * context.num_replicas_in_sync, global_rows)

    def apply_after_all_reduce(self, original: Callable) -> Callable:
        """`TFOptimizer._backend_apply_gradients`: all-reduce first, then Keras' whole update."""
        @functools.wraps(original)
        def _backend_apply_gradients(optimizer, grads, trainable_variables, *args, **kwargs):
            import tensorflow as tf

            context = tf.distribute.get_replica_context()
            if context is None or optimizer_attributes.distribution_strategy(optimizer) is not self.strategy:
                return original(optimizer, grads, trainable_variables, *args, **kwargs)
            # In a Keras loop the losses are already row-weighted: average. Elsewhere Keras
            # scaled each replica's loss by 1/replicas: sum, as Keras does. (The loop count,
            # not the replica thread's factor: LossScaleOptimizer applies from a replica
            # thread of its own.)
            if accumulates_locally(optimizer):
                # The replica's share of the global mean gradient stays on the worker until the
                # K-th micro-step (`keras_mwms.backends.tensorflow.accumulation`).
                divisor = context.num_replicas_in_sync if self.loops_running else 1
                shares = [tf.convert_to_tensor(_divided(grad, divisor)) for grad in grads]

                def accumulate(distribution, replica_shares):
                    accumulate_or_apply(
                        optimizer, [worker_share(distribution.experimental_local_results(share))
                                    for share in replica_shares],
                        trainable_variables, lambda window: self._sum_across_workers(distribution, window))

                context.merge_call(accumulate, args=(shares,))
                return
            rows = getattr(self._replica, "rows", None)
            if rows is not None:
                # Keras' own train_step: its loss was scaled by the row count, so the gradients
                # are rows × the local mean's. Sum them with the row counts in one all-reduce,
                # then divide by the global row count.
                grads = list(grads)
                if all(self._sent_dtype(grad) == rows.dtype for grad in grads):
                    *summed, global_rows = self._all_reduce(context, tf.distribute.ReduceOp.SUM, grads,
                                                            exact=[rows])
                else:   # TF packs one dtype per collective: 16-bit (compressed) or float64 gradients
                    summed = self._all_reduce(context, tf.distribute.ReduceOp.SUM, grads)
                    WIRE.trace("row count", 4)
                    global_rows = context.all_reduce(tf.distribute.ReduceOp.SUM, rows)
                reduced = [_divided(total, global_rows) for total in summed]
            else:
                operation = (tf.distribute.ReduceOp.MEAN if self.loops_running
                             else tf.distribute.ReduceOp.SUM)
                reduced = self._all_reduce(context, operation, list(grads))

            replicas = context.num_replicas_in_sync
            reduced = [merged_repeated_slices(grad, replicas) if isinstance(grad, tf.IndexedSlices) else grad
                       for grad in reduced]

            def update(distribution, reduced_grads):
                local = [distribution.experimental_local_results(grad)[0] for grad in reduced_grads]
                original(optimizer, local, trainable_variables, *args, **kwargs)

            context.merge_call(update, args=(reduced,))

        return _backend_apply_gradients

    def loss_scale_after_all_reduce(self, original: Callable) -> Callable:
        """`LossScaleOptimizer._tf_apply`: all-reduce, then decide finiteness on the global gradient.

        Keras checks each replica's own partial gradient for inf/NaN, then, in a `tf.cond`,
        applies (with the inner optimizer's all-reduce in that branch) or skips. Across workers
        that deadlocks in the first step, and if it did not, workers would disagree on skipping.
        Here the gradients are all-reduced first (as `apply_after_all_reduce` does), so every
        worker sees the same global gradient, skips the same steps and keeps one loss scale: the
        decision one process makes on its whole batch.
        """
        @functools.wraps(original)
        def _tf_apply(optimizer, grads, trainable_variables=None, *args, **kwargs):
            import tensorflow as tf
            from keras import ops

            context = tf.distribute.get_replica_context()
            if context is None or tf.distribute.get_strategy() is not self.strategy:
                return original(optimizer, grads, trainable_variables, *args, **kwargs)
            if optimizer_attributes.distribution_strategy(optimizer.inner_optimizer) is not self.strategy:
                # Keras' own path would deadlock across workers in the first step.
                raise ValueError(
                    "keras_mwms: this LossScaleOptimizer (mixed_float16) was created outside "
                    "strategy.scope(), so TensorFlow cannot apply it on several workers. Create the "
                    "optimizer inside `with strategy.scope():`, where the model is compiled.")
            present = [i for i, grad in enumerate(grads) if grad is not None]
            reduced = (self._all_reduce(context, tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
                       if present else [])

            model = self._loop_model()
            in_float16 = (policy.float16_gradients(model, list(trainable_variables))
                          if model is not None and trainable_variables is not None else [])

            def update(distribution, reduced_grads):
                local = list(grads)
                for i, grad in zip(present, reduced_grads):
                    local[i] = distribution.experimental_local_results(grad)[0]
                    if i < len(in_float16) and in_float16[i]:
                        # One process computed this gradient in float16: inf beyond its range.
                        local[i] = tf.where(tf.abs(local[i]) >= policy.FLOAT16_OVERFLOW,
                                            tf.constant(float("inf"), local[i].dtype), local[i])
                finite = optimizer.check_finite(local)
                ops.cond(finite,
                         lambda: optimizer_attributes.handle_finite_grads(optimizer, local, trainable_variables),
                         lambda: optimizer_attributes.handle_non_finite_grads(optimizer))

            context.merge_call(update, args=(reduced,))

        return _tf_apply

    def _sent_dtype(self, grad):
        """The dtype `grad` travels in: its wire type when compressing, else its own."""
        import tensorflow as tf

        wire, = _wires(self.compression(), [grad])
        return tf.as_dtype(wire) if wire else grad.dtype

    def _all_reduce(self, context, operation, grads: list, exact: list = ()) -> list:
        """`context.all_reduce(operation, grads + exact)`, float32 gradients in 16 bits when compressing.

        Summed in the wire type, cast back, then divided by the replicas for a mean: the
        division runs in float32. `exact` values (row counts) are never compressed; they are
        returned last. Records the bytes it hands the collective (`WIRE.trace`).
        """
        import tensorflow as tf

        exact = list(exact)
        wires = _wires(self.compression(), grads) + [None] * len(exact)
        sent = list(grads) + exact
        WIRE.trace("gradient all-reduce", _wire_bytes(sent, wires))
        if not any(wires):
            return context.all_reduce(operation, sent)
        sent = [tf.cast(value, wire) if wire else value for value, wire in zip(sent, wires)]
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
        reduced = [tf.cast(total, value.dtype) for total, value in zip(summed, list(grads) + exact)]
        if operation == tf.distribute.ReduceOp.MEAN:
            reduced = [total / tf.cast(context.num_replicas_in_sync, total.dtype) for total in reduced]
        return reduced

    def _sum_across_workers(self, distribution, tensors: list) -> list:
        """In the cross-replica context: each tensor (this worker's) summed over workers.

        One all-reduce (TF packs the list per dtype); float32 in 16 bits when compressing.
        With several local replicas the tensor rides on the first and the others send zeros.
        """
        import tensorflow as tf

        wires = _wires(self.compression(), tensors)
        nbytes = _wire_bytes(tensors, wires)
        sent = [on_first_replica(tf.cast(tensor, wire) if wire else tensor, distribution.extended.worker_devices)
                for tensor, wire in zip(tensors, wires)]
        summed = distribution.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(value, value) for value in sent])
        totals = [tf.cast(distribution.experimental_local_results(total)[0], tensor.dtype)
                  for total, tensor in zip(summed, tensors)]
        with tf.control_dependencies(totals):   # counted each time it runs (it runs every K-th step)
            tf.py_function(functools.partial(count_window_all_reduce, nbytes), [], [])
        return totals


def merge_call_in_cross_replica_context(original: Callable) -> Callable:
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
