"""TensorFlow's part of `fit` / `evaluate` / `predict` / `predict_on_batch`: `TensorFlowFitHooks`.

The policy of a call (who trains the model, the TF_CONFIG check, chief-only progress, the row
checks, validation_split and class weights, a resumable fit's ordered stream, the
workers-agree check) is `keras_mwms.backends.fit_call`'s, the same on every backend. What
TensorFlow does differently, installed as rows of `keras_mwms.backends.tensorflow.patches`:

* Keras' shuffles draw the chief's order on every worker (`align_shuffle_seed`: TF's global
  seed and Python's `random`);
* a resumable fit's ordered stream is fed as tf.data (`data.stream_dataset`), a PyDataset is
  read by index (`data.read_pydataset_by_index`);
* `AutoShardPolicy.OFF` datasets run their full length (`data.distribute_unsharded_dataset`);
* `jit_compile=True` on CPU workers trains unjitted (TF's XLA has no CPU collectives);
* `predict` runs on each worker alone, so a chief-only `predict` cannot hang the peers, and so
  does `predict_on_batch` (Keras concatenated every replica's copy of the whole batch: N × the
  rows on N workers);
* fit/evaluate steps are row-weighted (`step.RowWeighting.keras_loop`), and TF's
  lost-peer errors become `keras_mwms.WorkerLostError` naming the lost workers.

Example (what the patch table does with Keras' `fit`):

>>> import inspect
>>> def fit(self, x=None, y=None, verbose="auto"):
...     return verbose
>>> wrapped = fit_call.replacement("fit", TensorFlowFitHooks())(fit)
>>> inspect.signature(wrapped) == inspect.signature(fit)   # Keras' signature, for users and tools
True
"""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any

import numpy as np

from keras_mwms import active
from keras_mwms.backends import fit_call
from keras_mwms.backends.keras_api import attributes
from keras_mwms.backends.patches import ObjectState
from keras_mwms.backends.tensorflow import data
from keras_mwms.resume import resumable_inputs

_local_predict_functions = ObjectState()   # model -> its predict function without the strategy
active.register(__name__, "_local_predict_functions", reset=_local_predict_functions.clear,
                state=_local_predict_functions.__len__)


class TensorFlowFitHooks(fit_call.FitHooks):
    """TensorFlow's part of a `fit`/`evaluate`/`predict`/`predict_on_batch` call (see the module doc)."""

    def align_shuffles(self, call: fit_call.FitCall) -> None:
        import tensorflow as tf

        if call.arguments["shuffle"] and not isinstance(call.arguments["x"], tf.data.Dataset):
            # Also on one worker, so that N workers and one process draw the same permutation.
            align_shuffle_seed(call.backend)

    def feed(self, call: fit_call.FitCall) -> None:
        backend, model, arguments = call.backend, call.model, call.arguments
        if call.method == "fit":
            fit_input = resumable_inputs.active_for(model)
            if fit_input is not None and fit_input.stream is not None:
                arguments["x"] = data.stream_dataset(fit_input.stream)
            data.read_pydataset_by_index(arguments)
        if backend.num_workers == 1:
            return
        if model.jit_compile and backend.gpu_count == 0:
            _compile_without_xla(model)
        if getattr(model, "steps_per_execution", 1) > 1:
            raise NotImplementedError(
                f"{call.where} with steps_per_execution={model.steps_per_execution} is not "
                "supported on a multi-worker TensorFlow strategy with Keras 3.15: Keras' multi-step "
                "loop puts collectives inside tf.cond/tf.while_loop, which fails with 'You must feed "
                "a value for placeholder tensor'. Compile with steps_per_execution=1.")
        if call.method in ("fit", "evaluate") and fit_call.shard_policy_is_off(arguments["x"]):
            # AutoShardPolicy.OFF: each worker's dataset is its own data, run at its full length.
            arguments["x"] = data.distribute_unsharded_dataset(backend, arguments["x"], call.where)

    def loop(self, call: fit_call.FitCall) -> contextlib.AbstractContextManager:
        return call.backend.row_weighting.keras_loop(call.model)

    def predict(self, call: fit_call.FitCall) -> Any:
        # predict enters no collective, so one worker may call it alone; predict_on_batch
        # under the strategy runs the whole batch on every replica and concatenates the copies.
        backend = call.backend
        if ((call.method == "predict" and backend.num_workers > 1)
                or (call.method == "predict_on_batch" and backend.num_replicas_in_sync > 1)):
            return _predict_on_this_worker(call)
        return call.keras()

    def guard(self, call: fit_call.FitCall) -> contextlib.AbstractContextManager:
        return call.backend.faults.guarded(call.where)   # `tensorflow.faults`: TF's own errors name the peers


def _compile_without_xla(model: Any) -> None:
    """`jit_compile=True` on CPU workers: TF's XLA has no CPU collectives, so train unjitted.

    TensorFlow 2.21 fails such a step with "Collectives are not yet implemented for CPU devices
    when compiling with XLA" (b/194942685), and a worker may abort with a double free. Keras'
    default `jit_compile="auto"` already picks False on CPU-only machines; an explicit True is
    turned off here, with a warning, before Keras builds its step functions.
    """
    warnings.warn(
        "jit_compile=True is ignored on this multi-worker TensorFlow job: TensorFlow's XLA cannot "
        "compile cross-worker collectives on CPU devices (b/194942685), so keras_mwms trains "
        "with jit_compile=False. Use GPU workers for XLA, or compile with jit_compile='auto'.",
        stacklevel=4)
    model.jit_compile = False
    model.train_function = model.test_function = model.predict_function = None


def align_shuffle_seed(port: Any) -> None:
    """Makes Keras' shuffles draw the chief's order on every worker (one `broadcast_object`).

    Keras shuffles arrays inside a tf.data graph whose random ops are seeded from TF's global
    seed, and a PyDataset's batch order with Python's `random`; workers seeded differently
    would each take their slice of a *different* order (rows duplicated and lost). The chief's
    global seed (one drawn from NumPy when it has none) and Python `random` state are set on
    the workers where they differ; the chief's own state is left as it is, so its order is
    the one plain Keras draws in one process with the same seeds.

    Example (one worker: `broadcast_object` returns the chief's own state, nothing changes):

    >>> import tensorflow as tf
    >>> from types import SimpleNamespace as Port
    >>> tf.random.set_seed(7); state = random.getstate()
    >>> align_shuffle_seed(Port(broadcast_object=lambda value, root=0: value))
    >>> random.getstate() == state
    True
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    own_seed = context.global_seed()
    chosen = own_seed if own_seed is not None else int(np.random.randint(0, 2**31 - 1))
    seed, python_state = port.broadcast_object((chosen, random.getstate()))
    if seed != own_seed:
        tf.random.set_seed(seed)
    if python_state != random.getstate():
        random.setstate(python_state)


def _predict_on_this_worker(call: fit_call.FitCall) -> Any:
    """`model.predict` of a multi-worker model, on this worker alone, without any collective.

    Predictions need no collective: every worker predicts all rows itself (the variables are
    identical everywhere). So `if strategy.is_chief: model.predict(...)`, a path one worker
    runs alone, cannot hang or abort the peers' collectives, and every worker gets the whole
    result in order. The model's strategy is set aside for the call; its local predict
    function is kept for the next call.
    """
    model = call.model
    saved_strategy, saved_function = attributes.distribute_strategy(model), model.predict_function
    attributes.set_distribute_strategy(model, None)
    model.predict_function = _local_predict_functions.get(model, "function")
    try:
        return call.keras()
    finally:
        _local_predict_functions.of(model).function = model.predict_function
        attributes.set_distribute_strategy(model, saved_strategy)
        model.predict_function = saved_function
