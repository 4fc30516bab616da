"""Local accelerators of the active Keras backend, read without starting a cluster."""

from __future__ import annotations

import os


def backend_name() -> str:
    """The Keras backend this process uses (`KERAS_BACKEND`, else Keras' configured one).

    Example:

    >>> from unittest import mock
    >>> with mock.patch.dict("os.environ", {"KERAS_BACKEND": "torch"}):
    ...     backend_name()
    'torch'
    """
    name = os.environ.get("KERAS_BACKEND")
    if name:
        return name
    import keras

    return keras.backend.backend()


def local_gpu_count() -> int:
    """How many GPUs this process's backend can see; 0 on a CPU-only machine.

    Example:

    >>> from unittest import mock
    >>> with mock.patch.dict("os.environ", {"KERAS_BACKEND": "numpy"}):   # no accelerators
    ...     local_gpu_count()
    0
    """
    name = backend_name()
    if name == "torch":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "jax":
        import jax

        try:
            return len(jax.devices("gpu"))
        except RuntimeError:
            return 0
    if name == "tensorflow":
        import tensorflow as tf

        return len(tf.config.list_physical_devices("GPU"))
    return 0


LOCAL_WORKERS_ENV = "KERAS_MWMS_LOCAL_WORKERS"


def threads_per_worker(workers: int | None = None, cores: int | None = None) -> int:
    """CPU threads for one worker process: cores ÷ workers on this host, at least 1.

    `workers` defaults to `KERAS_MWMS_LOCAL_WORKERS` (set by the launcher), else 1.
    Oversubscribed cores made synchronous training several times slower in our probes.

    Example:

    >>> threads_per_worker(2, cores=2), threads_per_worker(1, cores=2), threads_per_worker(4, cores=2)
    (1, 2, 1)
    """
    if workers is None:
        try:
            workers = int(os.environ.get(LOCAL_WORKERS_ENV, "1"))
        except ValueError:
            workers = 1
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, workers))
