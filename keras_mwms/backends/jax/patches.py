"""The private-Keras patches keras_mwms applies on the JAX backend: one `PatchTable`, `PATCHES`
(`patch_table(backend)`, as on every backend).

The strategy installs the table after `JaxBackend.join()` and `strategy.close()` removes it.
Every replacement asks `keras_mwms.active.active_backend()` and calls the original Keras code
unchanged when no keras_mwms strategy is active; wrappers forward `*args, **kwargs`.

Collectives happen only where every worker goes: leaving `strategy.scope()`, the entry and the
steps of `fit`/`evaluate`, the callbacks' coordination. Every path one worker may run alone
(`save`, `save_weights`, `export`, `load_model`, building a model or optimizer, `predict`)
enters none — a variable created on the chief alone must not wait for the others.

The rows, by what they achieve:

* **local variable creation** (`local-replicated-arrays`, `note-new-variable`,
  `note-new-variable-initializer`) — Keras places a new replicated variable with
  `jax.device_put`, which across processes asserts the value is equal everywhere (a collective,
  which aborts when workers seed differently). A new variable keeps its local value instead (a
  global array built without communication); those created in `strategy.scope()` take the
  chief's values when the scope is left (`JaxBackend.scope`).
* **state at entry** (inside `flat-train-step` and `flat-test-step`) — the whole model,
  optimizer and metric state is broadcast from the chief in one collective at the entry of
  every `fit` and `evaluate`, so values set on one worker alone (`load_weights` on the chief,
  variables built lazily with a per-worker seed) never reach a training step.
* **global batches** (`fit-global-batches`, `evaluate-global-batches`, `arrays-pass-through`) —
  Keras' multi-process `fit`/`evaluate` refuse numpy input, hang on uneven shards and crash on
  a partial last batch (auto-sharding needs equal local shapes). keras_mwms reads the global
  batch on every worker and places it itself (`keras_mwms.backends.jax.data`); Keras'
  `_distribute_data` lets such arrays through untouched. Uneven arrays are a clear error on
  every worker; only the chief prints progress (the logs stay global everywhere).
* **local predict** (`predict-local`, `predict-local-function`) — `predict` fails with
  "Fetching value for jax.Array that spans non-addressable devices"; each worker computes every
  row it is given on its own device, from its copy of the variables, with no collective.
* **flat step** (`flat-train-step`, `flat-test-step`, `global-metrics`) — on the flat path
  (`keras_mwms.backends.jax.step`) the train step is split around one flat all-reduce, a worker
  with no rows of a step leaves its metric state alone, and results come from the all-worker
  metric state.
* **DataParallel step of keras_mwms** (inside `flat-train-step`, and `sharded-batch-norm-moments`)
  — with gradient accumulation or compression a DataParallel model's step runs in `shard_map`
  (`keras_mwms.backends.jax.sharded_step`), so keras_mwms issues its gradient collective: once
  per K micro-steps, in 16 bits when compressing; BatchNormalization's moments stay global.

A lost peer during any of them becomes `keras_mwms.WorkerLostError` naming it
(`keras_mwms.backends.jax.faults`).

Example:

>>> [row.name for row in PATCHES][:3]
['local-replicated-arrays', 'note-new-variable', 'note-new-variable-initializer']
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Any

import numpy as np

from keras_mwms import active
from keras_mwms.backends import batch_norm, fit_call, policy
from keras_mwms.backends.jax import data, sharded_step, step
from keras_mwms.backends.keras_api import attributes, internals, targets
from keras_mwms.backends.patches import Patch, PatchTable
from keras_mwms.diagnostics.ledger import counted_in_graph


def _backend():
    """The active strategy's JAX backend, or None when keras_mwms is not in charge."""
    return active.active_backend()


def _several_workers():
    backend = _backend()
    return backend if backend is not None and backend.num_workers > 1 else None


# -- local variable creation --------------------------------------------------------------
def _local_replicated_arrays(original):
    def distribute_tensor(tensor, layout):
        """A replicated global array built from this worker's value, with no communication."""
        import jax
        from jax.sharding import NamedSharding
        from keras.distribution import TensorLayout

        if _several_workers() is None or internals.is_in_jax_tracing_scope(tensor):
            return original(tensor, layout)
        if isinstance(tensor, jax.Array) and isinstance(tensor.sharding, NamedSharding):
            return original(tensor, layout)
        sharding = layout.backend_layout if isinstance(layout, TensorLayout) else layout
        if not (isinstance(sharding, NamedSharding) and sharding.is_fully_replicated):
            return original(tensor, layout)
        value = np.asarray(tensor)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return distribute_tensor


def _noting_new_variables(original):
    @functools.wraps(original)
    def initialize(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        backend = _several_workers()
        if backend is not None:
            import jax
            current = attributes.variable_value(self)
            if (isinstance(current, jax.Array) and not internals.in_stateless_scope()
                    and not internals.is_in_jax_tracing_scope(current)):
                backend.note_new_variable(self)
        return result

    return initialize


# -- global batches -----------------------------------------------------------------------
def _arrays_pass_through(original):
    # Forwards whatever else Keras passes (3.16 adds `is_super_batch`).
    @functools.wraps(original)
    def distribute_data(data_, *args, **kwargs):
        import jax
        from jax.sharding import NamedSharding
        from keras import tree

        leaves = [leaf for leaf in tree.flatten(data_) if leaf is not None]
        if leaves and all(isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
                          for leaf in leaves):
            return data_
        return original(data_, *args, **kwargs)

    return distribute_data


class JaxFitHooks(fit_call.FitHooks):
    """JAX's part of a `fit`/`evaluate`/`predict` call: Keras' own adapter, placed by path.

    The policy (binding, scope, TF_CONFIG, row checks, validation_split, class weights of
    arrays, `prepare_fit`, chief-only progress) is `keras_mwms.backends.fit_call`'s.
    """

    def alone(self, call):
        if call.backend.num_workers == 1:
            return call.keras()
        with _without_distribution():
            return call.keras()

    def align_shuffles(self, call):
        arguments = call.arguments
        if arguments["shuffle"] and data.shuffles_globally(arguments["x"], arguments["y"],
                                                           arguments["sample_weight"]):
            data.align_shuffle_state(call.backend)

    def feed(self, call):
        backend, model, values = call.backend, call.model, call.arguments
        if call.method == "predict" and backend.num_workers > 1:
            values.update(x=data.adapter_for(backend, data.EVERY_ROW, values["x"], None, None,
                                             values["batch_size"], values["steps"]), batch_size=None)
            return
        path = call.state["path"] = backend.model_path(model)
        if call.method == "predict":
            values.update(x=data.adapter_for(backend, path, values["x"], None, None, values["batch_size"],
                                             values["steps"]), batch_size=None)
            return
        backend.models.of(model).synced = False   # the state is broadcast at this fit or evaluate
        if call.method == "evaluate":
            values.update(x=data.adapter_for(backend, path, values["x"], values["y"], values["sample_weight"],
                                             values["batch_size"], values["steps"]),
                          y=None, batch_size=None, sample_weight=None)
            return
        train = data.adapter_for(backend, path, values["x"], values["y"], values["sample_weight"],
                                 values["batch_size"], values["steps_per_epoch"], values["shuffle"],
                                 values["class_weight"])
        validation_data = values["validation_data"]
        if validation_data is not None:
            val_x, val_y, val_sample_weight = internals.unpack_x_y_sample_weight(validation_data)
            validation_data = (data.adapter_for(
                backend, path, val_x, val_y, val_sample_weight,
                values["validation_batch_size"] or values["batch_size"], values["validation_steps"]),)
        values.update(x=train, y=None, batch_size=None, validation_data=validation_data, shuffle=False,
                      class_weight=None, sample_weight=None, validation_batch_size=None)

    def loop(self, call):
        return _model_context(call.backend, call.model, call.state["path"])

    def predict(self, call):
        if call.backend.num_workers > 1:
            with _without_distribution():
                return call.keras()
        with _model_context(call.backend, call.model, call.state["path"]):
            return call.keras()

    def guard(self, call):
        return call.backend.faults.running_user_code(call.where)


def _model_context(backend, model, path):
    """For a DataParallel model: its variables become global replicated arrays (no
    communication; the state broadcast at entry then gives them the chief's values), also
    those a local `predict` built; while the cluster runs the flat path, the DataParallel
    distribution is entered for the call."""
    if path != step.DATA_PARALLEL or backend.mesh is None:
        return contextlib.nullcontext()
    _make_variables_global(backend, model)
    return backend.distribution.scope() if backend.path == step.FLAT else contextlib.nullcontext()


def _make_variables_global(backend, model) -> None:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(backend.mesh, PartitionSpec())
    device = jax.local_devices()[0]
    for variable in step.model_state_variables(model):
        value = attributes.variable_value(variable)
        if isinstance(value, jax.Array) and isinstance(value.sharding, NamedSharding):
            continue
        local = jax.device_put(value, device)
        attributes.set_variable_value(
            variable, jax.make_array_from_single_device_arrays(local.shape, replicated, [local]))


# -- local predict ------------------------------------------------------------------------
def _predict_local_function(original):
    def make_predict_function(self, *args, **kwargs):
        """Each worker computes every row it is given on its first local device, from its own
        copy of the variables (a DataParallel model's global replicated arrays included): full,
        ordered outputs, the same on every worker that predicts, with no collective."""
        if _several_workers() is None:
            return original(self, *args, **kwargs)
        force = inspect.signature(original).bind(self, *args, **kwargs).arguments.get("force", False)
        if self.predict_function is not None and not force:
            return self.predict_function
        import jax

        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

        def local_predict_step(state, batch):
            return self.predict_step(state, batch)

        if not self.run_eagerly and self.jit_compile:
            local_predict_step = jax.jit(local_predict_step, in_shardings=device, out_shardings=device)

        def local_copy(value):
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                value = value.addressable_data(0)
            return jax.device_put(value, device)

        def predict_step(state, batch):
            trainable, non_trainable = state
            outputs, non_trainable = local_predict_step(
                ([local_copy(v) for v in trainable], [local_copy(v) for v in non_trainable]), batch)
            return outputs, (trainable, non_trainable)

        self.predict_function = step.iterator_function(self, predict_step, concatenate_outputs=True)
        return self.predict_function

    return make_predict_function


@contextlib.contextmanager
def _without_distribution():
    """No Keras distribution for the call: data stays this worker's numpy batches."""
    import keras

    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


# -- flat step ----------------------------------------------------------------------------
def _sync_state(backend, model) -> None:
    """One broadcast of every model, optimizer and metric variable from the chief at the entry
    of each `fit` and `evaluate` (every worker reaches it), so values set on one worker alone
    (set_weights, load_weights, variables built lazily with a per-worker seed) cannot drift
    into training."""
    if backend.models.get(model, "synced", False):
        return
    variables = step.model_state_variables(model)
    # A window of gradient accumulation left open by the last fit goes on as in one process.
    open_window = step.open_accumulators(model) if _on_flat_path(backend, model) else []
    if open_window:
        summed = backend.all_reduce(np.concatenate([np.asarray(v.value).ravel() for v in open_window]))
        step.assign_values(open_window, step.split_like(summed, open_window))
    values = backend.broadcast_arrays([np.asarray(variable.value) for variable in variables])
    step.assign_values(variables, values)
    if open_window and backend.worker_index != 0:   # the broadcast's source keeps the sum
        step.assign_values(open_window, [np.zeros(v.shape, v.dtype) for v in open_window])
    backend.models.of(model).synced = True


def _on_flat_path(backend, model) -> bool:
    return backend.model_path(model) == step.FLAT


def _flat_function(attribute: str, build):
    """A replacement factory for `make_train_function`/`make_test_function`: on several workers
    the model's state is agreed first (see `_sync_state`); on the flat path
    `model.<attribute>` becomes `step.iterator_function(model, build(backend, model))`."""
    def replacement(original):
        signature = inspect.signature(original)

        def make_function(self, *args, **kwargs):
            backend = _several_workers()
            if backend is None or not backend.uses(self):
                return original(self, *args, **kwargs)
            _sync_state(backend, self)
            if not _on_flat_path(backend, self):
                if attribute == "train_function" and sharded_step.wanted(
                        backend.options.compression, policy.accumulation_steps(self.optimizer)):
                    random_layer = sharded_step.draws_random_numbers(self)
                    if random_layer is None:   # keras_mwms issues the gradient collective
                        force = signature.bind(self, *args, **kwargs).arguments.get("force", False)
                        if self.train_function is None or force:
                            self.train_function = counted_in_graph(step.iterator_function(
                                self, sharded_step.make_sharded_train_step(self, backend)))
                        return self.train_function
                    if backend.options.compression:
                        warnings.warn(f"compression={backend.options.compression!r} is not applied to "
                                      f"{type(self).__name__}: its layer {random_layer!r} draws random "
                                      "numbers, so it keeps XLA's DataParallel step, whose gradients travel "
                                      "in float32 (and every micro-step of gradient accumulation).",
                                      stacklevel=3)
                result = original(self, *args, **kwargs)
                if attribute == "train_function":   # XLA's all-reduce: one ledger entry per step
                    self.train_function = counted_in_graph(self.train_function)
                return result
            force = signature.bind(self, *args, **kwargs).arguments.get("force", False)
            if getattr(self, attribute) is None or force:
                setattr(self, attribute, step.iterator_function(self, build(backend, self)))

        return make_function

    return replacement


# Global moments inside keras_mwms' sharded DataParallel step (`sharded_step`, `backends/batch_norm.py`).
_sharded_batch_norm_moments = batch_norm.moments_replacement(
    in_step=lambda layer, backend: backend.num_workers > 1 and sharded_step.tracing_sharded_batch(),
    global_moments=lambda backend, inputs, axes: sharded_step.global_moments(inputs, axes))


def _flat_train_step(backend, model):
    """Keras' jitted step split around one flat gradient all-reduce."""
    return step.make_flat_train_step(
        model, backend.collectives,
        lambda call, where="gradient all-reduce": backend.faults.guard(where, call),
        backend.all_gather, compression=backend.options.compression)


def _flat_test_step(backend, model):
    """Each worker evaluates its rows; an empty share leaves the state alone."""
    import jax

    test_step = model.test_step
    if not model.run_eagerly and model.jit_compile:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # one compile
        test_step = jax.jit(model.test_step, donate_argnums=0, in_shardings=device, out_shardings=device)
    return step.skip_empty_test_step(model, test_step)


def _global_metrics(original):
    def get_metrics_result_or_logs(self, logs, *args, **kwargs):
        """On the flat path, results come from the all-worker metric state."""
        backend = _several_workers()
        if backend is None or not backend.uses(self) or not _on_flat_path(backend, self):
            return original(self, logs, *args, **kwargs)
        with policy.GlobalMetricState(self, backend):
            metric_logs = self.get_metrics_result()
        if not logs or (isinstance(logs, dict) and set(logs) == set(metric_logs)):
            return metric_logs
        return logs

    return get_metrics_result_or_logs


_HOOKS = JaxFitHooks()

PATCHES = PatchTable("jax", [
    Patch("local-replicated-arrays", targets.JAX_DISTRIBUTE_TENSOR,
          _local_replicated_arrays, parameters=("tensor", "layout"),
          works_around="jax.device_put of a replicated variable across processes asserts equal "
                       "values (a collective): a worker creating a variable alone hangs or aborts"),
    Patch("note-new-variable", targets.VARIABLE_INITIALIZE,
          _noting_new_variables, parameters=("value",),
          works_around="no hook when a variable is created: those created in strategy.scope() "
                       "must take the chief's values at its exit"),
    Patch("note-new-variable-initializer",
          targets.VARIABLE_INITIALIZE_WITH_INITIALIZER,
          _noting_new_variables, parameters=("initializer",),
          works_around="the same for variables created from an initializer"),
    Patch("arrays-pass-through", targets.JAX_DISTRIBUTE_DATA,
          _arrays_pass_through, parameters=("data",),
          works_around="Keras re-distributes batches keras_mwms already placed as global arrays"),
    Patch("fit-global-batches", targets.TRAINER_FIT, fit_call.replacement("fit", _HOOKS),
          parameters=fit_call.PARAMETERS["fit"],
          works_around="multi-process fit refuses numpy input, hangs on uneven shards and crashes "
                       "on a partial last batch (auto-sharding needs equal local shapes)"),
    Patch("evaluate-global-batches", targets.TRAINER_EVALUATE, fit_call.replacement("evaluate", _HOOKS),
          parameters=fit_call.PARAMETERS["evaluate"],
          works_around="the same for evaluate; fit's validation reuses its cached adapter"),
    Patch("predict-local", targets.TRAINER_PREDICT, fit_call.replacement("predict", _HOOKS),
          parameters=fit_call.PARAMETERS["predict"],
          works_around="predict fails with 'Fetching value for jax.Array that spans "
                       "non-addressable devices' and would enter collectives one worker may skip"),
    Patch("predict-local-function", targets.TRAINER_MAKE_PREDICT_FUNCTION, _predict_local_function,
          parameters=("force",), works_around="the same: a local jitted predict step on one device"),
    Patch("flat-train-step", targets.TRAINER_MAKE_TRAIN_FUNCTION,
          _flat_function("train_function", _flat_train_step),
          parameters=("force",),
          works_around="XLA's fused gradient all-reduce is 1.4-6x slower than one flat all-reduce "
                       "on CPU gloo; variables set on one worker alone would drift into training"),
    Patch("sharded-batch-norm-moments", targets.BATCH_NORM_MOMENTS, _sharded_batch_norm_moments,
          parameters=("inputs", "mask"),
          works_around="the DataParallel step keras_mwms runs in shard_map (gradient accumulation, "
                       "compression) sees each device's rows: BatchNormalization needs the global "
                       "batch's moments, one psum of [sum, sum of squares]"),
    Patch("flat-test-step", targets.TRAINER_MAKE_TEST_FUNCTION,
          _flat_function("test_function", _flat_test_step),
          parameters=("force",), works_around="the flat path's evaluate: a worker may have no rows"),
    Patch("global-metrics", targets.TRAINER_METRICS_RESULT_OR_LOGS, _global_metrics,
          parameters=("logs",), works_around="flat-path metric results must come from every "
                                              "worker's state, not this worker's rows"),
])


def patch_table(backend: Any) -> PatchTable:
    """The JAX rows, the same table for every backend object of the process (`PATCHES`)."""
    return PATCHES
