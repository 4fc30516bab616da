"""Keras' torch train step as one compiled graph: backward through `torch.autograd.grad`.

Keras' `TorchTrainer.train_step` computes its gradients with `loss.backward()` and reads them
from `.grad`. TorchDynamo cannot trace `Tensor.backward()` ("Unsupported Tensor.backward()
call", torch 2.13): the compiled step of `jit_compile=True` splits there, in plain Keras too,
so the forward pass and the gradient all-reduce plus the optimizer update are two graphs with
eager Python between them. Dynamo's `trace_autograd_ops=True` traces `backward()` by rewriting
it into `autograd.grad` over the leaves it found, which fails on Keras models ("attempting to
assign a gradient of size '[10]' to a tensor of size '[64, 10]'": the gradients land on the
wrong weights) and would also apply to custom train steps; it stays off there.

`train_step` is Keras' step operation for operation with `torch.autograd.grad(loss, weights)`
in place of `loss.backward()` and the `.grad` reads, traced with `trace_autograd_ops=True`
(`tracing`): forward, backward, the in-graph gradient all-reduce
(`keras_mwms.backends.torch.gradients.averaged_in_graph`) and Keras' update
(`keras_mwms.backends.torch.compiled_sgd` for SGD) are one graph, no break. The gradients are
those `backward()` stores (weights the loss does not reach get `None`, as from `.grad`); they
are not left in `.grad`, which Keras' step clears at its next step anyway.

Used (the `torch-train-step-one-graph` row of `keras_mwms.backends.torch.patches`) for models
created in `strategy.scope()` with `jit_compile=True`, Keras' own `train_step` and an
optimizer, whose whole step can trace (`applies`): not while the gradients are all-reduced
eagerly (accumulation, a LossScaleOptimizer, per-worker BatchNormalization statistics, see
`gradients.in_graph_applies`). Those keep Keras' `loss.backward()`; a graph break after
`autograd.grad` would anyway make Dynamo restart with a break at `autograd.grad`. A
BatchNormalization layer's global moments are summed in the graph too, differentiably
(`gradients.synchronized_moments`): their backward all-reduce is traced with the step's backward.

Example (no strategy: Keras' own step):

>>> applies(None, None)
False
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from keras_mwms.backends import policy
from keras_mwms.backends.keras_api import attributes, internals
from keras_mwms.backends.torch.state import STATE

if TYPE_CHECKING:
    from keras_mwms.backends.torch.engine import TorchEngine


def applies(model, backend: TorchEngine | None) -> bool:
    """Whether `model`'s compiled step runs as one graph (`train_step`); decided outside the
    graph, before each step (`step.py` sets `backend.backward_in_graph`)."""
    if model is None or backend is None:
        return False
    optimizer = getattr(model, "optimizer", None)
    return (model.jit_compile is True and internals.keras_own_train_step(model) and optimizer is not None
            and (backend.gradients_in_graph if backend.distributed else _plain(optimizer))
            and _traceable(model))


def _plain(optimizer) -> bool:
    """One process: what `gradients.in_graph_applies` asks of a gang's optimizer (no
    LossScaleOptimizer, no accumulation), so one process and a gang take the same path."""
    from keras.optimizers import LossScaleOptimizer

    return not isinstance(optimizer, LossScaleOptimizer) and not policy.accumulation_steps(optimizer)


def _traceable(model) -> bool:
    """Whether the model has trainable weights (`autograd.grad` needs one). Decided once per
    `fit` (`step.prepare_fit` forgets it: layers may change)."""
    cached = STATE.get(model, "one_graph_traceable")
    if cached is None:
        cached = bool(model.trainable_weights)
        STATE.of(model).one_graph_traceable = cached
    return cached


def in_use(backend: TorchEngine) -> bool:
    """Whether Keras' `train_step` being traced now is to be `train_step` (the patch row)."""
    return backend.backward_in_graph and torch.compiler.is_compiling()


def tracing(one_graph: bool):
    """Context of a step call: Dynamo traces `torch.autograd.grad` while `one_graph`."""
    if not one_graph:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(trace_autograd_ops=True)


def train_step(model, data):
    """Keras 3.15.1's `TorchTrainer.train_step` with `torch.autograd.grad` for `backward()`."""
    from keras import tree, utils  # public names: resolving a private one would not trace

    x, y, sample_weight = utils.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=True) if attributes.call_has_training_arg(model) else model(x)
    model.zero_grad()
    loss = attributes.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    attributes.loss_tracker(model).update_state(
        loss, sample_weight=next(i for i in tree.flatten(x) if i is not None).shape[0])
    loss = model.optimizer.scale_loss(loss)
    trainable_weights = model.trainable_weights[:]
    gradients = torch.autograd.grad(loss, [variable.value for variable in trainable_weights],
                                    allow_unused=True)
    with torch.no_grad():
        model.optimizer.apply(list(gradients), trainable_weights)
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
