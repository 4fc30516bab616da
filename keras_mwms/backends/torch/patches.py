"""Keras' torch trainer made multi-worker: the private-Keras patches, one `PatchTable`.

Keras 3.15.1 has no distribution hooks on torch (keras-team/keras#18870 asks for them; the
DTensor DataParallel on Keras master is unreleased), so the rows below patch `TorchTrainer`,
`BatchNormalization`, the torch `Variable` and the optimizers. `PATCHES` (`patch_table(backend)`) is installed when the
strategy joins and uninstalled by `strategy.close()`. Models created outside
`strategy.scope()` are untouched: every wrapper asks `keras_mwms.backends.torch.state` for the
model's backend (the neutral tag of `keras_mwms.backends.model_scope`) (optimizers: for the model they train) and otherwise calls Keras' original.

What a model created in the scope gets:

* `fit` / `evaluate` inputs are sharded per worker from the *global* batches
  (`keras_mwms.backends.torch.data`); `predict` runs on the calling worker alone over all the
  rows it is given, entering no collective (a chief-only `predict` cannot hang); progress
  output on the chief only.
* the chief's variables and the distributed train/test steps (`keras_mwms.backends.torch.step`);
* global-batch gradients in `optimizer.apply` and losses weighted by rows in `scale_loss`
  (`keras_mwms.backends.torch.gradients`); the optimizer keeps its fast torch class; Keras'
  torch Adam/AdamW update reuses two scratch buffers (`keras_mwms.backends.torch.fused_adam`);
  its SGD update is one op in a compiled step's graph (`keras_mwms.backends.torch.compiled_sgd`);
  a compiled step on CPU recomputes ReLU-style masks in backward instead of saving them
  (`keras_mwms.backends.torch.compile_options`);
* global metric results (`keras_mwms.backends.torch.metrics`);
* under `jit_compile=True`, Keras 3.12-3.15's gradient-accumulation branch compiled once, not
  again at every micro-step (`torch-accumulation-cond-compiled`, for every model: only a name
  changes), and a warning when TorchDynamo's `recompile_limit` stops compiling the train step
  (`keras_mwms.backends.torch.recompile_limit`);
* BatchNormalization over the global batch (`synchronized=True`, and an ordinary layer unless
  `CommunicationOptions(batch_norm_statistics="per_worker")`).

Example:

>>> [row.name for row in PATCHES][:3]
['torch-fit-sharded-inputs', 'torch-evaluate-sharded-inputs', 'torch-predict-on-chief-output']
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from keras_mwms import active
from keras_mwms.backends import batch_norm, fit_call
from keras_mwms.backends.keras_api import targets
from keras_mwms.backends.patches import KerasHas, Patch, PatchTable
from keras_mwms.backends.torch import (
    compile_options,
    compiled_sgd,
    compiled_step,
    data,
    fused_adam,
    gradients,
    metrics,
    step,
)
from keras_mwms.backends.torch.state import STATE, backend_of, model_of

_NO_HOOKS = "Keras' torch trainer has no distribution hooks (keras-team/keras#18870)"


# -- TorchTrainer -------------------------------------------------------------------------
_HOOKS = data.TorchFitHooks()


def _distributed_step(prepare: Callable, wrap: Callable) -> Callable:
    """`make_train_function`/`make_test_function`: `prepare` first, then `wrap` Keras' step."""
    def replacement(original: Callable) -> Callable:
        @functools.wraps(original)
        def make_function(self, *args, **kwargs):
            backend = backend_of(self)
            if backend is not None:
                prepare(self, backend)
            result = original(self, *args, **kwargs)
            if backend is not None:
                wrap(self, backend)
            return result

        return make_function

    return replacement


def _wrap_train_function(model, backend) -> None:
    """A fresh compiled step gets keras_mwms' compile options, then becomes distributed."""
    compile_options.recompile(model)
    step.wrap_train_function(model, backend)


def _global_metric_results(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_metrics_result_or_logs(self, *args, **kwargs):
        backend = backend_of(self)
        if backend is None or not backend.distributed:
            return original(self, *args, **kwargs)
        logs = signature.bind(self, *args, **kwargs).arguments["logs"]
        state = STATE.of(self)
        summed, state.step_metric_sums = getattr(state, "step_metric_sums", None), None
        if logs is not None and logs is getattr(state, "global_logs", None):
            return logs    # a custom step's logs, made global when the step ended
        with metrics.GlobalMetrics(self, backend, summed):
            return metrics.materialized(original(self, *args, **kwargs))

    return _get_metrics_result_or_logs


# -- Keras' own torch distribution (Keras 3.16) --------------------------------------------
# From Keras 3.16 the torch trainer distributes by itself whenever `torch.distributed` is
# initialized: it wraps the model in DistributedDataParallel (`_initialize_ddp`) and sums every
# metric variable across processes in `get_metrics_result`. keras_mwms already does both (one
# row-weighted gradient all-reduce per step that also carries the metric states; min/max
# metrics reduced as such; uneven shards), so while a keras_mwms strategy is active Keras' path
# is off for every model: a model of the strategy's scope would otherwise issue its collectives
# twice, and any other model (a chief-only `evaluate`) would enter collectives its peers never
# join, where on Keras 3.12-3.15 it ran locally.
def _no_keras_ddp(original: Callable) -> Callable:
    @functools.wraps(original)
    def _initialize_ddp(self, *args, **kwargs):
        if active.active_backend() is None:
            return original(self, *args, **kwargs)
        return None

    return _initialize_ddp


def _local_metric_results(original: Callable) -> Callable:
    local = targets.BASE_TRAINER_GET_METRICS_RESULT.get()   # Keras' own, undistributed results

    @functools.wraps(original)
    def get_metrics_result(self, *args, **kwargs):
        if active.active_backend() is None:
            return original(self, *args, **kwargs)
        return local(self, *args, **kwargs)

    return get_metrics_result


# -- BatchNormalization, variables ----------------------------------------------------------
def _synchronized_batch_norm(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        synchronized = bound.arguments.get("synchronized", False)
        bound.arguments["synchronized"] = False
        original(*bound.args, **bound.kwargs)
        self.synchronized = synchronized

    # Keras' Operation.__new__ reads the signature (also through `inspect.getfullargspec`, which
    # ignores `__wrapped__`) to build get_config(): it must stay Keras' own.
    __init__.__signature__ = signature
    return __init__


# synchronized=True: global wherever the strategy is active (a custom loop too); an ordinary
# layer: inside a distributed train step, unless per-worker was chosen (`backends/batch_norm.py`).
_global_moments = batch_norm.moments_replacement(
    in_step=lambda layer, backend: layer.synchronized or (backend.in_train_step and backend.distributed),
    global_moments=gradients.synchronized_moments)


def _noted_variables(original: Callable) -> Callable:
    @functools.wraps(original)
    def _initialize(self, *args, **kwargs):
        original(self, *args, **kwargs)
        backend = active.active_backend()
        if backend is not None:
            backend.note_new_variable(self)

    return _initialize


# -- optimizers ---------------------------------------------------------------------------
def _loss_weighted_by_rows(original: Callable) -> Callable:
    @functools.wraps(original)
    def scale_loss(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        model = model_of(self)
        backend = backend_of(model) if model is not None else None
        if backend is None or not backend.distributed:
            return loss
        return step.weighted_loss(backend, self, loss)

    return scale_loss


def _averaged_gradients(original: Callable) -> Callable:
    # Keras' `apply(self, grads, trainable_variables=None)` (the rows' `parameters`), spelled
    # out: `inspect.signature(...).bind` is a graph break in a compiled step.
    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        model = model_of(self)
        backend = backend_of(model) if model is not None else None
        if backend is None or not backend.distributed:
            return original(self, grads, trainable_variables)
        averaged = gradients.average_gradients(backend, model, list(grads), trainable_variables)
        return original(self, averaged, trainable_variables)

    return apply


def _adam_without_temporaries(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _parallel_update_step(self, *args, **kwargs):
        model = model_of(self)
        if model is not None and not model.jit_compile:
            values = signature.bind(self, *args, **kwargs).arguments
            grads, variables = values["grads"], values["variables"]
            kernel = backend_of(model).options.torch_fused_adam
            if fused_adam.eligible(self, grads, variables, kernel):
                fused_adam.update(self, grads, variables, values["learning_rate"], kernel)
                state = STATE.of(self)
                state.fused_steps = getattr(state, "fused_steps", 0) + 1
                return None
        return original(self, *args, **kwargs)

    return _parallel_update_step


def _sgd_in_the_graph(original: Callable) -> Callable:
    # Keras' `_parallel_update_step(self, grads, variables, learning_rate)`, spelled out:
    # `inspect.signature(...).bind` is a graph break in a compiled step.
    @functools.wraps(original)
    def _parallel_update_step(self, grads, variables, learning_rate):
        if model_of(self) is not None and compiled_sgd.applies(self, learning_rate):
            return compiled_sgd.update(self, grads, variables, learning_rate)
        return original(self, grads, variables, learning_rate)

    return _parallel_update_step


def _cond_named_once(original: Callable) -> Callable:
    # Keras 3.12-3.15's `ops.cond` names a new `Cond` operation from Keras' process-wide name
    # counter on every call. In a compiled step TorchDynamo guards on that counter, so the
    # optimizer's gradient-accumulation branch compiled again at every micro-step until
    # `recompile_limit`, then ran eagerly. There the operation gets a fixed name: the same
    # `Cond`, the same branches, no counter to guard on.
    operation = targets.OPS_COND_OPERATION.get()

    @functools.wraps(original)
    def cond(pred, true_fn, false_fn):
        if torch.compiler.is_compiling():
            return operation(name="cond")(pred, true_fn, false_fn)
        return original(pred, true_fn, false_fn)

    return cond


def _train_step_in_one_graph(original: Callable) -> Callable:
    # Keras' `train_step(self, data)`, spelled out: `inspect.signature(...).bind` is a graph
    # break in a compiled step.
    @functools.wraps(original)
    def train_step(self, data):
        backend = backend_of(self)
        if backend is not None and compiled_step.in_use(backend):
            return compiled_step.train_step(self, data)
        return original(self, data)

    return train_step


# Keras' torch trainer distributes by itself (new in 3.16): DDP and all-reduced metric results.
_KERAS_DISTRIBUTES = KerasHas(targets.TORCH_INITIALIZE_DDP)
_ROWS = f"{_NO_HOOKS}: each worker's loss is weighted by its shard's rows"
_GRADIENTS = (f"{_NO_HOOKS}: the global-batch gradient (all-reduced, divided by the global rows) "
              "before Keras clips, unscales and applies it")

PATCHES = PatchTable("torch", [
    Patch("torch-fit-sharded-inputs", targets.TRAINER_FIT, fit_call.replacement("fit", _HOOKS),
          f"{_NO_HOOKS}: fit's global batches become this worker's shard; progress on the chief",
          parameters=fit_call.PARAMETERS["fit"]),
    Patch("torch-evaluate-sharded-inputs", targets.TRAINER_EVALUATE, fit_call.replacement("evaluate", _HOOKS),
          f"{_NO_HOOKS}: evaluate's global batches become this worker's shard",
          parameters=fit_call.PARAMETERS["evaluate"]),
    Patch("torch-predict-on-chief-output", targets.TRAINER_PREDICT, fit_call.replacement("predict", _HOOKS),
          "predict on every worker prints Keras' progress bar once per worker",
          parameters=fit_call.PARAMETERS["predict"]),
    Patch("torch-train-function", targets.TRAINER_MAKE_TRAIN_FUNCTION,
          _distributed_step(step.prepare_fit, _wrap_train_function),
          f"{_NO_HOOKS}: the chief's variables at every fit, the distributed train step "
          "(compiled on CPU with comparison masks recomputed in backward: "
          "keras_mwms.backends.torch.compile_options)"),
    Patch("torch-test-function", targets.TRAINER_MAKE_TEST_FUNCTION,
          _distributed_step(step.prepare_evaluate, step.wrap_test_function),
          f"{_NO_HOOKS}: the chief's variables before a first evaluate, the distributed test step"),
    Patch("torch-global-metric-results", targets.TRAINER_METRICS_RESULT_OR_LOGS,
          _global_metric_results, f"{_NO_HOOKS}: metric results of every worker's rows",
          parameters=("logs",)),
    Patch("torch-no-keras-ddp", targets.TORCH_INITIALIZE_DDP, _no_keras_ddp,
          "Keras 3.16 wraps the model in DistributedDataParallel whenever torch.distributed is "
          "initialized: a second gradient all-reduce per step on top of keras_mwms' (and "
          "collectives for models outside the scope)",
          applies=_KERAS_DISTRIBUTES),
    Patch("torch-no-keras-metric-all-reduce", targets.TRAINER_GET_METRICS_RESULT, _local_metric_results,
          "Keras 3.16 sums every metric variable across processes in get_metrics_result (one "
          "all-reduce per variable, per step, and min/max metrics summed; TorchDynamo fails in "
          "it under jit_compile=True): results come from this worker's states, made global by "
          "keras_mwms", applies=_KERAS_DISTRIBUTES),
    Patch("torch-synchronized-batchnorm", targets.BATCH_NORM_INIT, _synchronized_batch_norm,
          "Keras refuses BatchNormalization(synchronized=True) off TensorFlow (keras-team/keras#19118)",
          parameters=("synchronized",)),
    Patch("torch-synchronized-batchnorm-moments", targets.BATCH_NORM_MOMENTS, _global_moments,
          "synchronized BatchNormalization is TensorFlow-only in Keras (keras-team/keras#19118): "
          "the moments become global sums all-reduced across workers, differentiably (in a "
          "jit_compile=True step's graph when its gradient all-reduce is there)",
          parameters=("inputs", "mask")),
    Patch("torch-scope-variables", targets.VARIABLE_INITIALIZE,
          _noted_variables, "creating a Keras variable has no hook: variables created in "
          "strategy.scope() are noted so the scope's exit sends the chief's values",
          parameters=("value",)),
    Patch("torch-loss-weighted-by-rows", targets.BASE_OPTIMIZER_SCALE_LOSS,
          _loss_weighted_by_rows, _ROWS, parameters=("loss",)),
    Patch("torch-loss-scale-optimizer-rows",
          targets.LOSS_SCALE_SCALE_LOSS,
          _loss_weighted_by_rows, f"LossScaleOptimizer overrides scale_loss; {_ROWS} ÷ the "
          "fit's first global rows, so float16 values of the scaled backward are one process's",
          parameters=("loss",)),
    Patch("torch-gradient-all-reduce", targets.BASE_OPTIMIZER_APPLY,
          _averaged_gradients, _GRADIENTS, parameters=("grads", "trainable_variables")),
    Patch("torch-loss-scale-optimizer-all-reduce",
          targets.LOSS_SCALE_APPLY, _averaged_gradients,
          f"LossScaleOptimizer overrides apply; {_GRADIENTS}",
          parameters=("grads", "trainable_variables")),
    Patch("torch-multi-optimizer-all-reduce", targets.MULTI_OPTIMIZER_APPLY,
          _averaged_gradients, f"MultiOptimizer overrides apply; {_GRADIENTS}",
          parameters=("grads", "trainable_variables"), keras_versions=("3.15", "3.16"),
          applies=KerasHas(targets.MULTI_OPTIMIZER_APPLY)),   # new in Keras 3.15
    Patch("torch-adam-update",
          targets.TORCH_ADAM_UPDATE,
          _adam_without_temporaries,
          "Keras' torch Adam/AdamW allocates five model-sized temporaries per update (5.4 vs 1.9 "
          "ms on the benchmark MLP): the same operations into two reused buffers, bit-identical",
          parameters=("grads", "variables", "learning_rate")),
    Patch("torch-sgd-update",
          targets.TORCH_SGD_UPDATE,
          _sgd_in_the_graph,
          "Keras' torch SGD reads the learning rate as a Python number (`alpha=`), a graph break "
          "under jit_compile=True: the same eager update as one custom op in the graph, "
          "bit-identical",
          parameters=("grads", "variables", "learning_rate")),
    Patch("torch-accumulation-cond-compiled", targets.OPS_COND, _cond_named_once,
          "Keras' optimizer branches gradient accumulation with ops.cond, which names a new Cond "
          "from a process-wide counter on every call: under jit_compile=True TorchDynamo guards on "
          "the counter, compiles the branch again at every micro-step and runs it eagerly past its "
          "recompile_limit (8). In a compiled step the Cond gets a fixed name (Keras 3.16 calls "
          "the backend's cond directly)",
          parameters=("pred", "true_fn", "false_fn"), keras_versions=("3.12", "3.13", "3.14", "3.15")),
    Patch("torch-train-step-one-graph",
          targets.TRAINER_TRAIN_STEP,
          _train_step_in_one_graph,
          "Keras' torch train_step calls loss.backward(), which TorchDynamo cannot trace: a "
          "graph break under jit_compile=True between the forward pass and the all-reduce and "
          "update; the same step with torch.autograd.grad, traced, one graph",
          parameters=("data",)),
])


def patch_table(backend: Any) -> PatchTable:
    """The torch rows, the same table for every backend object of the process (`PATCHES`)."""
    return PATCHES
