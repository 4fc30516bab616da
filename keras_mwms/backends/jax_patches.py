"""The Keras 3.15.1 patches keras_mwms applies on the JAX backend, each named and guarded.

Installed by `JaxBackend.join()` and removed by `leave()`. Every patch checks that a keras_mwms
JAX backend is active and otherwise calls the original Keras code unchanged.

* `broadcast-initial-values` — Keras places a new replicated variable with `jax.device_put`,
  which across processes asserts the value is equal everywhere ("not the same on each
  process", keras-team/keras#19246-style seed mismatch) and aborts when workers seed
  differently. We broadcast the chief's value instead (tf.distribute's MWMS does the same).
* `global-batches` — `fit`/`evaluate`/`predict` refuse numpy input on several processes, hang on
  uneven shards and crash on a partial last batch (auto-sharding needs equal local shapes).
  We read the global batch on every worker and build the global arrays ourselves
  (`keras_mwms.backends.jax_data`); `_distribute_data` lets such arrays through untouched.
* `predict-gathers-outputs` — `predict` fails with "Fetching value for jax.Array that spans
  non-addressable devices"; we all-gather each batch's outputs, in order, to every worker.
* `chief-progress-bar` — only the chief prints progress; the logs stay global everywhere.
* `flat-train-step` — on the flat path (`jax_flat`) `make_train_function` builds the split step
  (local gradients → one flat all-reduce → apply); `make_test_function` skips an empty share;
  new variables take the chief's value (`JaxVariable._initialize`) and the whole state is
  broadcast in one collective at the start of every fit.
* `global-metrics` — on the flat path `_get_metrics_result_or_logs` computes results from the
  all-worker metric state (end of every epoch and of `evaluate`).
* `worker-lost` — a gloo failure caused by a dead peer becomes `WorkerLostError` naming it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from keras_mwms.backends import jax_flat
from keras_mwms.backends.base import require_tested_keras

_state: dict[str, Any] = {"backend": None, "originals": {}}
_TRAINER_METHODS = ("fit", "evaluate", "predict", "make_predict_function", "make_train_function",
                    "make_test_function", "_get_metrics_result_or_logs")


def active_backend():
    """The joined `JaxBackend`, or None when keras_mwms is not in charge."""
    return _state["backend"]


def install(backend) -> None:
    """Applies every patch (idempotent) and makes `backend` the one the patches serve."""
    require_tested_keras("jax: broadcast-initial-values, global-batches, predict-gathers-outputs, "
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
    for name in _TRAINER_METHODS:
        originals[name] = getattr(jax_trainer.JAXTrainer, name)

    jax_distribution_lib.distribute_tensor = _distribute_tensor
    jax_trainer._distribute_data = _distribute_data
    jax_core.JaxVariable._initialize = _variable_initialize
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
    for name in _TRAINER_METHODS:
        original = originals.pop(name)
        if name == "_get_metrics_result_or_logs":
            delattr(jax_trainer.JAXTrainer, name)  # inherited from the base Trainer
        else:
            setattr(jax_trainer.JAXTrainer, name, original)


# -- broadcast-initial-values -------------------------------------------------------------
def _distribute_tensor(tensor, layout):
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
    value = backend.broadcast_array(np.asarray(tensor))
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
        seed = backend.agreed_seed() if shuffle else 0
        source = jax_data.make_source(x, y, sample_weight, batch_size, steps, shuffle, class_weight, seed)
    return jax_data.make_global_batch_adapter(source, placer or _placer(backend))


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
    """For a DataParallel model while the cluster runs the flat path: its variables become global
    replicated arrays (no communication: they are identical everywhere) and the DataParallel
    distribution is entered for the call."""
    import contextlib

    if backend.path != jax_flat.FLAT or path != jax_flat.DATA_PARALLEL:
        return contextlib.nullcontext()
    _make_variables_global(backend, model)
    return backend.distribution.scope()


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
    """Patch `broadcast-initial-values` on the flat path: a new variable takes the chief's value."""
    _state["originals"]["variable_initialize"](self, value)
    backend = active_backend()
    if backend is None or backend.path != jax_flat.FLAT or self._layout is not None:
        return
    import jax
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.utils import jax_utils

    current = self._value
    if not isinstance(current, jax.Array) or in_stateless_scope() or jax_utils.is_in_jax_tracing_scope(current):
        return
    self._value = jax.numpy.asarray(backend.broadcast_array(np.asarray(current)))


def _sync_flat_state(backend, model) -> None:
    """One broadcast of every model and optimizer variable, once per fit (and before a first
    evaluate/predict): values set on one worker only (set_weights, load_weights) cannot drift."""
    if getattr(model, "_keras_mwms_flat_synced", False):
        return
    variables = jax_flat.model_state_variables(model)
    values = backend.broadcast_arrays([np.asarray(variable.value) for variable in variables])
    for variable, value in zip(variables, values):
        variable.assign(value)
    object.__setattr__(model, "_keras_mwms_flat_synced", True)


def _make_train_function(self, force=False):
    """Patch `flat-train-step`: Keras' jitted step split around one flat gradient all-reduce."""
    if not _on_flat_path(self):
        return _state["originals"]["make_train_function"](self, force)
    backend = active_backend()
    _sync_flat_state(backend, self)
    if self.train_function is not None and not force:
        return
    step = jax_flat.make_flat_train_step(
        self, backend.collectives, lambda call: _reporting_lost_workers(backend, "gradient all-reduce", call),
        backend.all_gather)
    self.train_function = self._make_function(step)


def _make_test_function(self, force=False):
    """On the flat path: each worker evaluates its rows; an empty share leaves the state alone."""
    if not _on_flat_path(self):
        return _state["originals"]["make_test_function"](self, force)
    _sync_flat_state(active_backend(), self)
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
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=validation_split)
    path = path_for(backend, self)
    placer = _placer(backend, path)
    object.__setattr__(self, "_keras_mwms_flat_synced", False)  # broadcast the state at this fit
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
    path = path_for(backend, self)
    # The flat path predicts every row on every worker: full and ordered with no collective.
    placer = _placer(backend, "full" if path == jax_flat.FLAT else path)
    data = _adapter_for(backend, x, None, None, batch_size, steps, placer=placer)
    with _model_context(backend, self, path):
        return _running_user_code(backend, "model.predict", lambda: original(
            self, data, None, _quiet_unless_chief(backend, verbose), steps, callbacks))


# -- predict-gathers-outputs --------------------------------------------------------------
def _make_predict_function(self, force=False):
    backend = active_backend()
    if _on_flat_path(self):
        _sync_flat_state(backend, self)
    result = _state["originals"]["make_predict_function"](self, force)
    step = self.predict_function
    if (backend is None or backend.mesh is None or getattr(step, "_keras_mwms_gathers", False)
            or path_for(backend, self) == jax_flat.FLAT):
        return result
    gather = _full_output_gatherer(backend.mesh)

    def gathering_step(state, iterator):
        import jax

        outputs, state = step(state, iterator)
        return jax.tree.map(gather, outputs), state

    gathering_step._keras_mwms_gathers = True
    self.predict_function = gathering_step
    return result


def _full_output_gatherer(mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicate = jax.jit(lambda value: value, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def gather(value):
        if not isinstance(value, jax.Array):
            return value
        if value.is_fully_addressable:
            return np.asarray(value)
        if not value.is_fully_replicated:
            value = replicate(value)
        return np.asarray(value.addressable_data(0))

    return gather
