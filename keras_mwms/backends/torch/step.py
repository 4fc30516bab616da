"""The distributed train and test steps of models created in `strategy.scope()` on torch.

* At the start of every `fit` (and before a first `evaluate`) all model and optimizer
  variables are broadcast from the chief (`prepare_fit`), which also covers variables built
  lazily outside the scope and values set on one worker alone (`load_weights` on the chief).
* Keras' step function is wrapped (`wrap_train_function`, `wrap_test_function`): the step's
  rows are recorded for the loss scaling and the gradient all-reduce
  (`keras_mwms.backends.torch.gradients`); with Keras' own eager train step the gradient
  buckets start reducing during `backward()` (`keras_mwms.backends.torch.overlap`, switched by
  `CommunicationOptions.torch_overlap`), and the compiled metrics are updated before backward
  so their states ride in the last gradient bucket (`train_step_metrics_first`).
* A worker whose shard of a step is empty runs the step on one zero-weight dummy row
  (`keras_mwms.backends.policy.dummy_row`) so that every worker issues the same collectives;
  its metrics are left untouched.
* Batch logs are global, as on TensorFlow (`keras_mwms.backends.torch.metrics`): callbacks that
  stop training on a logged value decide alike on every worker.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from keras_mwms.backends import layer_state, policy
from keras_mwms.backends.compression import WIRE
from keras_mwms.backends.keras_api import attributes, internals
from keras_mwms.backends.torch import accumulation, compiled_step, gradients, metrics, recompile_limit
from keras_mwms.backends.torch.overlap import OverlappedGradients
from keras_mwms.backends.torch.state import STATE, model_of
from keras_mwms.diagnostics import LEDGER

if TYPE_CHECKING:
    from keras_mwms.backends.torch.engine import TorchEngine


# -- at fit / evaluate ----------------------------------------------------------------------
def prepare_fit(model, backend: TorchEngine) -> None:
    """Before `fit` builds its step: the optimizers learn their model, the chief's state is sent."""
    optimizer = getattr(model, "optimizer", None)
    for owned in owned_optimizers(model):
        if model_of(owned) is None:
            STATE.of(owned).model = weakref.ref(model)
    # A window of gradient accumulation left open by the last fit goes on as in one process.
    accumulation.settle_window(backend, optimizer, lambda: broadcast_state(model, backend))
    # Layers may have changed since the last fit (trainable flags): re-collect.
    state = STATE.of(model)
    state.batch_norm_statistics = state.in_graph_wire_bytes = state.one_graph_traceable = None
    state.summed_layer_state = layer_state.aggregated_state(model)[0]
    backend.rows.begin_fit()     # a LossScaleOptimizer's unit: this fit's first global rows


def owned_optimizers(model) -> list:
    """The optimizers `model` holds: its `optimizer`, and any other an attribute holds (keras.io's
    GAN recipe: `compile(d_optimizer=..., g_optimizer=...)` keeps them as `self.d_optimizer`, ...),
    so that every `apply` of a custom `train_step` all-reduces its gradients.

    Example:

    >>> import keras
    >>> class Model:
    ...     pass
    >>> model = Model()
    >>> model.optimizer, model.d_optimizer, model.rate = keras.optimizers.SGD(), keras.optimizers.Adam(), 0.1
    >>> [type(optimizer).__name__ for optimizer in owned_optimizers(model)]
    ['SGD', 'Adam']
    """
    from keras.optimizers import Optimizer

    found = {}
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        if isinstance(value, Optimizer):
            found.setdefault(id(value), value)
    return list(found.values())


def prepare_evaluate(model, backend: TorchEngine) -> None:
    """Before a first `evaluate` of a model never fitted here: the chief's state is sent."""
    if not STATE.get(model, "synced", False):
        broadcast_state(model, backend)


def broadcast_state(model, backend: TorchEngine) -> None:
    """The chief's model and (built) optimizer variables on every worker."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables += list(optimizer.variables)
    backend.broadcast_tensors([variable.value.data for variable in variables],
                              what="broadcast of the chief's variables")
    STATE.of(model).synced = True


def step_rows(batch) -> int:
    """Rows of a step's batch: the leading dimension of its inputs.

    Example:

    >>> step_rows((torch.zeros(5, 2), torch.zeros(5)))
    5
    """
    return policy.rows_of(batch[0] if isinstance(batch, (tuple, list)) else batch)


def weighted_loss(backend: TorchEngine, optimizer, loss):
    """`loss` times this worker's rows (÷ K under a LossScaleOptimizer), the weight recorded
    for the gradient all-reduce (`StepRows.weigh_loss`, `gradients.averaged_over_workers`)."""
    from keras.optimizers import LossScaleOptimizer

    def global_sum(rows: float) -> float:
        return float(backend.all_reduce(np.array([rows], np.float64), "sum")[0])

    return loss * backend.rows.weigh_loss(isinstance(optimizer, LossScaleOptimizer), global_sum)


def add_every_workers_change(backend: TorchEngine, variables: list, before: list, has_rows: bool) -> None:
    """A layer's `aggregation="sum"` state after a step: its value before plus every worker's
    change (one all-reduce of the changes; `keras_mwms.backends.layer_state`). A worker with no
    rows in the step stepped on a dummy row: its change is none."""
    changes = [variable.value.detach() - old if has_rows else torch.zeros_like(old)
               for variable, old in zip(variables, before)]
    totals = backend.all_reduce_flat(changes, "sum", what="layer state all-reduce")
    for variable, old, total in zip(variables, before, totals):
        variable.value.data.copy_(old + total)


def dummy_row(batch) -> Any:
    """One all-zero row shaped like `batch` (sample weights included: they become 0).

    Example:

    >>> [tuple(leaf.shape) for leaf in dummy_row((torch.zeros(0, 3), np.zeros((0,), "int64")))]
    [(1, 3), (1,)]
    """
    device = next((leaf.device for leaf in _leaves(batch) if torch.is_tensor(leaf)), None)

    def zeros(shape, dtype):
        if not isinstance(dtype, torch.dtype):
            dtype = torch.from_numpy(np.zeros(0, dtype)).dtype
        return torch.zeros(shape, dtype=dtype, device=device)

    return policy.dummy_row(batch, zeros)


def _leaves(nest) -> list:
    found: list = []
    policy.map_nest(found.append, nest)
    return found


# -- the train step -------------------------------------------------------------------------
def overlap_enabled(model, backend: TorchEngine) -> bool:
    """Overlap needs Keras' own eager train step: one backward, all trainable weights."""
    if not backend.options.torch_overlap:
        return False
    if policy.accumulation_steps(getattr(model, "optimizer", None)):
        return False   # micro-steps reduce no gradients (`keras_mwms.backends.torch.accumulation`)
    return not model.jit_compile and internals.keras_own_train_step(model)


def keras_train_step(model) -> bool:
    """Whether `model` trains with Keras' own torch `train_step`."""
    return internals.keras_own_train_step(model)


def metrics_first_applies(model) -> bool:
    """Whether Keras' default metric update can move before backward (`train_step_metrics_first`)."""
    return internals.keras_own_compute_metrics(model) and model.optimizer is not None


def train_step_metrics_first(model, data, rows: int) -> None:
    """Keras' `TorchTrainer.train_step` with the metric update moved before `backward()`.

    Keras 3.15.1 updates the compiled metrics after the optimizer step, from the same
    predictions; their states are final earlier than that, once the forward pass is done. Updating
    them before backward lets their states ride in the last gradient bucket
    (`gradients.StepExtras`), so the global batch logs need no all-reduce of their own. A worker
    whose shard of the step is empty (`rows == 0`, a dummy row) leaves its metrics untouched.
    """
    from keras import tree
    x, y, sample_weight = internals.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=True) if attributes.call_has_training_arg(model) else model(x)
    model.zero_grad()
    # Keras' compute_loss also updates the per-output loss trackers (`out1_loss`): a dummy
    # row's update is forgotten, as every other metric's.
    snapshot = None if rows else metrics.metric_snapshot(model)
    loss = attributes.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    if snapshot is not None:
        metrics.metric_restore(model, snapshot)
    if rows:
        attributes.loss_tracker(model).update_state(
            loss, sample_weight=next(i for i in tree.flatten(x) if i is not None).shape[0])
        compiled_metrics = attributes.compile_metrics(model)
        if compiled_metrics is not None:
            with torch.no_grad():
                compiled_metrics.update_state(y, y_pred, sample_weight)
    loss = model.optimizer.scale_loss(loss)
    loss.backward()
    trainable_weights = model.trainable_weights[:]
    step_gradients = [variable.value.grad for variable in trainable_weights]
    with torch.no_grad():
        model.optimizer.apply(step_gradients, trainable_weights)


def armed_reducer(model, backend: TorchEngine, rows: int, weights: list, extras: gradients.StepExtras):
    """The model's `OverlappedGradients`, re-planned when its trainable weights changed, armed
    with the step's extras (their sums give the step's global weight: `StepExtras.consume`)."""
    reducer = STATE.get(model, "overlap")
    if reducer is None or not reducer.covers(weights):
        if reducer is not None:
            reducer.close()
        reducer = OverlappedGradients(backend, [variable.value for variable in weights])
        STATE.of(model).overlap = reducer
    reducer.arm(rows, extras)
    return reducer


def wrap_train_function(model, backend: TorchEngine) -> None:
    """Replaces the model's fresh Keras train function by the distributed one (once)."""
    if model.train_function is not None and model.train_function is not STATE.get(model, "train_function"):
        if model.jit_compile:   # TorchDynamo's recompile_limit, said once (`recompile_limit`)
            recompile_limit.watch()
        model.train_function = _distributed_train_function(model, backend, model.train_function)
        STATE.of(model).train_function = model.train_function


def wrap_test_function(model, backend: TorchEngine) -> None:
    """Replaces the model's fresh Keras test function by the distributed one (once)."""
    if model.test_function is not None and model.test_function is not STATE.get(model, "test_function"):
        model.test_function = _distributed_test_function(model, backend, model.test_function)
        STATE.of(model).test_function = model.test_function


def _run_step(model, step_function, data, rows: int) -> tuple[Any, dict]:
    """Keras' step on `data`: its logs and this worker's metric results.

    An empty shard (a short last global batch) runs the step on a dummy row weighted 0, so this
    worker issues the same collectives as the others, and then forgets its metric updates.
    """
    if rows:
        logs = step_function(data)
        return logs, metrics.local_metric_results(model)
    snapshot = metrics.metric_snapshot(model)
    try:
        logs = step_function([dummy_row(data[0])])
        return logs, metrics.local_metric_results(model)
    finally:
        metrics.metric_restore(model, snapshot)


def _distributed_train_function(model, backend: TorchEngine, train_function):
    overlap = backend.distributed and overlap_enabled(model, backend)
    # Accumulating micro-steps: the metric states ride in the micro-step's row all-reduce.
    accumulating = (backend.distributed and bool(policy.accumulation_steps(model.optimizer))
                    and not model.jit_compile and keras_train_step(model) and metrics_first_applies(model))

    def distributed_train_function(data):
        backend.in_train_step = True
        # Decided before each step, outside any graph, for one worker and a gang alike: the
        # all-reduce in the compiled graph (a gang only), and the step as one graph
        # (`compiled_step.applies`: one process takes it where a gang would).
        backend.gradients_in_graph = gradients.in_graph_applies(model, backend)
        if backend.gradients_in_graph:   # cached out here: the graph only reads it
            gradients.unsynchronized_batch_norm_statistics(model, backend)
        backend.backward_in_graph = compiled_step.applies(model, backend)
        try:
            with LEDGER.train_step(), compiled_step.tracing(backend.backward_in_graph):
                return train_on(data)
        finally:
            backend.in_train_step = False

    def train_on(data):
        batch = data[0]
        rows = step_rows(batch)
        backend.rows.begin(rows)
        if not backend.distributed:
            # One worker: Keras' logs are already the global ones, and its shard is never empty.
            return train_function(data)
        STATE.of(model).step_metric_sums = None
        reducer = None
        metrics_first = False
        weights = model.trainable_weights if overlap else []
        if weights:
            metrics_first = metrics_first_applies(model)
            reducer = armed_reducer(model, backend, rows, weights,
                                    gradients.StepExtras(model, backend, rows, weights, metrics_first))
            metrics_first = metrics_first and reducer.armed
        elif accumulating:
            metrics_first = STATE.of(model).metrics_ride_accumulation = True
        summed = STATE.get(model, "summed_layer_state") or []
        before = [variable.value.detach().clone() for variable in summed]
        try:
            if metrics_first:
                train_step_metrics_first(model, batch if rows else dummy_row(batch), rows)
            elif backend.gradients_in_graph:   # its all-reduce runs inside the compiled graph: guard it
                with backend.guarded("gradient all-reduce"):
                    logs, local_results = _run_step(model, train_function, data, rows)
                WIRE.add(gradients.in_graph_wire_bytes(backend, model))
            else:
                logs, local_results = _run_step(model, train_function, data, rows)
        finally:
            if reducer is not None:
                reducer.disarm()
        if summed:
            add_every_workers_change(backend, summed, before, has_rows=bool(rows))
        # Batch logs are global, as on TensorFlow: callbacks that stop training on a logged value
        # (TerminateOnNaN, a batch-level EarlyStopping) decide alike on every worker. Local logs
        # let one worker stop a step early and the others hang or abort in the next collective.
        if metrics_first:
            state = STATE.of(model)
            summed, state.step_metric_sums = state.step_metric_sums, None
            if summed is not None:   # a diagnostic count (`state.diagnostics`)
                state.metric_rides = getattr(state, "metric_rides", 0) + 1
            with metrics.GlobalMetrics(model, backend, summed):
                return metrics.materialized(model.get_metrics_result())
        return metrics.global_logs(model, backend, logs, rows, local_results)

    return distributed_train_function


def _distributed_test_function(model, backend: TorchEngine, test_function):
    keras_test_step = internals.keras_own_test_step(model)

    def distributed_test_function(data):
        rows = step_rows(data[0])
        if keras_test_step:
            # Keras' logs are its metric results: made global once, when evaluate ends.
            return test_function(data) if rows else model.get_metrics_result()
        # A custom test_step's logs are made global at every step, like a custom train_step's.
        logs, local_results = _run_step(model, test_function, data, rows)
        return metrics.global_logs(model, backend, logs, rows, local_results, metric_logs_now=False)

    return distributed_test_function
