"""`fit` / `evaluate` / `predict` of models built in keras_mwms' scope, kept equivalent to one process.

Keras' TensorFlow trainer runs these loops under a multi-worker strategy as it would under one
machine's; what differs across workers is the job of these wrappers (installed as rows of the
backend's patch table, see `keras_mwms.backends.tensorflow.patches`):

* `fit` of a model created outside `strategy.scope()` stops every worker with the fix
  (`keras_mwms.backends.model_scope`; its `evaluate`/`predict` run on the worker alone);
* the chief alone shows a progress bar: logs are global, N copies would interleave;
* Keras' shuffles draw the chief's order on every worker (`align_shuffle_seed`);
* every worker must pass arrays of one length, and tf.data inputs should start with the same
  batch (`keras_mwms.backends.policy.check_same_rows`, one collective before step 1);
* `AutoShardPolicy.OFF` datasets run their full length (`data.distribute_unsharded_dataset`);
* `jit_compile=True` on CPU workers trains unjitted (TF's XLA has no CPU collectives);
* `predict` runs on each worker alone, so a chief-only `predict` cannot hang the peers, and so
  does `predict_on_batch` (Keras concatenated every replica's copy of the whole batch: N × the
  rows on N workers);
* fit/evaluate steps are row-weighted (`gradients.RowWeighting.keras_loop`), and TF's
  lost-peer errors become `keras_mwms.WorkerLostError` naming the lost workers;
* `TF_CONFIG` drift since the strategy was created is warned about.

Example (what the patch table does with Keras' `fit`):

>>> import inspect
>>> def fit(self, x=None, y=None, verbose="auto"):
...     return verbose
>>> wrapped = trainer_method("fit", backend=None)(fit)
>>> inspect.signature(wrapped) == inspect.signature(fit)   # Keras' signature, for users and tools
True
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms import resumable_inputs
from keras_mwms.backends import model_scope, policy
from keras_mwms.backends.patches import ObjectState
from keras_mwms.backends.tensorflow import data
from keras_mwms.data import first_batch_digest

_local_predict_functions = ObjectState()   # model -> its predict function without the strategy


def trainer_method(method_name: str, backend: Any) -> Callable[[Callable], Callable]:
    """The patch replacement factory for `TensorFlowTrainer.<method_name>` (fit/evaluate/predict,
    predict_on_batch).

    The wrapper forwards `*args, **kwargs`; it binds them to the original's signature only to
    read and adjust named arguments (`x`, `verbose`).
    """
    def wrap(original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def method(model, *args, **kwargs):
            bound = signature.bind(model, *args, **kwargs)
            ours = backend is not None and backend.uses(model)
            # predict enters no collective, so one worker may call it alone; predict_on_batch
            # under the strategy runs the whole batch on every replica and concatenates the copies.
            if ours and ((method_name == "predict" and backend.num_workers > 1)
                         or (method_name == "predict_on_batch" and backend.num_replicas_in_sync > 1)):
                _prepare_call(backend, model, method_name, bound)
                return _predict_on_this_worker(model, original, bound)
            try:
                # The entry's collectives (agreed seeds, row checks) fail like the steps'.
                _prepare_call(backend, model, method_name, bound)
                in_keras_loop = (backend.row_weighting.keras_loop(model)
                                 if ours and method_name in ("fit", "evaluate") else contextlib.nullcontext())
                with in_keras_loop:
                    result = original(*bound.args, **bound.kwargs)
                if method_name == "fit" and ours:
                    backend.check_workers_agree(model, "model.fit()")
                return result
            except Exception as error:
                if backend is not None and backend.uses(model):
                    backend.raise_if_worker_lost(f"model.{method_name}()", error)
                raise

        return method

    return wrap


def _prepare_call(backend: Any, model: Any, method: str, bound: inspect.BoundArguments) -> None:
    """Adjusts one fit/evaluate/predict call of a model built in our scope (see module doc)."""
    import tensorflow as tf

    if backend is None:
        return
    backend.check_tf_config_unchanged(stacklevel=3)
    arguments = bound.arguments
    if method == "fit":
        model_scope.require_created_in_scope(backend, model, "fit")
    if not backend.uses(model):
        if backend.num_workers > 1:
            warnings.warn(
                f"model.{method}() runs on this worker alone: the model was not created inside "
                "keras_mwms strategy.scope(). Create the model (and compile it) under "
                "`with strategy.scope():` to train on all workers.", stacklevel=3)
        return
    if not backend.is_chief and "verbose" in bound.signature.parameters:
        # The chief's progress bar and epoch lines are the job's (logs are global): N identical
        # copies would interleave in one log.
        arguments["verbose"] = 0
    x = arguments.get("x")
    if method == "fit" and arguments.get("shuffle", True) and not isinstance(x, tf.data.Dataset):
        # Also on one worker, so that N workers and one process draw the same permutation.
        align_shuffle_seed(backend)
    if method == "fit":
        data.read_pydataset_by_index(arguments)
    if method == "fit" and backend.num_workers == 1:
        _resumable_order(backend, model, arguments)
    if backend.num_workers == 1:
        return
    unsharded = data.shard_policy_is_off(x)
    if method in ("fit", "evaluate"):
        # AutoShardPolicy.OFF: each worker's dataset is its own data, different by design.
        digest = first_batch_digest(x) if method == "fit" and not unsharded else None
        policy.check_same_rows(backend, x, f"model.{method}()", digest=digest,
                              batch_size=arguments.get("batch_size"))
    if method == "fit":
        _resumable_order(backend, model, arguments)
    if model.jit_compile and backend.gpu_count == 0:
        _compile_without_xla(model)
    if getattr(model, "steps_per_execution", 1) > 1:
        raise NotImplementedError(
            f"model.{method}() with steps_per_execution={model.steps_per_execution} is not "
            "supported on a multi-worker TensorFlow strategy with Keras 3.15: Keras' multi-step "
            "loop puts collectives inside tf.cond/tf.while_loop, which fails with 'You must feed "
            "a value for placeholder tensor'. Compile with steps_per_execution=1.")
    if unsharded and method in ("fit", "evaluate"):
        arguments["x"] = data.distribute_unsharded_dataset(backend, x, f"model.{method}()")


def _resumable_order(backend: Any, model: Any, arguments: dict) -> None:
    """A shuffled input of a resumable fit becomes keras_mwms' ordered stream, fed as tf.data
    (`data.stream_dataset`)."""
    resumable_inputs.prepare_fit(backend, model, arguments)
    fit_input = resumable_inputs.active_for(model)
    if fit_input is not None and fit_input.stream is not None:
        arguments["x"] = data.stream_dataset(fit_input.stream)


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


def _predict_on_this_worker(model: Any, original: Callable, bound: inspect.BoundArguments) -> Any:
    """`model.predict` of a multi-worker model, on this worker alone, without any collective.

    Predictions need no collective: every worker predicts all rows itself (the variables are
    identical everywhere). So `if strategy.is_chief: model.predict(...)`, a path one worker
    runs alone, cannot hang or abort the peers' collectives, and every worker gets the whole
    result in order. The model's strategy is set aside for the call; its local predict
    function is kept for the next call.
    """
    saved_strategy, saved_function = model._distribute_strategy, model.predict_function
    model._distribute_strategy = None
    model.predict_function = _local_predict_functions.get(model, "function")
    try:
        return original(*bound.args, **bound.kwargs)
    finally:
        _local_predict_functions.of(model).function = model.predict_function
        model._distribute_strategy, model.predict_function = saved_strategy, saved_function
