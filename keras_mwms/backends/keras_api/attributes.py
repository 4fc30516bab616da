"""Private attributes keras_mwms reads, calls or sets on Keras objects, one named accessor each.

Keras keeps some state keras_mwms needs only in private attributes (a model's distribution
strategy, a BatchNormalization's reduction axes, ...). They are touched here, and only here
(optimizers' in `optimizer_attributes`), so a Keras release that renames one changes this
folder alone. `PRIVATE_NAMES` lists every such name: `tests/test_architecture.py` fails if
code outside the firewall names one. The private methods and properties are also `Target`s
(`keras_mwms.backends.keras_api.targets`), checked by `usability.require_usable` before the
workers meet; instance attributes exist only on real objects, and `tests/test_keras_api.py`
reads every accessor on small real objects of every backend that uses it.

Example:

>>> import keras
>>> layer = keras.layers.BatchNormalization()
>>> layer.build((None, 3))
>>> batch_norm_reduction_axes(layer)
[0]
>>> variable_value(layer.gamma) is not None
True
"""

from __future__ import annotations

from typing import Any

from keras_mwms.backends.keras_api import optimizer_attributes

_MODELS_LAYERS_AND_VARIABLES = {
    "_distribute_strategy": "a TensorFlow keras.Model (and epoch iterator): its tf.distribute strategy",
    "_symbolic_build": "keras.Model: builds its state from one batch",
    "_compute_loss": "keras.Model: the compiled loss (no `compute_loss` override in between)",
    "_loss_tracker": "keras.Model: the `loss` metric",
    "_compile_metrics": "keras.Model: the compiled metrics (None without)",
    "_update_metrics_variables": "keras.Model on JAX: the stateless metric update",
    "_get_metrics_result_or_logs": "keras.Model: the logs a step returns",
    "_initial_epoch": "keras.Model: the epoch `fit` starts from (set by BackupAndRestore)",
    "_use_cached_eval_dataset": "a keyword of keras.Model.evaluate: `fit`'s own validation pass",
    "_flatten_layers": "keras.layers.Layer: every layer inside it",
    "_call_has_training_arg": "keras.layers.Layer: whether `call` takes `training`",
    "_reduction_axes": "keras.layers.BatchNormalization: the axes it normalizes over",
    "_value": "keras.Variable: the backend array it holds",
    "_autocast": "keras.Variable: whether it is cast to a layer's compute dtype",
}
_DATA_ADAPTERS_AND_CALLBACKS = {
    "_first_batches": "Keras' generator data adapter: the batches it peeked",
    "_dataset": "Keras' tf.data data adapter: the dataset it wraps",
    "_standardize_batch": "Keras' PyDataset data adapter: a batch as Keras iterates it",
    "_output_signature": "Keras' PyDataset data adapter: its batches' tf.TensorSpec structure",
    "_get_file_path": "keras.callbacks.ModelCheckpoint: the path of this save",
    "_should_save_model": "keras.callbacks.ModelCheckpoint: the save decision (updates `best`)",
    "_save_model": "keras.callbacks.ModelCheckpoint: the save, which keras_mwms' subclass overrides",
    "_train_writer": "keras.callbacks.TensorBoard: the training summary writer",
}
PRIVATE_NAMES = {**_MODELS_LAYERS_AND_VARIABLES, **_DATA_ADAPTERS_AND_CALLBACKS,
                 **optimizer_attributes.PRIVATE_NAMES}
"""Every private Keras attribute name keras_mwms uses outside patch rows → the Keras object
that has it. Code outside `keras_mwms/backends/keras_api/` must not name one."""

# -- models --------------------------------------------------------------------------------


def distribute_strategy(model_or_iterator: Any) -> Any:
    """The `tf.distribute` strategy a TensorFlow model (or Keras epoch iterator) runs under."""
    return model_or_iterator._distribute_strategy


def set_distribute_strategy(model_or_iterator: Any, strategy: Any) -> None:
    """Sets the `tf.distribute` strategy a TensorFlow model (or epoch iterator) runs under."""
    model_or_iterator._distribute_strategy = strategy


def symbolic_build(model: Any, data_batch: Any) -> None:
    """Keras' build of a model's (and its optimizer's and metrics') state from one batch."""
    model._symbolic_build(data_batch=data_batch)


def compute_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Any:
    """The model's compiled loss on one batch (Keras' own, behind any `compute_loss` override)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def loss_tracker(model: Any) -> Any:
    """The compiled model's `loss` metric (a `keras.metrics.Mean`)."""
    return model._loss_tracker


def compile_metrics(model: Any) -> Any:
    """The compiled model's metrics as one Keras metric, or None where it has none."""
    return model._compile_metrics


def update_metrics_variables(model: Any, metrics_variables: list, unscaled_loss: Any, x: Any, y: Any,
                             y_pred: Any, sample_weight: Any) -> tuple[dict, list]:
    """JAX: the logs and new metric variables after one batch, computed statelessly."""
    return model._update_metrics_variables(metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)


def metrics_result_or_logs(model: Any, logs: Any) -> Any:
    """The logs a step returns: the metrics' results where `logs` holds exactly those, else `logs`."""
    return model._get_metrics_result_or_logs(logs)


def set_initial_epoch(model: Any, epoch: int) -> None:
    """Makes the model's next `fit` start at `epoch` (what Keras' BackupAndRestore sets)."""
    model._initial_epoch = epoch


def is_fit_validation(evaluate_kwargs: dict) -> bool:
    """Whether `evaluate`'s extra keyword arguments mark `fit`'s own validation pass."""
    return bool(evaluate_kwargs.get("_use_cached_eval_dataset"))


# -- layers and variables ------------------------------------------------------------------


def flatten_layers(model: Any, include_self: bool = False) -> list:
    """Every layer of `model`, nested ones included (Keras' own traversal)."""
    return list(model._flatten_layers(include_self=include_self))


def layer_trainable_variables(layer: Any) -> list:
    """The trainable variables a layer created itself (not its sublayers')."""
    return layer._trainable_variables


def call_has_training_arg(layer: Any) -> bool:
    """Whether the layer's `call` takes a `training` argument."""
    return layer._call_has_training_arg


def batch_norm_reduction_axes(layer: Any) -> list[int]:
    """The axes a built BatchNormalization normalizes over."""
    return layer._reduction_axes


def variable_value(variable: Any) -> Any:
    """The backend array a Keras variable holds, without Keras' read hooks (None before it is
    initialized)."""
    return variable._value


def set_variable_value(variable: Any, value: Any) -> None:
    """Replaces the array a Keras variable holds (JAX: a re-placed global array)."""
    variable._value = value


def variable_autocasts(variable: Any) -> bool:
    """Whether a Keras variable is cast to a layer's compute dtype when read (mixed precision)."""
    return variable._autocast


# -- data adapters -------------------------------------------------------------------------


def generator_first_batches(adapter: Any) -> list:
    """The batches Keras' generator data adapter took from the generator to learn their spec."""
    return adapter._first_batches


def tf_dataset_of(adapter: Any) -> Any:
    """The `tf.data.Dataset` Keras' tf.data data adapter wraps."""
    return adapter._dataset


def standardize_batch(adapter: Any, batch: Any) -> Any:
    """One PyDataset batch as Keras' PyDataset data adapter hands it to the model."""
    return adapter._standardize_batch(batch)


def py_dataset_output_signature(adapter: Any) -> Any:
    """The `tf.TensorSpec` structure of a PyDataset data adapter's batches (after `get_tf_dataset`)."""
    return adapter._output_signature


# -- callbacks -----------------------------------------------------------------------------


def checkpoint_file_path(callback: Any, epoch: int, batch: Any, logs: Any) -> str:
    """The path a ModelCheckpoint saves to now (its `filepath` formatted)."""
    return callback._get_file_path(epoch, batch, logs)


def checkpoint_should_save(callback: Any, epoch: int, batch: Any, logs: Any, filepath: str) -> bool:
    """A ModelCheckpoint's decision to save now (updates its `best`)."""
    return callback._should_save_model(epoch, batch, logs, filepath)


def tensorboard_train_writer(callback: Any) -> Any:
    """The TensorBoard callback's summary writer for training logs."""
    return callback._train_writer
