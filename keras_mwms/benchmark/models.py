"""The benchmark's model family and data, identical across Keras 3, tf-keras and torch.nn.

* `mlp`: `features` → `depth` × Dense(`width`, relu) → Dense(`classes`) logits.
* `conv`: a small image net — Conv(16, 3×3, relu) → Conv(32, 3×3, relu) → global average
  pool → Dense(`classes`), on `image_size`² × 3 images (channels last in Keras; torch gets
  the same tensors permuted to channels first).

All are trained with Adam(1e-3) on sparse softmax cross-entropy from logits. Backend modules
are imported inside the functions: the driver process never imports a backend.
"""

from __future__ import annotations

import numpy as np

from keras_mwms.benchmark.config import BenchmarkConfig

LEARNING_RATE = 1e-3


def input_shape(config: BenchmarkConfig, model_name: str) -> tuple[int, ...]:
    """One example's shape (channels last for `conv`).

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> input_shape(quick_config(), "mlp"), input_shape(quick_config(), "conv")
    ((64,), (16, 16, 3))
    """
    if model_name == "mlp":
        return (config.features,)
    if model_name == "conv":
        return (config.image_size, config.image_size, 3)
    raise ValueError(f"unknown benchmark model {model_name!r}; expected 'mlp' or 'conv'")


def synthetic_data(config: BenchmarkConfig, model_name: str, seed: int = 123) -> tuple[np.ndarray, np.ndarray]:
    """`steps × global_batch` examples and integer labels, the same on every worker.

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> x, y = synthetic_data(quick_config(steps=2, global_batch=8), "mlp")
    >>> x.shape, y.shape, x.dtype.name, y.dtype.name
    ((16, 64), (16,), 'float32', 'int64')
    """
    rng = np.random.default_rng(seed)
    rows = config.steps * config.global_batch
    x = rng.standard_normal((rows, *input_shape(config, model_name))).astype("float32")
    projection = rng.standard_normal((int(np.prod(x.shape[1:])), config.classes)).astype("float32")
    y = (x.reshape(rows, -1) @ projection).argmax(axis=1).astype("int64")
    return x, y


def parameter_count(config: BenchmarkConfig, model_name: str) -> int:
    """Trainable parameters (= float32 gradient elements all-reduced per step).

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> parameter_count(quick_config(width=4, depth=2, features=3, classes=2), "mlp")
    46
    """
    if model_name == "mlp":
        widths = [config.features] + [config.width] * config.depth + [config.classes]
        return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
    if model_name == "conv":
        return (3 * 3 * 3 * 16 + 16) + (3 * 3 * 16 * 32 + 32) + (32 * config.classes + config.classes)
    raise ValueError(f"unknown benchmark model {model_name!r}; expected 'mlp' or 'conv'")


def build_keras_model(keras_module, config: BenchmarkConfig, model_name: str):
    """The compiled model in `keras_module` (Keras 3's `keras` or Keras 2's `tf_keras`)."""
    layers = keras_module.layers
    body = [keras_module.Input(input_shape(config, model_name))]
    if model_name == "mlp":
        body += [layers.Dense(config.width, activation="relu") for _ in range(config.depth)]
    else:
        body += [layers.Conv2D(16, 3, activation="relu"), layers.Conv2D(32, 3, activation="relu"),
                 layers.GlobalAveragePooling2D()]
    model = keras_module.Sequential(body + [layers.Dense(config.classes)])
    model.compile(optimizer=keras_module.optimizers.Adam(LEARNING_RATE),
                  loss=keras_module.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build_torch_model(config: BenchmarkConfig, model_name: str):
    """The same network as `build_keras_model`, in torch.nn (channels first for `conv`)."""
    from torch import nn

    if model_name == "mlp":
        layers, width = [], config.features
        for _ in range(config.depth):
            layers += [nn.Linear(width, config.width), nn.ReLU()]
            width = config.width
        return nn.Sequential(*layers, nn.Linear(width, config.classes))
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, config.classes))
