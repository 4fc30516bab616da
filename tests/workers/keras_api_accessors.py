"""Every accessor of the Keras firewall, resolved on small real Keras objects; one JSON report.

Usage: `KERAS_BACKEND=torch python tests/workers/keras_api_accessors.py`. Builds a compiled
model (Dense, BatchNormalization, Adam with gradient accumulation), fits it two steps with
validation data, then calls each accessor of `keras_mwms.backends.keras_api.attributes` and
`optimizer_attributes` that keras_mwms uses on this backend and checks what it returns. Prints
`ACCESSORS {"keras": ..., "checked": {name: "ok" or the error}, "accessors": [...],
"missing_names": [...]}`: `accessors` is every public function of the two modules, so the test
sees one that no check covers.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import traceback

import keras
import numpy as np

from keras_mwms.backends.keras_api import attributes, internals, optimizer_attributes, usability

BACKEND = keras.backend.backend()
ALL = ("tensorflow", "jax", "torch")
CHECKS: dict[str, tuple[tuple[str, ...], callable]] = {}


def check(*names: str, backends: tuple[str, ...] = ALL):
    """Registers a check covering the accessors `names` on `backends`."""
    def register(function):
        for name in names:
            CHECKS[name] = (backends, function)
        return function
    return register


def numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value))


class World:
    """The objects every check reads: built once per process."""

    def __init__(self):
        keras.utils.set_random_seed(1)
        self.x, self.y = np.random.rand(8, 3).astype("float32"), np.random.rand(8, 1).astype("float32")
        self.model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                                       keras.layers.Dense(1)])
        self.model.compile(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2), loss="mse",
                           metrics=["mae"])
        self.evaluate_kwargs = []
        evaluate = self.model.evaluate

        def recording_evaluate(*args, **kwargs):
            self.evaluate_kwargs.append(dict(kwargs))
            return evaluate(*args, **kwargs)

        self.model.evaluate = recording_evaluate
        self.model.fit(self.x, self.y, batch_size=4, epochs=1, validation_data=(self.x, self.y), verbose=0)
        self.optimizer = self.model.optimizer
        self.dense = self.model.layers[0]
        self.batch_norm = self.model.layers[1]


WORLD: World | None = None


def world() -> World:
    global WORLD
    if WORLD is None:
        WORLD = World()
    return WORLD


# -- models ----------------------------------------------------------------------------------

@check("distribute_strategy", "set_distribute_strategy", backends=("tensorflow",))
def _distribute_strategy():
    model, marker = world().model, object()
    saved = attributes.distribute_strategy(model)
    attributes.set_distribute_strategy(model, marker)
    assert attributes.distribute_strategy(model) is marker and model.distribute_strategy is marker
    attributes.set_distribute_strategy(model, saved)


@check("symbolic_build", backends=("tensorflow",))
def _symbolic_build():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    attributes.symbolic_build(model, (world().x[:2], world().y[:2]))
    assert model.optimizer.built and model.compiled


@check("compute_loss", "loss_tracker", "compile_metrics", "call_has_training_arg", backends=("torch",))
def _torch_train_step_state():
    w = world()
    y_pred = w.model(w.x, training=False)
    loss = attributes.compute_loss(w.model, x=w.x, y=w.y, y_pred=y_pred, sample_weight=None, training=False)
    expected = np.mean((numpy(y_pred) - w.y) ** 2)
    assert np.allclose(numpy(loss), expected, rtol=1e-5), (numpy(loss), expected)
    assert isinstance(attributes.loss_tracker(w.model), keras.metrics.Mean)
    assert "mae" in attributes.compile_metrics(w.model).result()
    assert attributes.call_has_training_arg(w.model) is True


@check("update_metrics_variables", backends=("jax",))
def _update_metrics_variables():
    w = world()
    y_pred = w.model(w.x)
    metrics = [variable.value for variable in w.model.metrics_variables]
    logs, new_metrics = attributes.update_metrics_variables(w.model, metrics, keras.ops.mean(y_pred), w.x, w.y,
                                                            y_pred, None)
    assert {"loss", "mae"} <= set(logs) and len(new_metrics) == len(metrics)


@check("metrics_result_or_logs", backends=("jax", "torch"))
def _metrics_result_or_logs():
    model = world().model
    assert attributes.metrics_result_or_logs(model, {"other": 1.0}) == {"other": 1.0}
    results = model.get_metrics_result()
    assert set(attributes.metrics_result_or_logs(model, results)) == set(results)


@check("set_initial_epoch")
def _set_initial_epoch():
    w = world()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    attributes.set_initial_epoch(model, 1)
    history = model.fit(w.x, w.y, epochs=2, verbose=0)
    assert history.epoch == [1], history.epoch


@check("is_fit_validation")
def _is_fit_validation():
    recorded = world().evaluate_kwargs
    assert recorded and attributes.is_fit_validation(recorded[0]), recorded
    assert not attributes.is_fit_validation({})


# -- layers and variables ------------------------------------------------------------------

@check("flatten_layers", "layer_trainable_variables", "variable_autocasts", "batch_norm_reduction_axes")
def _layers():
    w = world()
    assert {id(layer) for layer in w.model.layers} <= {id(layer) for layer in attributes.flatten_layers(w.model)}
    assert [id(v) for v in attributes.layer_trainable_variables(w.dense)] == [id(w.dense.kernel), id(w.dense.bias)]
    assert attributes.variable_autocasts(w.dense.kernel) is True
    assert attributes.batch_norm_reduction_axes(w.batch_norm) == [0]


@check("variable_value", "set_variable_value")
def _variable_value():
    variable = keras.Variable(np.arange(3, dtype="float32"))
    value = attributes.variable_value(variable)
    assert np.array_equal(numpy(value), [0, 1, 2])
    attributes.set_variable_value(variable, keras.ops.convert_to_tensor(np.ones(3, "float32")))
    assert np.array_equal(numpy(variable.value), [1, 1, 1])


# -- data adapters and callbacks (Keras' classes, the same on every backend; used on TensorFlow) --

@check("generator_first_batches", "tf_dataset_of", "standardize_batch", "py_dataset_output_signature",
       backends=("tensorflow",))
def _data_adapters():
    import tensorflow as tf

    w = world()

    def batches():
        while True:
            yield w.x[:2], w.y[:2]

    first = attributes.generator_first_batches(internals.generator_adapter_class()(batches()))
    assert np.array_equal(first[0][0], w.x[:2])
    dataset = tf.data.Dataset.from_tensor_slices((w.x, w.y)).batch(4)
    assert attributes.tf_dataset_of(internals.tf_dataset_adapter_class()(dataset)) is dataset

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return w.x[:2], w.y[:2]

    adapter = internals.py_dataset_adapter_class()(Batches(), shuffle=False)
    assert len(attributes.standardize_batch(adapter, (w.x[:2], w.y[:2]))) == 2
    adapter.get_tf_dataset()
    assert attributes.py_dataset_output_signature(adapter)[0].shape[-1] == 3


@check("checkpoint_file_path", "checkpoint_should_save")
def _model_checkpoint():
    with tempfile.TemporaryDirectory() as directory:
        callback = keras.callbacks.ModelCheckpoint(os.path.join(directory, "model_{epoch}.keras"))
        callback.set_model(world().model)
        path = attributes.checkpoint_file_path(callback, 0, None, {"loss": 1.0})
        assert path == os.path.join(directory, "model_1.keras"), path
        assert attributes.checkpoint_should_save(callback, 0, None, {"loss": 1.0}, path) is True


@check("tensorboard_train_writer", backends=("tensorflow",))
def _tensorboard():
    with tempfile.TemporaryDirectory() as directory:
        callback = keras.callbacks.TensorBoard(directory)
        callback.set_model(world().model)
        with attributes.tensorboard_train_writer(callback).as_default():
            pass


# -- optimizers ------------------------------------------------------------------------------

@check("iterations_variable", "accumulated_gradients", "variable_index", "accumulator_of", "trainable_variables")
def _accumulation_state():
    w = world()
    optimizer, variables = w.optimizer, w.model.trainable_variables
    counter = optimizer_attributes.iterations_variable(optimizer)
    assert any(counter is variable for variable in optimizer.variables)
    assert int(numpy(counter.value)) == 2                         # two micro-steps, one update
    assert len(optimizer_attributes.accumulated_gradients(optimizer)) == len(variables)
    assert optimizer_attributes.accumulated_gradients(keras.optimizers.SGD()) == []
    assert sorted(optimizer_attributes.variable_index(optimizer, v) for v in variables) == list(range(len(variables)))
    assert all(tuple(optimizer_attributes.accumulator_of(optimizer, v).shape) == tuple(v.shape) for v in variables)
    assert [id(v) for v in optimizer_attributes.trainable_variables(optimizer)] == [id(v) for v in variables]


@check("adam_momentums", "adam_velocities", backends=("torch",))
def _adam_slots():
    w = world()
    optimizer = w.optimizer
    for slots in (optimizer_attributes.adam_momentums(optimizer), optimizer_attributes.adam_velocities(optimizer)):
        assert [tuple(slot.shape) for slot in slots] == [tuple(v.shape) for v in w.model.trainable_variables]


@check("clip_gradients", "apply_weight_decay", "backend_update_step", "reset_gradient_accumulators",
       backends=("tensorflow",))
def _update_steps():
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.5, clipnorm=1.0)
    optimizer.build([variable])
    clipped = optimizer_attributes.clip_gradients(optimizer, [keras.ops.convert_to_tensor([30.0, 40.0])])
    assert np.allclose(numpy(clipped[0]), [0.6, 0.8])
    optimizer_attributes.apply_weight_decay(optimizer, [variable])
    assert np.allclose(numpy(variable.value), [0.95, 0.95])
    sgd = keras.optimizers.SGD(learning_rate=0.1, gradient_accumulation_steps=2)
    sgd.build([variable])
    optimizer_attributes.backend_update_step(sgd, [keras.ops.ones(2)], [variable], sgd.learning_rate)
    assert np.allclose(numpy(variable.value), [0.85, 0.85])
    optimizer_attributes.accumulator_of(sgd, variable).assign(np.ones(2, "float32"))
    optimizer_attributes.reset_gradient_accumulators(sgd)
    assert not numpy(optimizer_attributes.accumulator_of(sgd, variable).value).any()


@check("distribution_strategy", backends=("tensorflow",))
def _optimizer_strategy():
    import tensorflow as tf

    assert optimizer_attributes.distribution_strategy(world().optimizer) is tf.distribute.get_strategy()


@check("handle_finite_grads", "handle_non_finite_grads", backends=("tensorflow",))
def _loss_scale_steps():
    variable = keras.Variable(np.ones(2, "float32"))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0), initial_scale=4.0)
    optimizer.build([variable])
    optimizer_attributes.handle_finite_grads(optimizer, [keras.ops.ones(2) * 4.0], [variable])
    assert np.allclose(numpy(variable.value), [0.0, 0.0])      # unscaled by 4, then one SGD step
    optimizer_attributes.handle_non_finite_grads(optimizer)
    assert float(numpy(optimizer.dynamic_scale)) == 2.0


def main() -> None:
    checked = {}
    for name, (backends, function) in CHECKS.items():
        if BACKEND not in backends:
            continue
        try:
            function()
            checked[name] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test
            checked[name] = traceback.format_exc()[-1500:]
    accessors = sorted(name for module in (attributes, optimizer_attributes)
                       for name, value in vars(module).items()
                       if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_"))
    declared = {name: list(backends) for name, (backends, _) in CHECKS.items()}
    print("ACCESSORS " + json.dumps({"keras": keras.__version__, "checked": checked, "accessors": accessors,
                                     "declared": declared, "missing_names": usability.missing_names(BACKEND)}))


if __name__ == "__main__":
    main()
