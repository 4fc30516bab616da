"""Every private Keras (and TF) internal keras_mwms changes on TensorFlow, as one table.

Keras 3.15.1's TensorFlow trainer crashes under a multi-worker `tf.distribute` strategy (two
crashes, repaired by `_maybe_symbolic_build` and `_make_reduce_per_replica` below), weighs rows
unlike one process and clips partial gradients (`step.RowWeighting`), and needs the
equivalence wrappers around `fit` / `evaluate` / `predict` (`keras_mwms.backends.fit_call`, `fit_hooks.TensorFlowFitHooks`). Each is
a `Patch` row of `patch_table(backend)`: the strategy installs the table after the backend
joined, and `MultiWorkerMirroredStrategy.close()` restores every original.

Example (the rows, without installing anything):

>>> from types import SimpleNamespace as Backend
>>> from keras_mwms.backends.tensorflow.step import RowWeighting
>>> table = patch_table(Backend(strategy=object(), row_weighting=RowWeighting(None)))
>>> [row.name for row in table][:3]
['tf-symbolic-build-per-leaf', 'tf-reduce-per-replica-scalar-axis', 'tf-fit-wrapper']
>>> print(table.markdown().splitlines()[2])  # doctest: +ELLIPSIS
| `tf-symbolic-build-per-leaf` | `trainer._maybe_symbolic_build` | ...
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import keras

from keras_mwms import active
from keras_mwms.backends import batch_norm as core_batch_norm
from keras_mwms.backends import fit_call, policy
from keras_mwms.backends.keras_api import attributes, internals, targets
from keras_mwms.backends.patches import ANY_KERAS, Patch, PatchTable
from keras_mwms.backends.tensorflow import batch_norm, data, fit_hooks, layer_state, metric_extremes, step
from keras_mwms.diagnostics.ledger import counted_in_graph

# -- Keras 3.15.1 crash repairs (keras-team/keras#20585) ----------------------------------

def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Keras' `TensorFlowTrainer._maybe_symbolic_build`, building from one local replica's batch.

    keras-team/keras#20585, tensorflow/tensorflow#72388: Keras 3.15.1 calls
    `strategy.reduce("MEAN", whole_batch_tuple, axis=None)`; the collective strategy cannot
    reduce a nest (`ValueError: Attempt to convert a value (PerReplica...)`). The build only
    needs shapes and dtypes, so this takes this worker's first replica's batch, leaf by leaf,
    without any collective (or one from `data.batch_without_iterating`, which consumes nothing).
    """
    import tensorflow as tf

    if attributes.distribute_strategy(self) is None:
        return
    if iterator is not None:
        data_batch = data.batch_without_iterating(getattr(iterator, "data_adapter", None))
    if iterator is not None and data_batch is None:
        for _, _, batches in iterator:
            batch = next(batches)
            data_batch = keras.tree.map_structure(
                lambda leaf: self.distribute_strategy.experimental_local_results(leaf)[0]
                if isinstance(leaf, tf.distribute.DistributedValues) else leaf, batch)
            break
    with self.distribute_strategy.scope():
        attributes.symbolic_build(self, data_batch)


def _make_reduce_per_replica(original: Callable) -> Callable:
    """Keras' `reduce_per_replica`, reducing scalar logs with `axis=None` on multi-worker strategies.

    keras-team/keras#20585: for `MultiWorkerMirroredStrategy` Keras 3.15.1 reduces every log
    value with `strategy.reduce("MEAN", value, axis=0)`, which fails on the scalar loss and
    metrics (`Invalid reduction dimension 0 for input with 0 dimensions`); its `"sum"` branch
    omits the required `axis`. Rank-0 values are reduced across replicas only.
    """
    signature = inspect.signature(original)

    def rank(value):
        import tensorflow as tf

        if isinstance(value, tf.distribute.DistributedValues):
            value = value.values[0]
        return getattr(getattr(value, "shape", None), "rank", None)

    @functools.wraps(original)
    def reduce_per_replica(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        values, strategy = bound.arguments["values"], bound.arguments["strategy"]
        reduction = bound.arguments["reduction"]
        if reduction == "auto":
            reduction = bound.arguments["reduction"] = "mean"
        if reduction in ("mean", "sum") and internals.tf_collective_multi_worker(strategy):
            operation = reduction.upper()
            return keras.tree.map_structure(
                lambda value: strategy.reduce(operation, value,
                                              axis=None if rank(value) == 0 or operation == "SUM" else 0),
                values)
        return original(*bound.args, **bound.kwargs)

    return reduce_per_replica


def _counted_train_function(original: Callable) -> Callable:
    """Keras' `make_train_function`, its train function counted by the collective ledger.

    The step's all-reduces run inside one `tf.function`, out of Python's sight: each call is
    one in-graph ledger entry (`keras_mwms.diagnostics.ledger.counted_in_graph`).
    """
    @functools.wraps(original)
    def make_train_function(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        self.train_function = counted_in_graph(self.train_function)
        return self.train_function if result is not None else None

    return make_train_function


# -- BatchNormalization across workers (`batch_norm`) --------------------------------------

# Keras' moments replaced where a step spans several replicas (`backends/batch_norm.py`).
_global_batch_norm_moments = core_batch_norm.moments_replacement(
    in_step=lambda layer, backend: batch_norm.in_multi_replica_step(),
    global_moments=lambda backend, inputs, axes: batch_norm.global_moments(inputs, axes),
    per_worker=batch_norm.finite_when_empty)


def _shared_per_worker_statistics(original: Callable) -> Callable:
    """Keras' `BatchNormalization.call`; per-worker moments leave one set of moving statistics."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        backend = active.active_backend()
        values = signature.bind(self, *args, **kwargs).arguments
        if (backend is not None and values.get("training") and self.trainable
                and batch_norm.in_multi_replica_step()
                and not policy.global_batch_norm_moments(self, backend.options)):
            batch_norm.average_moving_statistics(self, values["inputs"])
        return outputs

    return call


# -- the table ----------------------------------------------------------------------------

_HOOKS = fit_hooks.TensorFlowFitHooks()


def _crash_repair_rows() -> list[Patch]:
    """The two rows without which Keras' own trainer crashes under a multi-worker `tf.distribute`."""
    return [
        Patch(name="tf-symbolic-build-per-leaf",
              target=targets.TF_MAYBE_SYMBOLIC_BUILD,
              replacement=lambda original: _maybe_symbolic_build,
              works_around="keras-team/keras#20585, tensorflow/tensorflow#72388: Keras reduces the "
                           "whole batch nest with strategy.reduce, which a collective strategy cannot",
              parameters=("iterator", "data_batch")),
        Patch(name="tf-reduce-per-replica-scalar-axis",
              target=targets.TF_REDUCE_PER_REPLICA,
              replacement=_make_reduce_per_replica,
              works_around="keras-team/keras#20585: multi-worker log reduction uses axis=0 on "
                           "scalars and omits the axis for 'sum'",
              parameters=("values", "strategy", "reduction")),
    ]


def crash_repairs() -> PatchTable:
    """The crash repairs alone, for Keras 3 with TensorFlow's own `MultiWorkerMirroredStrategy`
    (`Backend.crash_repairs`: the benchmark's native peer).

    Example:

    >>> [row.name for row in crash_repairs()]
    ['tf-symbolic-build-per-leaf', 'tf-reduce-per-replica-scalar-axis']
    """
    return PatchTable("tensorflow", _crash_repair_rows())


def _trainer_rows(backend: Any) -> list[Patch]:
    """The rows on the trainer: the crash repairs and the fit/evaluate/predict wrappers."""
    rows = _crash_repair_rows()
    rows += [Patch(name=f"tf-{method}-wrapper", target=target,
                   replacement=fit_call.replacement(method, _HOOKS),
                   works_around="Keras runs each worker's loop as if it were alone: progress bars, "
                                "shuffle order, uneven inputs, AutoShardPolicy.OFF lengths, XLA "
                                "on CPU, chief-only predict and lost peers need the whole job",
                   parameters=fit_call.PARAMETERS[method])
             for method, target in (("fit", targets.TRAINER_FIT), ("evaluate", targets.TRAINER_EVALUATE),
                                    ("predict", targets.TRAINER_PREDICT))]
    rows.append(Patch(name="tf-predict-on-batch-wrapper", target=targets.TRAINER_PREDICT_ON_BATCH,
                      replacement=fit_call.replacement("predict_on_batch", _HOOKS),
                      works_around="Keras runs predict_on_batch's whole batch on every replica and "
                                   "concatenates the copies: N × the rows on N workers",
                      parameters=fit_call.PARAMETERS["predict_on_batch"]))
    return rows


def _metric_rows(backend: Any) -> list[Patch]:
    """The rows that combine metric states by max or min (`metric_extremes`)."""
    return [
        Patch(name="tf-metric-extremes-first-replica",
              target=targets.TF_METRIC_ADD_VARIABLE,
              replacement=metric_extremes.first_replica_extremes(backend.strategy),
              works_around="tf.distribute sums a metric's state across replicas when read outside "
                           "a step (or averages it): a running maximum logs the sum of the maxima",
              parameters=("shape", "initializer", "dtype", "aggregation", "name")),
        Patch(name="tf-metric-extremes-combined",
              target=targets.TRAINER_GET_METRICS_RESULT,
              replacement=metric_extremes.combined_results(backend.strategy),
              works_around="inside a step each replica reads only its own metric state: a running "
                           "maximum must be the maximum over every replica's"),
    ]


def patch_table(backend: Any) -> PatchTable:
    """The TensorFlow backend's patch rows for `backend` (a joined `TensorFlowBackend`)."""
    weighting = backend.row_weighting
    rows = _trainer_rows(backend) + _metric_rows(backend) + [
        Patch(name="tf-row-weighted-steps", target=backend.strategy, attribute="run",
              replacement=weighting.run,
              works_around="each replica's loss is its local mean over replicas, so rows of an "
                           "unevenly split batch weigh differently than in one process",
              keras_versions=ANY_KERAS, parameters=("fn",)),
        Patch(name="tf-row-weighted-loss-scale",
              target=targets.SCALE_LOSS_FOR_DISTRIBUTION,
              replacement=weighting.scale_loss,
              works_around="Keras scales each replica's loss by 1/replicas, not by its row share",
              parameters=("value",)),
        Patch(name="tf-row-weighted-loss-unscale",
              target=targets.UNSCALE_LOSS_FOR_DISTRIBUTION,
              replacement=weighting.unscale_loss,
              works_around="the logged loss must undo the row-share scaling",
              parameters=("value",)),
        Patch(name="tf-aggregated-layer-state",
              target=targets.TF_VARIABLE_DIRECT_ASSIGN,
              replacement=layer_state.aggregated_state_assign(weighting),
              works_around="a layer's `aggregation=\"sum\"` variable assigned in a step (Keras' "
                           "assign_add is assign(self + value) too) sums every replica's new value, "
                           "old value included: a counter grows exponentially; \"mean\" weighs "
                           "replicas alike and takes an empty shard's NaN",
              parameters=("value",)),
        Patch(name="tf-merge-call-in-cross-replica-context",
              target="tensorflow:__internal__.distribute.interim.maybe_merge_call",
              replacement=step.merge_call_in_cross_replica_context,
              works_around="TF's maybe_merge_call fails in a cross-replica context, where Keras' "
                           "update runs after the one merge_call",
              parameters=("fn", "strategy")),
        Patch(name="tf-all-reduce-before-update",
              target=targets.TF_BACKEND_APPLY_GRADIENTS,
              replacement=weighting.apply_after_all_reduce,
              works_around="Keras clips and accumulates each replica's partial gradient before the "
                           "all-reduce, and its tf.cond around a merge_call fails in a replica context",
              parameters=("grads", "trainable_variables")),
        Patch(name="tf-loss-scale-after-all-reduce",
              target=targets.TF_LOSS_SCALE_APPLY,
              replacement=weighting.loss_scale_after_all_reduce,
              works_around="LossScaleOptimizer checks each replica's partial gradient for inf/NaN "
                           "and all-reduces inside a tf.cond: mixed_float16 hangs across workers "
                           "in the first step",
              parameters=("grads", "trainable_variables")),
        Patch(name="tf-generator-batches-copied",
              target=targets.GENERATOR_GET_TF_DATASET,
              replacement=data.copy_python_batches,
              works_around="TF wraps the NumPy batches a generator yields without copying and a "
                           "kernel may write into them: with several workers the user's arrays "
                           "(views yielded by the generator) were overwritten during fit"),
        Patch(name="tf-pydataset-read-by-index",
              target=targets.PY_DATASET_GET_TF_DATASET,
              replacement=data.pydataset_read_by_index,
              works_around="Keras reads a PyDataset through one Python generator per epoch in "
                           "TF's threads; a shuffled one sometimes trained the second epoch on "
                           "other batches than one process on 2 workers, and TF may write into the "
                           "batches it yields (copied where Keras' path stays)"),
        Patch(name="tf-pydataset-order-at-epoch-begin",
              target=targets.PY_DATASET_ON_EPOCH_BEGIN,
              replacement=data.pydataset_order_at_epoch_begin,
              works_around="the epoch's batch order of a PyDataset read by index, drawn on the "
                           "main thread with Python's random as Keras draws it"),
        Patch(name="tf-one-replica-plain-iterator",
              target=targets.TF_EPOCH_ITERATOR_INIT,
              replacement=data.feed_one_replica_undistributed(backend),
              works_around="one worker with one replica: Keras' distributed iterator costs Python "
                           "and a multi-device read every step for batches the plain tf.data "
                           "iterator gives unchanged",
              parameters=("distribute_strategy",)),
        Patch(name="tf-global-batch-norm-moments",
              target=targets.BATCH_NORM_MOMENTS,
              replacement=_global_batch_norm_moments,
              works_around="BatchNormalization normalizes each replica over its own shard (one "
                           "process normalizes over the whole batch), and synchronized=True costs "
                           "three all-reduces per layer: one all-reduce of [sum, sum of squares, rows]",
              parameters=("inputs", "mask")),
        Patch(name="tf-batch-norm-per-worker-statistics",
              target=targets.BATCH_NORM_CALL,
              replacement=_shared_per_worker_statistics,
              works_around="with per-worker moments (batch_norm_statistics='per_worker') each "
                           "worker keeps its own shard's moving statistics: they are averaged "
                           "across workers, weighted by rows",
              parameters=("inputs", "training")),
        Patch(name="tf-ledger-train-step",
              target=targets.TRAINER_MAKE_TRAIN_FUNCTION,
              replacement=_counted_train_function,
              works_around="the train step's collectives run inside one tf.function, invisible to "
                           "the collective ledger (keras_mwms.diagnostics): each call is counted "
                           "as one in-graph entry",
              parameters=("force",)),
    ]
    return PatchTable("tensorflow", rows)
