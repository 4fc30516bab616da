"""Backend adapters: everything that touches TensorFlow, JAX, torch or Keras internals.

One module per Keras backend, each defining a `Backend` subclass (see `base.py` for the
common interface). Private Keras patches live only here, each named, commented with its
upstream issue and guarded by `base.require_tested_keras`.
"""

from __future__ import annotations

import importlib

from keras_mwms.backends.base import Backend

_MODULES = {
    "tensorflow": ("keras_mwms.backends.tensorflow", "TensorFlowBackend"),
    "jax": ("keras_mwms.backends.jax", "JaxBackend"),
    "torch": ("keras_mwms.backends.torch", "TorchBackend"),
}


def backend_class(name: str) -> type[Backend]:
    """The `Backend` subclass for a Keras backend name; `ValueError` for unsupported ones.

    Example:

    >>> backend_class("numpy")
    Traceback (most recent call last):
    ...
    ValueError: keras_mwms supports the Keras backends jax, tensorflow, torch; this process uses 'numpy'. Set KERAS_BACKEND to one of them before importing keras.
    """
    if name not in _MODULES:
        raise ValueError(
            f"keras_mwms supports the Keras backends {', '.join(sorted(_MODULES))}; this process "
            f"uses {name!r}. Set KERAS_BACKEND to one of them before importing keras."
        )
    module_name, class_name = _MODULES[name]
    return getattr(importlib.import_module(module_name), class_name)
