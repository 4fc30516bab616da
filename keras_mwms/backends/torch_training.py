"""Keras' torch trainer, made multi-worker: the private patches, each named and guarded.

Keras 3.15.1 has no distribution hooks on torch (keras-team/keras#18870 asks for them; the
DTensor DataParallel on Keras master is unreleased), so `install()` patches `TorchTrainer`,
`BatchNormalization` and the optimizer instance of models created in `strategy.scope()`.
Models created outside the scope are untouched (every patch checks the model's tag).

What a tagged model gets (DESIGN.md §3):

* `fit` / `evaluate` inputs are sharded per worker from the *global* batches
  (`torch_data.shard_fit_inputs`); `predict` runs on the calling worker alone over all the rows
  it is given, entering no collective (a chief-only `predict` cannot hang).
* Variables created in `strategy.scope()` take the chief's values when the outermost scope is
  left (`TorchBackend.scope`), so `get_weights()` agrees right after building. At the start of
  every `fit` (and before a first `evaluate`) all model and optimizer variables are broadcast
  from the chief again, which also covers variables built lazily outside the scope and values
  set on one worker alone (`load_weights` on the chief).
* Each training step scales the loss by the worker's row count and, in `optimizer.apply`,
  all-reduces the gradients, the row count and unsynchronized BatchNormalization moving
  statistics in one bucketed flat all-reduce, then divides by the global row count: the exact
  global-batch gradient even for uneven or empty shards, seen averaged by clipping and loss
  scaling. The optimizer keeps its fast torch class (its class is swapped for a subclass);
  Keras' torch Adam/AdamW update reuses two scratch buffers on the CPU (`torch_fused_adam`:
  Keras' operations in Keras' order, bit-identical, 5.4 → 1.9 ms per update on the benchmark
  MLP); torch's fused Adam kernel, faster but rounding differently, is opt-in
  (`KERAS_MWMS_TORCH_FUSED_ADAM=1`).
  With Keras' own eager train step the gradient buckets start reducing during `backward()`
  (`torch_overlap`); `KERAS_MWMS_TORCH_OVERLAP=0` reduces them after it instead.
* A worker whose shard of a step is empty runs the step on one zero-weight dummy row so that
  every worker issues the same collectives; its metrics are left untouched.
* Metric state is reduced across workers (sum, or min/max) when results are computed: after
  every training step (the batch logs) and at the end of every epoch and of `evaluate`, so
  History and callbacks agree everywhere. In Keras' own eager train step the metrics are
  updated before backward and their states, the row counts and the BatchNormalization
  statistics ride in the last gradient bucket (`_StepExtras`): such a step issues the gradient
  all-reduce only. Otherwise (torch.compile'd or custom steps, min/max metric states) it costs
  small extra all-reduces.
* A custom `train_step`/`test_step` (Keras' "customizing what happens in fit()" guide) returns
  logs computed from its shard: they are made global at every step (`_global_logs`), so
  History, EarlyStopping and checkpoints agree on every worker. Metrics updated from `(y,
  y_pred)` equal one process; a metric the step updates once with a scalar (the guide's
  `metric.update_state(loss)`) averages the workers' values of each step, which equals one
  process when every worker holds rows of the step (a worker with an empty shard of a short
  last batch adds nothing, so that step weighs less). Its gradients, of its shard's mean loss,
  are weighted by rows: the global-batch gradient also on uneven splits.
* `BatchNormalization(synchronized=True)` computes global batch statistics.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch

from keras_mwms.backends import torch_fused_adam
from keras_mwms.backends.patches import require_tested_keras

if TYPE_CHECKING:
    from keras_mwms.backends.torch import TorchBackend

_TAG = "_keras_mwms_backend"
# Set to 0 to reduce gradients only after backward (no overlap with the backward pass).
OVERLAP_ENV = "KERAS_MWMS_TORCH_OVERLAP"
_installed_for: list = []


def install(backend: TorchBackend) -> None:
    """Installs every patch once per process; later strategies replace the active backend."""
    if _installed_for:
        _installed_for[0] = backend
        return
    _installed_for.append(backend)
    require_tested_keras("torch-trainer-multiworker")
    _patch_trainer()
    require_tested_keras("torch-synchronized-batchnorm")
    _patch_batch_normalization()
    require_tested_keras("torch-scope-variables")
    _patch_variable_creation()


def _patch_variable_creation() -> None:
    """Patch `torch-scope-variables`: note each new variable, so `scope()` agrees on it at exit.

    The value stays this worker's until then: creating a variable enters no collective, so a
    model built or loaded on one worker alone cannot hang (see `TorchBackend.scope`).
    """
    from keras.src.backend.torch.core import Variable

    original_initialize = Variable._initialize

    @functools.wraps(original_initialize)
    def _initialize(self, value):
        original_initialize(self, value)
        backend = active_backend()
        if backend is not None:
            backend.note_new_variable(self)

    Variable._initialize = _initialize


def active_backend() -> TorchBackend | None:
    return _installed_for[0] if _installed_for else None


def backend_of(model) -> TorchBackend | None:
    return getattr(model, _TAG, None)


# -- TorchTrainer -------------------------------------------------------------------------
def _patch_trainer() -> None:
    """Patch `torch-trainer-multiworker`: Keras' TorchTrainer has no distribution hooks."""
    from keras.src.backend.torch.trainer import TorchTrainer

    original_init = TorchTrainer.__init__
    original_fit = TorchTrainer.fit
    original_evaluate = TorchTrainer.evaluate
    original_predict = TorchTrainer.predict
    original_make_train = TorchTrainer.make_train_function
    original_make_test = TorchTrainer.make_test_function
    original_metrics_result = TorchTrainer._get_metrics_result_or_logs

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        backend = active_backend()
        if backend is not None and backend.in_scope:
            object.__setattr__(self, _TAG, backend)

    @functools.wraps(original_fit)
    def fit(self, *args, **kwargs):
        backend = backend_of(self)
        if backend is None:
            return original_fit(self, *args, **kwargs)
        from keras_mwms import strategy
        from keras_mwms.backends import torch_data

        facade = strategy.get_strategy()
        if facade is not None:
            facade.check_tf_config_unchanged()

        return original_fit(self, **_quiet_unless_chief(
            backend, torch_data.shard_fit_inputs(backend, args, kwargs)))

    @functools.wraps(original_evaluate)
    def evaluate(self, *args, **kwargs):
        backend = backend_of(self)
        if backend is None or kwargs.get("_use_cached_eval_dataset"):
            return original_evaluate(self, *args, **kwargs)
        from keras_mwms.backends import torch_data

        return original_evaluate(self, **_quiet_unless_chief(
            backend, torch_data.shard_evaluate_inputs(backend, args, kwargs)))

    @functools.wraps(original_predict)
    def predict(self, *args, **kwargs):
        backend = backend_of(self)
        if backend is None or backend.is_chief:
            return original_predict(self, *args, **kwargs)
        from keras_mwms.backends import torch_data

        return original_predict(self, **_quiet_unless_chief(
            backend, torch_data.bind_arguments(original_predict, args, kwargs)))

    @functools.wraps(original_make_train)
    def make_train_function(self, force=False):
        backend = backend_of(self)
        if backend is not None:
            _distribute_optimizer(self, backend)
            _broadcast_state(self, backend)
            # Layers may have changed since the last fit (trainable flags): re-collect.
            object.__setattr__(self, "_keras_mwms_batch_norm_statistics", None)
        result = original_make_train(self, force)
        if backend is not None and not getattr(self.train_function, "_keras_mwms", False):
            self.train_function = _distributed_train_function(self, backend, self.train_function)
        return result

    @functools.wraps(original_make_test)
    def make_test_function(self, force=False):
        backend = backend_of(self)
        if backend is not None and not getattr(self, "_keras_mwms_synced", False):
            _broadcast_state(self, backend)
        result = original_make_test(self, force)
        if backend is not None and not getattr(self.test_function, "_keras_mwms", False):
            self.test_function = _distributed_test_function(self, backend, self.test_function)
        return result

    @functools.wraps(original_metrics_result)
    def _get_metrics_result_or_logs(self, logs):
        backend = backend_of(self)
        if backend is None or not backend.distributed:
            return original_metrics_result(self, logs)
        summed = getattr(self, "_keras_mwms_step_metric_sums", None)
        object.__setattr__(self, "_keras_mwms_step_metric_sums", None)
        if logs is not None and logs is getattr(self, "_keras_mwms_global_logs", None):
            return logs    # a custom step's logs, made global when the step ended
        with global_metric_state(self, backend, summed):
            return original_metrics_result(self, logs)

    TorchTrainer.__init__ = __init__
    TorchTrainer.fit = fit
    TorchTrainer.evaluate = evaluate
    TorchTrainer.predict = predict
    TorchTrainer.make_train_function = make_train_function
    TorchTrainer.make_test_function = make_test_function
    TorchTrainer._get_metrics_result_or_logs = _get_metrics_result_or_logs


def _quiet_unless_chief(backend: TorchBackend, arguments: dict) -> dict:
    """Progress bars and epoch lines on the chief only (every worker's logs are the same)."""
    if not backend.is_chief:
        arguments["verbose"] = 0
    return arguments


def _broadcast_state(model, backend: TorchBackend) -> None:
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables += list(optimizer.variables)
    backend.broadcast_tensors([variable.value.data for variable in variables],
                              what="broadcast of the chief's variables")
    object.__setattr__(model, "_keras_mwms_synced", True)


def _first_dimension(batch) -> int:
    from keras.src import tree

    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    for leaf in tree.flatten(x):
        if leaf is not None and hasattr(leaf, "shape") and len(leaf.shape):
            return int(leaf.shape[0])
    return 0


def _dummy_row(batch):
    """One all-zero row shaped like `batch`, with zero sample weight where there is one."""
    from keras.src import tree

    def zero_row(leaf):
        if leaf is None or not hasattr(leaf, "shape"):
            return leaf
        tensor = torch.as_tensor(leaf)
        return torch.zeros((1,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)

    return tree.map_structure(zero_row, batch)


def _metric_snapshot(model) -> list[torch.Tensor]:
    return [variable.value.data.clone() for variable in model.metrics_variables]


def _metric_restore(model, snapshot) -> None:
    with torch.no_grad():
        for variable, saved in zip(model.metrics_variables, snapshot):
            variable.value.data.copy_(saved)


def _overlap_enabled(model) -> bool:
    """Overlap needs Keras' own eager train step: one backward, all trainable weights."""
    import os

    from keras.src.backend.torch.trainer import TorchTrainer

    if os.environ.get(OVERLAP_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return not model.jit_compile and type(model).train_step is TorchTrainer.train_step


def _metrics_first_applies(model) -> bool:
    """Whether Keras' default metric update can move before backward (`_train_step_metrics_first`)."""
    from keras.src.trainers.trainer import Trainer

    return type(model).compute_metrics is Trainer.compute_metrics and model.optimizer is not None


def _train_step_metrics_first(model, data, rows: int):
    """Keras' `TorchTrainer.train_step` with the metric update moved before `backward()`.

    Keras 3.15.1 updates the compiled metrics after the optimizer step, from the same
    predictions; their states are final earlier than that, once the forward pass is done. Updating
    them before backward lets their states ride in the last gradient bucket (`_StepExtras`), so
    the global batch logs need no all-reduce of their own. A worker whose shard of the step is
    empty (`rows == 0`, a dummy row) leaves its metrics untouched.
    """
    from keras.src import tree
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
    model.zero_grad()
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=True)
    if rows:
        model._loss_tracker.update_state(
            loss, sample_weight=next(i for i in tree.flatten(x) if i is not None).shape[0])
        if model._compile_metrics is not None:
            with torch.no_grad():
                model._compile_metrics.update_state(y, y_pred, sample_weight)
    loss = model.optimizer.scale_loss(loss)
    loss.backward()
    trainable_weights = model.trainable_weights[:]
    gradients = [variable.value.grad for variable in trainable_weights]
    with torch.no_grad():
        model.optimizer.apply(gradients, trainable_weights)


def _metric_variables(model) -> list:
    """(metric, variable) pairs of every metric state, in `global_metric_state`'s order."""
    return [(metric, variable) for metric in model.metrics for variable in metric.variables]


class _StepExtras:
    """The small values one overlapped step sums in its last gradient bucket.

    BatchNormalization moving statistics (weighted by rows), the step's loss weight and row
    count, and, when the metrics were updated before backward and every metric state is summed
    across workers, the metric states: the whole step then costs the gradient all-reduce only.
    """

    def __init__(self, model, backend: TorchBackend, rows: int, weights: list,
                 with_metrics: bool):
        self.model = model
        self.backend = backend
        self.rows = rows
        self.with_metrics = with_metrics
        self.statistics = _unsynchronized_batch_norm_statistics(model)
        self.metric_count = 0
        self.dtype = weights[0].value.dtype

    def __call__(self) -> list[torch.Tensor]:
        rows = float(self.rows)
        has_rows = rows > 0
        weight = rows if self.backend.loss_weighted_by_rows else float(has_rows)
        tensors = [variable.value.data * rows if has_rows else torch.zeros_like(variable.value.data)
                   for variable in self.statistics]
        tensors.append(torch.tensor([weight, rows], dtype=self.dtype))
        if self.with_metrics:
            pairs = _metric_variables(self.model)
            if all(metric_reduction(metric, variable) == "sum" for metric, variable in pairs):
                self.metric_count = len(pairs)
                tensors += [variable.value.data for _, variable in pairs]
        return tensors

    def consume(self, reduced: list[torch.Tensor]) -> torch.Tensor:
        """Applies the summed statistics, keeps the summed metric states; the total weight."""
        count = len(self.statistics)
        total_weight, total_rows = reduced[count][0], reduced[count][1]
        for variable, total in zip(self.statistics, reduced[:count]):
            variable.value.data.copy_(total / total_rows)
        if self.metric_count:
            object.__setattr__(self.model, "_keras_mwms_step_metric_sums",
                               list(reduced[count + 1:]))
        return total_weight


def _armed_reducer(model, backend: TorchBackend, rows: int, weights: list, extras=None):
    """The model's `OverlappedGradients`, re-planned when its trainable weights changed."""
    from keras_mwms.backends.torch_overlap import OverlappedGradients

    reducer = getattr(model, "_keras_mwms_overlap", None)
    if reducer is None or not reducer.covers(weights):
        if reducer is not None:
            reducer.close()
        reducer = OverlappedGradients(backend, [variable.value for variable in weights])
        object.__setattr__(model, "_keras_mwms_overlap", reducer)
    reducer.arm(rows, extras)
    return reducer


def _distributed_train_function(model, backend: TorchBackend, train_function):
    overlap = backend.distributed and _overlap_enabled(model)

    def distributed_train_function(data):
        batch = data[0]
        rows = _first_dimension(batch)
        backend.step_rows = rows
        object.__setattr__(model, "_keras_mwms_step_metric_sums", None)
        reducer = None
        metrics_first = False
        weights = model.trainable_weights if overlap else []
        if weights:
            metrics_first = _metrics_first_applies(model)
            reducer = _armed_reducer(model, backend, rows, weights,
                                     _StepExtras(model, backend, rows, weights, metrics_first))
            metrics_first = metrics_first and reducer.armed
        try:
            if metrics_first:
                _train_step_metrics_first(model, batch if rows else _dummy_row(batch), rows)
            elif rows:
                logs = train_function(data)
                local_results = _local_metric_results(model)
            else:
                # An empty shard (a short last global batch): run the step on a dummy row
                # weighted 0 so this worker issues the same collectives as the others, then
                # forget its metrics.
                snapshot = _metric_snapshot(model)
                try:
                    logs = train_function([_dummy_row(batch)])
                    local_results = _local_metric_results(model)
                finally:
                    _metric_restore(model, snapshot)
        finally:
            if reducer is not None:
                reducer.disarm()
        # Batch logs are global, as on TensorFlow: callbacks that stop training on a logged value
        # (TerminateOnNaN, a batch-level EarlyStopping) decide alike on every worker. Local logs
        # let one worker stop a step early and the others hang or abort in the next collective.
        if metrics_first:
            summed = getattr(model, "_keras_mwms_step_metric_sums", None)
            object.__setattr__(model, "_keras_mwms_step_metric_sums", None)
            if summed is not None:   # a diagnostic count, read by the tests
                object.__setattr__(model, "_keras_mwms_metric_rides",
                                   getattr(model, "_keras_mwms_metric_rides", 0) + 1)
            with global_metric_state(model, backend, summed):
                return model.get_metrics_result()
        return _global_logs(model, backend, logs, rows, local_results)

    distributed_train_function._keras_mwms = True
    return distributed_train_function


def _distributed_test_function(model, backend: TorchBackend, test_function):
    from keras.src.backend.torch.trainer import TorchTrainer

    keras_test_step = type(model).test_step is TorchTrainer.test_step

    def distributed_test_function(data):
        rows = _first_dimension(data[0])
        if keras_test_step:
            # Keras' logs are its metric results: made global once, when evaluate ends.
            return test_function(data) if rows else model.get_metrics_result()
        # A custom test_step's logs are made global at every step, like a custom train_step's.
        if rows:
            logs = test_function(data)
            local_results = _local_metric_results(model)
        else:
            snapshot = _metric_snapshot(model)
            try:
                logs = test_function([_dummy_row(data[0])])
                local_results = _local_metric_results(model)
            finally:
                _metric_restore(model, snapshot)
        return _global_logs(model, backend, logs, rows, local_results, metric_logs_now=False)

    distributed_test_function._keras_mwms = True
    return distributed_test_function


def _local_metric_results(model) -> dict:
    """`{metric.name: metric.result()}` of this worker's metric states, detached copies."""
    from keras.src import tree

    with torch.no_grad():
        return {metric.name: tree.map_structure(_detached, metric.result())
                for metric in model.metrics}


def _detached(value):
    return value.detach().clone() if torch.is_tensor(value) else value


def _numeric_leaves(value) -> list[torch.Tensor] | None:
    """The leaves of a log value as flat float64 tensors, or None if one is not a number."""
    from keras.src import tree

    leaves = []
    for leaf in tree.flatten(value):
        if leaf is None or isinstance(leaf, (str, bytes)):
            return None
        try:
            tensor = leaf.detach() if torch.is_tensor(leaf) else torch.as_tensor(leaf)
            leaves.append(tensor.to(torch.float64).reshape(-1))
        except (TypeError, ValueError, RuntimeError):
            return None
    return leaves


def _same_values(value, reference) -> bool:
    mine, theirs = _numeric_leaves(value), _numeric_leaves(reference)
    return (mine is not None and theirs is not None and len(mine) == len(theirs)
            and all(a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
                    for a, b in zip(mine, theirs)))


def _like(value: torch.Tensor, leaf) -> torch.Tensor:
    """`value` in the shape, floating dtype and device of the log leaf it replaces."""
    template = leaf if torch.is_tensor(leaf) else torch.as_tensor(leaf)
    dtype = template.dtype if template.is_floating_point() else torch.get_default_dtype()
    return value.reshape(template.shape).to(device=template.device, dtype=dtype)


def _global_logs(model, backend: TorchBackend, logs, rows: int, local_results: dict,
                 metric_logs_now: bool = True):
    """A training or test step's logs, identical on every worker and as one process logs them.

    Logs of Keras' own steps are the metric results: reduced as metric states (sum, min/max).
    A custom step (Keras' "customizing what happens in fit()" guides) returns what it likes,
    computed from this worker's shard: a value equal to a metric's local result under that
    metric's name (`{m.name: m.result() for m in self.metrics}`) becomes the metric's global
    result; any other number (the step's own loss, say) the mean over workers weighted by their
    rows, as one process would compute it on the global batch. Which is which is agreed in one
    small all-reduce, so every worker issues the same collectives whatever its values.
    Logs that are exactly the metric results are left to `_get_metrics_result_or_logs`: at
    once for a training step (`metric_logs_now`), when `evaluate` ends for a test step.
    """
    flat_keys = set()
    for name, result in local_results.items():
        flat_keys.update(result if isinstance(result, dict) else (name,))
    if not isinstance(logs, dict) or set(logs) == flat_keys:
        return model._get_metrics_result_or_logs(logs) if metric_logs_now else logs
    numeric = {key: leaves for key, value in logs.items()
               if (leaves := _numeric_leaves(value)) is not None}
    flags = [float(key in local_results and _same_values(logs[key], local_results[key]))
             for key in numeric]
    payload = [torch.tensor(flags + [float(rows)], dtype=torch.float64)]
    payload += [leaf * float(rows) for leaves in numeric.values() for leaf in leaves]
    reduced = backend.all_reduce_flat([tensor.to(backend.device) for tensor in payload],
                                      what="custom step log all-reduce")
    agreed, total_rows = reduced[0][:-1], float(reduced[0][-1])
    from_metrics = [key for key, count in zip(numeric, agreed.tolist())
                    if count == backend.num_workers]
    global_results = {}
    if from_metrics and total_rows != rows * backend.num_workers:
        _warn_custom_logs_on_uneven_rows(from_metrics)
    if from_metrics:
        with global_metric_state(model, backend):
            global_results = _local_metric_results(model)
    result, position = dict(logs), 1
    from keras.src import tree

    for key, leaves in numeric.items():
        sums = reduced[position:position + len(leaves)]
        position += len(leaves)
        if key in from_metrics:
            result[key] = global_results[key]
        elif total_rows > 0:
            means = [_like(total / total_rows, leaf)
                     for total, leaf in zip(sums, tree.flatten(logs[key]))]
            result[key] = tree.pack_sequence_as(logs[key], means)
    object.__setattr__(model, "_keras_mwms_global_logs", result)
    return result


_warned_custom_logs = [False]


def _warn_custom_logs_on_uneven_rows(keys) -> None:
    """Says once that a custom step's own trackers weigh workers, not rows, on uneven steps.

    A tracker a custom `train_step` updates once per step with its shard's value (the guide's
    `loss_tracker.update_state(loss)`) gets one update per worker; on a step whose global batch
    splits unevenly (a short last batch, a batch not divisible by the workers) one process
    would weigh the rows instead, so the logged value differs slightly from one process. The
    gradients are the global batch's either way.
    """
    if _warned_custom_logs[0]:
        return
    _warned_custom_logs[0] = True
    warnings.warn(
        f"keras_mwms (torch): a custom train_step/test_step logged {sorted(keys)} from trackers "
        "it updates once per step; on this step the workers held different numbers of rows, so "
        "these logs weigh each worker's value equally where one process would weigh rows (the "
        "weights are trained on the global batch all the same). For logs equal to one process, "
        "use a global batch divisible by the number of workers and a dataset size divisible by "
        "the global batch, or Keras' built-in train_step.", stacklevel=2)


# -- optimizer ----------------------------------------------------------------------------
def _distribute_optimizer(model, backend: TorchBackend) -> None:
    """Swaps the optimizer instance's class for a subclass that averages gradients first.

    Subclassing `keras.optimizers.Adam` statically would lose `TorchOptimizer.__new__`'s swap
    to the fast torch implementation (it maps exact classes only), so the subclass is made from
    whatever class the instance already has.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or getattr(optimizer, "_keras_mwms_model", None) is not None:
        return
    base = type(optimizer)

    def scale_loss(self, loss):
        loss = base.scale_loss(self, loss)
        if not backend.distributed:
            return loss
        backend.loss_weighted_by_rows = True
        return loss * float(backend.step_rows)

    def apply(self, grads, trainable_variables=None):
        if backend.distributed:
            grads = _average_gradients(backend, self._keras_mwms_model, list(grads),
                                       trainable_variables)
        return base.apply(self, grads, trainable_variables)

    methods = {"scale_loss": scale_loss, "apply": apply, "__module__": base.__module__,
               "__qualname__": base.__qualname__}
    if torch_fused_adam.applies_to(base):
        def _parallel_update_step(self, grads, variables, learning_rate):
            if not model.jit_compile and torch_fused_adam.eligible(self, grads, variables):
                torch_fused_adam.update(self, grads, variables, learning_rate)
                object.__setattr__(self, "_keras_mwms_fused_steps",
                                   getattr(self, "_keras_mwms_fused_steps", 0) + 1)
                return None
            return base._parallel_update_step(self, grads, variables, learning_rate)

        methods["_parallel_update_step"] = _parallel_update_step
    distributed = type(base.__name__, (base,), methods)
    optimizer.__class__ = distributed
    object.__setattr__(optimizer, "_keras_mwms_model", model)


def _unsynchronized_batch_norm_statistics(model) -> list:
    cached = getattr(model, "_keras_mwms_batch_norm_statistics", None)
    if cached is not None:
        return cached
    from keras.src.layers import BatchNormalization

    statistics = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, BatchNormalization) and layer.trainable and not layer.synchronized:
            statistics += [layer.moving_mean, layer.moving_variance]
    object.__setattr__(model, "_keras_mwms_batch_norm_statistics", statistics)
    return statistics


@torch._dynamo.disable
@torch.no_grad()
def _average_gradients(backend: TorchBackend, model, grads: list, variables=None) -> list:
    """Global-batch gradients: Σ_w (rows_w · grad_w) / Σ_w rows_w, in bucketed all-reduces.

    The loss was already multiplied by this worker's rows (`scale_loss`); a custom
    `train_step` that skips `scale_loss` (Keras' guides do) computed the mean loss of its
    shard, so its gradients are multiplied by the rows here: the same global-batch gradient,
    also when workers hold different numbers of rows. Unsynchronized BatchNormalization moving
    statistics ride along, weighted by rows, so they never drift. When the step's gradients were already being reduced during backward
    (`torch_overlap`), only the statistics and the row counts are left to reduce here.
    """
    has_rows = backend.step_rows > 0
    rows = float(backend.step_rows)
    weight = rows if backend.loss_weighted_by_rows else float(has_rows)
    statistics = _unsynchronized_batch_norm_statistics(model)
    reducer = getattr(model, "_keras_mwms_overlap", None)
    if reducer is not None and reducer.armed:
        # Always finish: its collectives are in flight on every worker.
        step_extras = reducer.extras
        summed, reduced_extras = reducer.finish()
        backend.loss_weighted_by_rows = False
        if variables is not None and reducer.covers(list(variables)):
            if isinstance(step_extras, _StepExtras):
                total_weight = step_extras.consume(reduced_extras)
                return [None if grad is None else total.div_(total_weight)
                        for grad, total in zip(grads, summed)]
            return _average_overlapped(backend, grads, summed, statistics, weight, rows)
    # A custom step's gradients are those of its shard's mean loss: weight them by the rows.
    row_scale = 1.0 if backend.loss_weighted_by_rows else rows
    weight = rows
    backend.loss_weighted_by_rows = False
    present = [i for i, grad in enumerate(grads) if grad is not None]
    payload = []
    for i in present:
        if not has_rows:
            payload.append(torch.zeros_like(grads[i]))
        else:
            payload.append(grads[i] if row_scale == 1.0 else grads[i] * row_scale)
    for variable in statistics:
        value = variable.value.data
        payload.append(value * rows if has_rows else torch.zeros_like(value))
    reference = grads[present[0]] if present else torch.zeros(())
    payload.append(torch.tensor([weight, rows], dtype=reference.dtype, device=reference.device))
    reduced = backend.all_reduce_flat(payload, what="gradient all-reduce")
    total_weight, total_rows = reduced[-1][0], reduced[-1][1]
    averaged = list(grads)
    for slot, i in enumerate(present):
        averaged[i] = reduced[slot].div_(total_weight)
    for offset, variable in enumerate(statistics):
        variable.value.data.copy_(reduced[len(present) + offset] / total_rows)
    return averaged


def _average_overlapped(backend: TorchBackend, grads: list, summed: list, statistics: list,
                        weight: float, rows: float) -> list:
    """Divides the gradients summed during backward by the global weight; syncs statistics."""
    has_rows = rows > 0
    payload = [variable.value.data * rows if has_rows else torch.zeros_like(variable.value.data)
               for variable in statistics]
    reference = summed[0] if summed else torch.zeros(())
    payload.append(torch.tensor([weight, rows], dtype=reference.dtype, device=reference.device))
    reduced = backend.all_reduce_flat(payload, what="gradient all-reduce")
    total_weight, total_rows = reduced[-1][0], reduced[-1][1]
    for offset, variable in enumerate(statistics):
        variable.value.data.copy_(reduced[offset] / total_rows)
    return [None if grad is None else total.div_(total_weight) for grad, total in zip(grads, summed)]


# -- metrics ------------------------------------------------------------------------------
_MAX_NAMES = ("max", "maximum")
_MIN_NAMES = ("min", "minimum")


def metric_reduction(metric, variable) -> str:
    """How a metric state variable combines across workers: "sum", "max", "min" or "first".

    A metric may declare `keras_mwms_reductions = {"variable_name": "max"}`; otherwise
    variables named max/min use max/min, `only_first_replica` ones come from the chief and
    everything else (totals, counts, confusion matrices) is summed.
    """
    declared = getattr(metric, "keras_mwms_reductions", {}) or {}
    name = variable.name.rsplit("/", 1)[-1]
    if name in declared:
        return declared[name]
    if name.lower() in _MAX_NAMES:
        return "max"
    if name.lower() in _MIN_NAMES:
        return "min"
    if getattr(variable, "aggregation", "sum") == "only_first_replica":
        return "first"
    return "sum"


class global_metric_state:
    """Context: metric state variables hold the global (all-worker) state, then local again.

    `summed`, when given, holds the global states already (summed in the step's last gradient
    bucket, `_StepExtras`): they are copied in without another all-reduce.
    """

    def __init__(self, model, backend: TorchBackend, summed=None):
        self.model = model
        self.backend = backend
        self.summed = summed

    def __enter__(self):
        pairs = _metric_variables(self.model)
        self.saved = [variable.value.data.clone() for _, variable in pairs]
        self.pairs = pairs
        if self.summed is not None and len(self.summed) == len(pairs):
            with torch.no_grad():
                for (_, variable), value in zip(pairs, self.summed):
                    variable.value.data.copy_(value)
            return self
        by_op: dict[str, list] = {}
        for metric, variable in pairs:
            by_op.setdefault(metric_reduction(metric, variable), []).append(variable)
        for op, variables in by_op.items():
            tensors = [variable.value.data for variable in variables]
            if op == "first":
                self.backend.broadcast_tensors(tensors, what="metric broadcast")
                continue
            reduced = self.backend.all_reduce_flat(tensors, op=op, what="metric all-reduce")
            with torch.no_grad():
                for tensor, value in zip(tensors, reduced):
                    tensor.copy_(value)
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for (_, variable), saved in zip(self.pairs, self.saved):
                variable.value.data.copy_(saved)
        return False


# -- BatchNormalization -------------------------------------------------------------------
def _patch_batch_normalization() -> None:
    """Patch `torch-synchronized-batchnorm`: Keras refuses `synchronized=True` off TensorFlow.

    Upstream: keras-team/keras#19118 (synchronized BatchNormalization is TF-only). Here the
    moments become global sums all-reduced across workers, differentiably.
    """
    from keras.src.layers import BatchNormalization

    original_init = BatchNormalization.__init__
    original_moments = BatchNormalization._moments

    # The exact 3.15.1 signature: Keras' Operation.__new__ reads it to build get_config().
    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones",
                 moving_mean_initializer="zeros", moving_variance_initializer="ones",
                 beta_regularizer=None, gamma_regularizer=None, beta_constraint=None,
                 gamma_constraint=None, renorm=False, renorm_clipping=None, renorm_momentum=0.99,
                 synchronized=False, **kwargs):
        original_init(self, axis, momentum, epsilon, center, scale, beta_initializer,
                      gamma_initializer, moving_mean_initializer, moving_variance_initializer,
                      beta_regularizer, gamma_regularizer, beta_constraint, gamma_constraint,
                      renorm, renorm_clipping, renorm_momentum, synchronized=False, **kwargs)
        self.synchronized = synchronized

    __init__.__doc__ = original_init.__doc__

    @functools.wraps(original_moments)
    def _moments(self, inputs, mask):
        backend = active_backend()
        if not self.synchronized or mask is not None or backend is None:
            return original_moments(self, inputs, mask)
        return synchronized_moments(backend, inputs, tuple(self._reduction_axes))

    BatchNormalization.__init__ = __init__
    BatchNormalization._moments = _moments


def synchronized_moments(backend: TorchBackend, inputs, axes):
    """Mean and variance over `axes` of the global batch (all workers), as `ops.moments`."""
    x = torch.as_tensor(inputs)
    compute_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    x = x.to(compute_dtype)
    weight = 1.0 if backend.step_rows > 0 else 0.0
    count = 1
    for axis in axes:
        count *= x.shape[axis]
    local_sum = torch.sum(x, dim=axes) * weight
    local_square_sum = torch.sum(x * x, dim=axes) * weight
    packed = torch.cat([local_sum.reshape(-1), local_square_sum.reshape(-1),
                        torch.tensor([count * weight], dtype=compute_dtype, device=x.device)])
    total = _differentiable_all_reduce(backend, packed)
    channels = local_sum.numel()
    global_count = total[-1]
    mean = (total[:channels] / global_count).reshape(local_sum.shape)
    variance = (total[channels:2 * channels] / global_count).reshape(local_sum.shape) - mean * mean
    return mean.to(inputs.dtype), variance.to(inputs.dtype)


@torch._dynamo.disable
def _differentiable_all_reduce(backend: TorchBackend, tensor):
    if not backend.distributed:
        return tensor
    from torch.distributed.nn import functional as distributed_functional

    with backend.guarded("synchronized BatchNormalization all-reduce"):
        return distributed_functional.all_reduce(tensor)
