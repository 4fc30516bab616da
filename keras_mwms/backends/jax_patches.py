"""The Keras 3.15.1 patches keras_mwms applies on the JAX backend, each named and guarded.

Installed by `JaxBackend.join()` and removed by `leave()`. Every patch checks that a keras_mwms
JAX backend is active and otherwise calls the original Keras code unchanged.

Collectives happen only where every worker goes: leaving `strategy.scope()`, the entry and the
steps of `fit`/`evaluate`, the callbacks' coordination. Every path one worker may run alone
(`save`, `save_weights`, `export`, `load_model`, building a model or optimizer, `predict`)
enters none — before, a variable created on the chief alone broadcast its value and the chief
hung until JAX's coordination service aborted both workers.

* `local-variable-creation` — Keras places a new replicated variable with `jax.device_put`,
  which across processes asserts the value is equal everywhere ("not the same on each
  process") — a collective, which aborts when workers seed differently. A new variable keeps
  its local value instead (a global array built without communication); those created in
  `strategy.scope()` take the chief's values when the scope is left (`JaxBackend.scope`).
* `state-at-entry` — the whole model, optimizer and metric state is broadcast from the chief in
  one collective at the entry of every `fit` and `evaluate` (`_sync_state`), so values set on
  one worker alone (`load_weights` on the chief, variables built lazily with a per-worker
  seed) never reach a training step.
* `global-batches` — `fit`/`evaluate`/`predict` refuse numpy input on several processes, hang on
  uneven shards and crash on a partial last batch (auto-sharding needs equal local shapes).
  We read the global batch on every worker and build the global arrays ourselves
  (`keras_mwms.backends.jax_data`); `_distribute_data` lets such arrays through untouched.
  Keras' own adapters cut, pack (`(x, y)` without sample weights) and shuffle the batches;
  shuffled arrays and PyDatasets take the chief's NumPy / Python `random` state at `fit` entry.
* `local-predict` — `predict` fails with "Fetching value for jax.Array that spans
  non-addressable devices"; each worker computes every row it is given on its own device,
  from its copy of the variables, with no collective.
* `chief-progress-bar` — only the chief prints progress; the logs stay global everywhere.
* `flat-train-step` — on the flat path (`jax_flat`) `make_train_function` builds the split step
  (local gradients → one flat all-reduce → apply); `make_test_function` skips an empty share.
* `global-metrics` — on the flat path `_get_metrics_result_or_logs` computes results from the
  all-worker metric state (end of every epoch and of `evaluate`).
* `worker-lost` — a gloo failure caused by a dead peer becomes `WorkerLostError` naming it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from keras_mwms.backends import jax_flat
from keras_mwms.backends.patches import require_tested_keras

_state: dict[str, Any] = {"backend": None, "originals": {}}
_TRAINER_METHODS = ("fit", "evaluate", "predict", "make_predict_function", "make_train_function",
                    "make_test_function", "_get_metrics_result_or_logs")


def active_backend():
    """The joined `JaxBackend`, or None when keras_mwms is not in charge."""
    return _state["backend"]


def install(backend) -> None:
    """Applies every patch (idempotent) and makes `backend` the one the patches serve."""
    require_tested_keras("jax: local-variable-creation, state-at-entry, global-batches, local-predict, "
                         "flat-train-step, global-metrics")
    _state["backend"] = backend
    if _state["originals"]:
        return
    from keras.src.backend.jax import core as jax_core
    from keras.src.backend.jax import distribution_lib as jax_distribution_lib
    from keras.src.backend.jax import trainer as jax_trainer

    originals = _state["originals"]
    originals["distribute_tensor"] = jax_distribution_lib.distribute_tensor
    originals["_distribute_data"] = jax_trainer._distribute_data
    originals["variable_initialize"] = jax_core.JaxVariable._initialize
    originals["variable_initialize_with_initializer"] = jax_core.JaxVariable._initialize_with_initializer
    for name in _TRAINER_METHODS:
        originals[name] = getattr(jax_trainer.JAXTrainer, name)

    jax_distribution_lib.distribute_tensor = _distribute_tensor
    jax_trainer._distribute_data = _distribute_data
    jax_core.JaxVariable._initialize = _variable_initialize
    jax_core.JaxVariable._initialize_with_initializer = _variable_initialize_with_initializer
    jax_trainer.JAXTrainer.fit = functools.wraps(originals["fit"])(_fit)
    jax_trainer.JAXTrainer.evaluate = functools.wraps(originals["evaluate"])(_evaluate)
    jax_trainer.JAXTrainer.predict = functools.wraps(originals["predict"])(_predict)
    jax_trainer.JAXTrainer.make_predict_function = _make_predict_function
    jax_trainer.JAXTrainer.make_train_function = _make_train_function
    jax_trainer.JAXTrainer.make_test_function = _make_test_function
    jax_trainer.JAXTrainer._get_metrics_result_or_logs = _get_metrics_result_or_logs


def uninstall(backend) -> None:
    """Restores Keras' originals once `backend` leaves."""
    if _state["backend"] is not backend:
        return
    _state["backend"] = None
    originals = _state["originals"]
    if not originals:
        return
    from keras.src.backend.jax import core as jax_core
    from keras.src.backend.jax import distribution_lib as jax_distribution_lib
    from keras.src.backend.jax import trainer as jax_trainer

    jax_distribution_lib.distribute_tensor = originals.pop("distribute_tensor")
    jax_trainer._distribute_data = originals.pop("_distribute_data")
    jax_core.JaxVariable._initialize = originals.pop("variable_initialize")
    jax_core.JaxVariable._initialize_with_initializer = originals.pop("variable_initialize_with_initializer")
    for name in _TRAINER_METHODS:
        original = originals.pop(name)
        if name == "_get_metrics_result_or_logs":
            delattr(jax_trainer.JAXTrainer, name)  # inherited from the base Trainer
        else:
            setattr(jax_trainer.JAXTrainer, name, original)


# -- local-variable-creation --------------------------------------------------------------
def _distribute_tensor(tensor, layout):
    """A replicated global array built from this worker's value, with no communication.

    Keras' `jax.device_put` checks across processes that the value is the same everywhere (a
    collective, so a worker creating or assigning a variable alone would hang). The values
    agree where every worker goes: at the exit of `strategy.scope()` and the entry of
    `fit`/`evaluate` (`_sync_state`)."""
    import jax
    from jax.sharding import NamedSharding
    from keras.src.distribution import TensorLayout
    from keras.src.utils import jax_utils

    original = _state["originals"]["distribute_tensor"]
    backend = active_backend()
    if backend is None or backend.num_workers == 1 or jax_utils.is_in_jax_tracing_scope(tensor):
        return original(tensor, layout)
    if isinstance(tensor, jax.Array) and isinstance(tensor.sharding, NamedSharding):
        return original(tensor, layout)
    sharding = layout.backend_layout if isinstance(layout, TensorLayout) else layout
    if not (isinstance(sharding, NamedSharding) and sharding.is_fully_replicated):
        return original(tensor, layout)
    value = np.asarray(tensor)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


# -- global-batches -----------------------------------------------------------------------
def _distribute_data(data, layouts=None):
    import jax
    from jax.sharding import NamedSharding
    from keras.src import tree

    leaves = [leaf for leaf in tree.flatten(data) if leaf is not None]
    if leaves and all(isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
                      for leaf in leaves):
        return data
    return _state["originals"]["_distribute_data"](data, layouts)


def _adapter_for(backend, x, y=None, sample_weight=None, batch_size=None, steps=None,
                 shuffle=False, class_weight=None, placer=None):
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    from keras_mwms.backends import jax_data

    if isinstance(x, DataAdapter):
        return x
    if isinstance(x, jax_data.DistributedDataset):
        source = jax_data.LocalPartSource(x)
    else:
        if shuffle and jax_data.shuffles_globally(x, y, sample_weight):
            _align_shuffle_state(backend)
        source = jax_data.make_source(x, y, sample_weight, batch_size, steps, shuffle, class_weight)
    return jax_data.make_global_batch_adapter(source, placer or _placer(backend))


def _align_shuffle_state(backend) -> None:
    """Keras shuffles arrays with NumPy's global RNG and a PyDataset's batch order with Python's
    `random`: workers take the chief's states (the chief keeps its own, so its order is the one
    plain Keras draws in one process with the same seeds), so every worker cuts the same global
    batches."""
    import random

    python_state, numpy_state = backend.broadcast_object((random.getstate(), np.random.get_state()))
    random.setstate(python_state)
    np.random.set_state(numpy_state)


class _IdentityPlacer:
    """One device: plain Keras places the numpy batches itself."""

    @staticmethod
    def place(batch):
        return batch

    place_local_part = place


def _placer(backend, path=None):
    """How a global batch reaches the step: global arrays (DataParallel), this worker's rows
    (flat), or untouched (one device; also the flat `predict`, which computes every row)."""
    from keras_mwms.backends import jax_data

    if backend.mesh is None or path == "full":
        return _IdentityPlacer()
    if path == jax_flat.FLAT:
        return jax_data.LocalRowsPlacer(backend.num_workers, backend.worker_index)
    return jax_data.GlobalArrayPlacer(backend.mesh, backend.distribution.batch_dim_name,
                                      backend.num_workers, backend.worker_index)


# -- path choice (flat vs DataParallel) ---------------------------------------------------
def path_for(backend, model) -> str:
    """The path `model` trains on, decided once per model (see `jax_flat.requested_path`).

    A model may be pinned before its first fit with `model._keras_mwms_jax_path = "dataparallel"`
    (the benchmark does that to time both paths side by side).
    """
    if backend is None or backend.path != jax_flat.FLAT:
        return backend.path if backend is not None else "single"
    chosen = getattr(model, "_keras_mwms_jax_path", None)
    if chosen is None:
        reason = jax_flat.can_run_flat(model)
        if reason is None:
            chosen = jax_flat.FLAT
        elif reason.startswith("it overrides") or jax_flat.requested_path() != jax_flat.FLAT:
            chosen = jax_flat.DATA_PARALLEL
        else:
            jax_flat.warn_flat_batch_norm(model)
            chosen = jax_flat.FLAT
        object.__setattr__(model, "_keras_mwms_jax_path", chosen)
    return chosen


def _on_flat_path(model) -> bool:
    backend = active_backend()
    return backend is not None and backend.num_workers > 1 and path_for(backend, model) == jax_flat.FLAT


def _model_context(backend, model, path):
    """For a DataParallel model: its variables become global replicated arrays (no
    communication; `_sync_state` then gives them the chief's values), also those a local
    `predict` built; while the cluster runs the flat path, the DataParallel distribution is
    entered for the call."""
    import contextlib

    if path != jax_flat.DATA_PARALLEL or backend.mesh is None:
        return contextlib.nullcontext()
    _make_variables_global(backend, model)
    return backend.distribution.scope() if backend.path == jax_flat.FLAT else contextlib.nullcontext()


def _make_variables_global(backend, model) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(backend.mesh, PartitionSpec())
    device = jax.local_devices()[0]
    for variable in jax_flat.model_state_variables(model):
        value = variable._value
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            continue
        local = jax.device_put(value, device)
        variable._value = jax.make_array_from_single_device_arrays(local.shape, replicated, [local])


def _variable_initialize(self, value):
    """Patch `local-variable-creation`: a new variable keeps its local value (no collective);
    one created in `strategy.scope()` takes the chief's value when the scope is left."""
    _state["originals"]["variable_initialize"](self, value)
    _note_new_variable(self)


def _variable_initialize_with_initializer(self, initializer):
    _state["originals"]["variable_initialize_with_initializer"](self, initializer)
    _note_new_variable(self)


def _note_new_variable(variable) -> None:
    backend = active_backend()
    if backend is None or backend.num_workers == 1:
        return
    import jax
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.utils import jax_utils

    current = variable._value
    if isinstance(current, jax.Array) and not in_stateless_scope() and not jax_utils.is_in_jax_tracing_scope(current):
        backend.note_new_variable(variable)


def _sync_state(model) -> None:
    """Patch `state-at-entry`: one broadcast of every model, optimizer and metric variable from
    the chief at the entry of each `fit` and `evaluate` (every worker reaches it), so values set
    on one worker alone (set_weights, load_weights, variables built lazily with a per-worker
    seed) cannot drift into training."""
    backend = active_backend()
    if backend is None or backend.num_workers == 1 or getattr(model, "_keras_mwms_synced", False):
        return
    variables = jax_flat.model_state_variables(model)
    values = backend.broadcast_arrays([np.asarray(variable.value) for variable in variables])
    jax_flat.assign_values(variables, values)
    object.__setattr__(model, "_keras_mwms_synced", True)


def _make_train_function(self, force=False):
    """Patch `flat-train-step`: Keras' jitted step split around one flat gradient all-reduce."""
    _sync_state(self)
    if not _on_flat_path(self):
        return _state["originals"]["make_train_function"](self, force)
    backend = active_backend()
    if self.train_function is not None and not force:
        return
    step = jax_flat.make_flat_train_step(
        self, backend.collectives, lambda call: _reporting_lost_workers(backend, "gradient all-reduce", call),
        backend.all_gather)
    self.train_function = self._make_function(step)


def _make_test_function(self, force=False):
    """On the flat path: each worker evaluates its rows; an empty share leaves the state alone."""
    _sync_state(self)
    if not _on_flat_path(self):
        return _state["originals"]["make_test_function"](self, force)
    if self.test_function is not None and not force:
        return
    import jax

    test_step = self.test_step
    if not self.run_eagerly and self.jit_compile:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # one compile (see jax_flat)
        test_step = jax.jit(self.test_step, donate_argnums=0, in_shardings=device, out_shardings=device)
    self.test_function = self._make_function(jax_flat.skip_empty_test_step(self, test_step))


def _get_metrics_result_or_logs(self, logs):
    """Patch `global-metrics`: on the flat path, results come from the all-worker metric state."""
    original = _state["originals"]["_get_metrics_result_or_logs"]
    if not _on_flat_path(self):
        return original(self, logs)
    backend = active_backend()
    with jax_flat.global_metric_state(self, backend.all_gather):
        metric_logs = self.get_metrics_result()
    if not logs or (isinstance(logs, dict) and set(logs) == set(metric_logs)):
        return metric_logs
    return logs


def _check_same_rows(backend, x, what: str) -> None:
    """Every worker must pass arrays of one length; else a clear error everywhere (one all-reduce).

    Different lengths give workers different step counts: the next collective would wait
    forever for the worker that already stopped, so it is caught before the first step.
    """
    from keras_mwms.data import leading_rows, uneven_rows_error

    if backend.num_workers == 1:
        return
    rows = leading_rows(x)
    mine = np.zeros(backend.num_workers, dtype=np.int32)
    mine[backend.worker_index] = 0 if rows is None else rows + 1   # 0 encodes "not arrays"
    everyone = _reporting_lost_workers(backend, "row-count check", lambda: backend.all_reduce_sum(mine))
    error = uneven_rows_error([int(value) - 1 if value else None for value in everyone.tolist()],
                              backend.worker_index, what)
    if error is not None:
        raise error


def _quiet_unless_chief(backend, verbose):
    return verbose if backend.is_chief else 0


def _reporting_lost_workers(backend, where, call):
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - jaxlib's runtime errors have no stable public type
        backend.raise_if_worker_lost(error, where)
        raise


def _running_user_code(backend, where, call):
    """`fit`/`evaluate`/`predict`: a lost peer becomes `WorkerLostError`; any other exception
    marks this worker as failed, so its interpreter exit skips JAX's shutdown barrier and the
    peers learn at once which worker is gone (`JaxBackend.exit_now_if_failed`). A later call
    that returns cleanly (the caller handled the error) clears the mark."""
    try:
        result = _reporting_lost_workers(backend, where, call)
    except Exception as error:
        if backend.num_workers > 1 and not isinstance(error, backend.lost_error_type):
            backend.failed = f"{type(error).__name__} in {where}"
        raise
    backend.failed = None
    return result


def _fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
         validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
         sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
         validation_batch_size=None, validation_freq=1):
    original = _state["originals"]["fit"]
    backend = active_backend()
    if backend is None:
        return original(self, x, y, batch_size, epochs, verbose, callbacks, validation_split,
                        validation_data, shuffle, class_weight, sample_weight, initial_epoch,
                        steps_per_epoch, validation_steps, validation_batch_size, validation_freq)
    from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

    from keras_mwms import strategy

    facade = strategy.get_strategy()
    if facade is not None:
        facade.check_tf_config_unchanged()
    _check_same_rows(backend, x, "model.fit()")
    from keras_mwms.backends import jax_data
    from keras_mwms.data import warn_if_first_batches_differ

    warn_if_first_batches_differ(backend, x, "model.fit()", jax_data.shard_policy_is_off(x), stacklevel=4)
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=validation_split)
    path = path_for(backend, self)
    placer = _placer(backend, path)
    object.__setattr__(self, "_keras_mwms_synced", False)  # broadcast the state at this fit
    train = _adapter_for(backend, x, y, sample_weight, batch_size, steps_per_epoch, shuffle, class_weight,
                         placer=placer)
    if validation_data is not None:
        val_x, val_y, val_sample_weight = data_adapter_utils.unpack_x_y_sample_weight(validation_data)
        validation_data = (_adapter_for(backend, val_x, val_y, val_sample_weight,
                                        validation_batch_size or batch_size, validation_steps, placer=placer),)
    with _model_context(backend, self, path):
        return _running_user_code(backend, "model.fit", lambda: original(
            self, train, None, None, epochs, _quiet_unless_chief(backend, verbose), callbacks, 0.0,
            validation_data, False, None, None, initial_epoch, steps_per_epoch, validation_steps, None,
            validation_freq))


def _evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
              callbacks=None, return_dict=False, **kwargs):
    original = _state["originals"]["evaluate"]
    backend = active_backend()
    if backend is None:
        return original(self, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict,
                        **kwargs)
    _check_same_rows(backend, x, "model.evaluate()")
    if not kwargs.get("_use_cached_eval_dataset"):   # (fit's validation: the state is already agreed)
        object.__setattr__(self, "_keras_mwms_synced", False)
    path = path_for(backend, self)
    data = _adapter_for(backend, x, y, sample_weight, batch_size, steps, placer=_placer(backend, path))
    with _model_context(backend, self, path):
        return _running_user_code(backend, "model.evaluate", lambda: original(
            self, data, None, None, _quiet_unless_chief(backend, verbose), None, steps, callbacks,
            return_dict, **kwargs))


def _predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    original = _state["originals"]["predict"]
    backend = active_backend()
    if backend is None:
        return original(self, x, batch_size, verbose, steps, callbacks)
    if backend.num_workers == 1:
        path = path_for(backend, self)
        data = _adapter_for(backend, x, None, None, batch_size, steps, placer=_placer(backend, path))
        with _model_context(backend, self, path):
            return original(self, data, None, verbose, steps, callbacks)
    data = _adapter_for(backend, x, None, None, batch_size, steps, placer=_IdentityPlacer())
    with _without_distribution():
        return _running_user_code(backend, "model.predict", lambda: original(
            self, data, None, _quiet_unless_chief(backend, verbose), steps, callbacks))


# -- local-predict ------------------------------------------------------------------------
def _make_predict_function(self, force=False):
    """Patch `local-predict`: `predict` may run on one worker alone (`if strategy.is_chief:`),
    so it enters no collective. Each worker computes every row it is given on its first
    local device, from its own copy of the variables (a DataParallel model's global replicated
    arrays included): full, ordered outputs, the same on every worker that predicts."""
    backend = active_backend()
    if backend is None or backend.num_workers == 1:
        return _state["originals"]["make_predict_function"](self, force)
    if self.predict_function is not None and not force:
        return self.predict_function
    import jax

    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def local_predict_step(state, data):
        return self.predict_step(state, data)

    if not self.run_eagerly and self.jit_compile:
        local_predict_step = jax.jit(local_predict_step, in_shardings=device, out_shardings=device)

    def local_copy(value):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            value = value.addressable_data(0)
        return jax.device_put(value, device)

    def predict_step(state, data):
        trainable, non_trainable = state
        outputs, non_trainable = local_predict_step(
            ([local_copy(v) for v in trainable], [local_copy(v) for v in non_trainable]), data)
        return outputs, (trainable, non_trainable)

    self.predict_function = self._make_function(predict_step, concatenate_outputs=True)
    return self.predict_function


def _without_distribution():
    """No Keras distribution for the call: data stays this worker's numpy batches."""
    import contextlib

    from keras.src.distribution import distribution_lib

    @contextlib.contextmanager
    def cleared():
        previous = distribution_lib.distribution()
        distribution_lib.set_distribution(None)
        try:
            yield
        finally:
            distribution_lib.set_distribution(previous)

    return cleared()
