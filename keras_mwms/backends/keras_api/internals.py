"""Keras' private functions and classes keras_mwms calls, one named function each.

Outside this folder keras_mwms never names a `keras.src` module: it calls these, and they
resolve their `Target` (`keras_mwms.backends.keras_api.targets`) when called, so importing
keras_mwms imports no private Keras module.

Example:

>>> import numpy as np
>>> unpack_x_y_sample_weight((np.zeros(2), np.ones(2)))[2] is None
True
>>> can_convert_arrays((np.zeros(2), None, None)), is_data_adapter(np.zeros(2))
(True, False)
"""

from __future__ import annotations

from typing import Any

from keras_mwms.backends.keras_api import targets


def trainer_class() -> type:
    """The backend's trainer class (`TensorFlowTrainer`, `JAXTrainer`, `TorchTrainer`, or
    `Trainer` on 3.16): the class of `keras.Model` defining `make_train_function`."""
    return targets.TRAINER_FIT.resolve()[0]


def keras_own_train_step(model: Any) -> bool:
    """Whether `model` trains with the backend trainer's own `train_step`."""
    return type(model).train_step is targets.TRAINER_TRAIN_STEP.get()


def keras_own_test_step(model: Any) -> bool:
    """Whether `model` evaluates with the backend trainer's own `test_step`."""
    return type(model).test_step is targets.TRAINER_TEST_STEP.get()


def keras_own_compute_metrics(model: Any) -> bool:
    """Whether `model` keeps Keras' own `compute_metrics`."""
    return type(model).compute_metrics is targets.BASE_TRAINER_COMPUTE_METRICS.get()


def unpack_x_y_sample_weight(data: Any) -> tuple:
    """Keras' `(x, y, sample_weight)` of a batch."""
    return targets.UNPACK_X_Y_SAMPLE_WEIGHT.get()(data)


def class_weight_to_sample_weights(y: Any, class_weight: dict) -> Any:
    """Keras' per-row sample weights for `class_weight`."""
    return targets.CLASS_WEIGHT_TO_SAMPLE_WEIGHTS.get()(y, class_weight)


def train_validation_split(arrays: tuple, validation_split: float) -> tuple:
    """Keras' split of arrays into training and validation parts (the last rows validate)."""
    return targets.TRAIN_VALIDATION_SPLIT.get()(arrays, validation_split=validation_split)


def can_convert_arrays(arrays: tuple) -> bool:
    """Whether Keras reads `arrays` with its array adapter (NumPy, tensors, ...)."""
    return targets.CAN_CONVERT_ARRAYS.get()(arrays)


def get_data_adapter(*args: Any, **kwargs: Any) -> Any:
    """Keras' data adapter for fit/evaluate/predict's inputs."""
    return targets.GET_DATA_ADAPTER.get()(*args, **kwargs)


def data_adapter_class() -> type:
    """Keras' base class of data adapters (to subclass)."""
    return targets.DATA_ADAPTER.get()


def is_data_adapter(value: Any) -> bool:
    return isinstance(value, targets.DATA_ADAPTER.get())


def array_data_adapter(*args: Any, **kwargs: Any) -> Any:
    """Keras' `ArrayDataAdapter(x, y, sample_weight, batch_size=..., shuffle=...)`."""
    return targets.ARRAY_DATA_ADAPTER.get()(*args, **kwargs)


def py_dataset_adapter_class() -> type:
    """Keras' adapter of a `keras.utils.PyDataset`."""
    return targets.PY_DATASET_ADAPTER.get()


def generator_adapter_class() -> type:
    """Keras' adapter of a Python generator (TensorFlow)."""
    return targets.GENERATOR_ADAPTER.get()


def tf_dataset_adapter_class() -> type:
    """Keras' adapter of a `tf.data.Dataset` (TensorFlow)."""
    return targets.TF_DATASET_ADAPTER.get()


def in_stateless_scope() -> bool:
    """Whether Keras is inside a `keras.StatelessScope`."""
    return targets.IN_STATELESS_SCOPE.get()()


def is_in_jax_tracing_scope(value: Any = None) -> bool:
    """Whether `value` is being traced by JAX (Keras' own test)."""
    return targets.IS_IN_JAX_TRACING_SCOPE.get()(value)


def tf_collective_multi_worker(strategy: Any) -> bool:
    """Whether Keras' TensorFlow trainer takes `strategy` for a multi-worker collective one."""
    return targets.TF_COLLECTIVE_MULTI_WORKER.get()(strategy)


def torch_adam_class() -> type:
    """Keras' torch Adam (AdamW subclasses it): the class `keras.optimizers.Adam` becomes on torch."""
    return targets.TORCH_ADAM_CLASS.get()
