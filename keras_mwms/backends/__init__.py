"""Backend adapters: everything that touches TensorFlow, JAX, torch or Keras internals.

One subpackage per Keras backend (`tensorflow`, `jax`, `torch`), each defining a `Backend`
subclass of `base.Backend` (the engine interface and its collective port) and its private
Keras patches as one `patches.PatchTable`: every row named, with the upstream issue it works
around and the Keras releases it was tested on. What is the same on every backend lives once,
in `policy` (row checks, dummy rows, metric reduction, lost-worker message and exit) and
`faults` (how every backend finds and reports a lost worker, each supplying a small hook).
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
