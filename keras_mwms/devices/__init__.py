"""Devices: the accelerators and cores a worker computes on, decided before any engine starts.

This module: the local accelerators of the active Keras backend, read without starting a
cluster. `assignment`: which GPUs each worker trains on (pure rules, no ML framework).
`threads`: the host's cores split among the cluster's workers on this host.
"""

from __future__ import annotations

import os

from keras_mwms import settings


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
    if name == "jax":
        import jax

        try:
            return len(jax.devices("gpu"))
        except RuntimeError:
            return 0
    return local_gpu_count_of(name)


# backend -> (the module Keras imports, the keras_mwms extra that installs it)
BACKEND_PACKAGES = {"tensorflow": ("tensorflow", "tensorflow-cpu"), "jax": ("jax", "jax"),
                    "torch": ("torch", "torch")}


def missing_backend_error(environ=None, find_spec=None) -> ModuleNotFoundError | None:
    """The error for a configured backend whose package is not installed, else None.

    Example:

    >>> print(missing_backend_error({"KERAS_BACKEND": "torch"}, find_spec=lambda name: None))
    KERAS_BACKEND is 'torch', but the torch package is not installed: pip install "keras_mwms[torch]" (or choose an installed backend with KERAS_BACKEND)
    >>> missing_backend_error({"KERAS_BACKEND": "jax"}, find_spec=lambda name: object()) is None
    True
    """
    import importlib.util

    environ = os.environ if environ is None else environ
    name = configured_backend_name(environ)
    if name not in BACKEND_PACKAGES:
        return None
    module, extra = BACKEND_PACKAGES[name]
    if (find_spec or importlib.util.find_spec)(module) is not None:
        return None
    where = "KERAS_BACKEND is" if environ.get("KERAS_BACKEND") else "Keras' configured backend (keras.json) is"
    return ModuleNotFoundError(
        f"{where} {name!r}, but the {module} package is not installed: pip install "
        f'"keras_mwms[{extra}]" (or choose an installed backend with KERAS_BACKEND)', name=module)


LOCAL_WORKERS_ENV = settings.LOCAL_WORKERS.name


def threads_per_worker(workers: int | None = None, cores: int | None = None) -> int:
    """CPU threads for one worker process: cores ÷ workers on this host, at least 1.

    `workers` defaults to `KERAS_MWMS_LOCAL_WORKERS` (set by the launcher), else 1.
    Oversubscribed cores made synchronous training several times slower in our probes.

    Example:

    >>> threads_per_worker(2, cores=2), threads_per_worker(1, cores=2), threads_per_worker(4, cores=2)
    (1, 2, 1)
    """
    workers = settings.LOCAL_WORKERS.fill(workers)
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, workers))


# -- GPUs: what this process sees, which it uses, and who they are ---------------------------

NVIDIA_SMI_TIMEOUT_SECONDS = 10.0
_assignments: dict = {}


def nvidia_smi_gpus(timeout: float = NVIDIA_SMI_TIMEOUT_SECONDS) -> list[tuple[str, str]]:
    """`(index, UUID)` of every physical GPU `nvidia-smi -L` lists; [] without nvidia-smi.

    Reads the driver only: no CUDA context, no ML framework. MIG instances are not listed.

    Example:

    >>> isinstance(nvidia_smi_gpus(), list)
    True
    """
    import re
    import subprocess

    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return []
    if listed.returncode != 0:
        return []
    found = []
    for line in listed.stdout.splitlines():
        match = re.match(r"GPU (\d+):.*\(UUID: ([^)]+)\)", line.strip())
        if match:
            found.append((match.group(1), match.group(2)))
    return found


def visible_gpu_names(environ=None) -> list[str]:
    """This host's visible GPUs as `CUDA_VISIBLE_DEVICES` names them (indices or UUIDs).

    `CUDA_VISIBLE_DEVICES` when set (empty or -1: none), else nvidia-smi's indices. The
    launcher splits these among its workers.

    Example:

    >>> visible_gpu_names({"CUDA_VISIBLE_DEVICES": "2, 3"}), visible_gpu_names({"CUDA_VISIBLE_DEVICES": "-1"})
    (['2', '3'], [])
    """
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        names = [name.strip() for name in listed.split(",") if name.strip()]
        # CUDA stops at the first invalid entry; -1 is the usual way to hide every GPU.
        return [] if not names or names[0] == "-1" else names
    return [index for index, _ in nvidia_smi_gpus()]


def visible_gpu_identities(environ=None) -> list[str]:
    """A host-independent identity per GPU this process sees, in CUDA's order: its UUID.

    A `CUDA_VISIBLE_DEVICES` entry that is a UUID (`GPU-…`, `MIG-…`) is its own identity; an
    index is looked up in `nvidia-smi -L` (CUDA numbers GPUs as nvidia-smi does when
    `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and on nodes of identical GPUs), else it becomes
    `<host>/gpu<index>`, which still tells two workers of one host apart.

    Example:

    >>> visible_gpu_identities({"CUDA_VISIBLE_DEVICES": "GPU-5d2c,MIG-77"})
    ['GPU-5d2c', 'MIG-77']
    """
    import socket

    environ = os.environ if environ is None else environ
    uuids = dict(nvidia_smi_gpus())
    identities = []
    for name in visible_gpu_names(environ):
        if name.startswith(("GPU-", "MIG-")):
            identities.append(name)
        else:
            identities.append(uuids.get(name) or f"{socket.gethostname()}/gpu{name}")
    return identities


# The CUDA/ROCm plugins of jaxlib releases (jax[cuda12], jax[cuda13], ROCm), either layout.
JAX_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin",
                   "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13", "jax_plugins.xla_rocm7")


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # a missing parent package
        return False


def jax_gpu_count_before_start(environ=None) -> int:
    """GPUs a JAX worker will see, judged without starting JAX (that must wait for `jax.distributed`).

    0 without a CUDA/ROCm plugin, with `JAX_PLATFORMS` excluding GPUs, or with
    `CUDA_VISIBLE_DEVICES` hiding them; else the visible GPUs (nvidia-smi), at least 1.

    Example:

    >>> jax_gpu_count_before_start({"JAX_PLATFORMS": "cpu"})
    0
    """
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(name in platforms for name in ("cuda", "gpu", "rocm")):
        return 0
    if environ.get("CUDA_VISIBLE_DEVICES") is not None and not visible_gpu_names(environ):
        return 0
    if not any(_module_exists(name) for name in JAX_GPU_PLUGINS):
        return 0
    return max(1, len(visible_gpu_names(environ)))


def visible_gpu_count(backend: str) -> int:
    """GPUs `backend` sees in this process, read without starting any collective engine.

    Example:

    >>> visible_gpu_count("numpy")
    0
    """
    if backend == "jax":
        return jax_gpu_count_before_start()
    if backend in ("torch", "tensorflow"):
        return local_gpu_count_of(backend)
    return 0


def local_gpu_count_of(backend: str) -> int:
    """`local_gpu_count()` for a named backend (torch and TensorFlow only read, never start).

    Example:

    >>> local_gpu_count_of("numpy")
    0
    """
    if backend == "torch":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "tensorflow":
        import tensorflow as tf

        return len(tf.config.list_physical_devices("GPU"))
    return 0


def gpu_assignment(backend: str, workers: int):
    """This worker's `keras_mwms.devices.assignment.GpuAssignment`, from its environment; one per process.

    Every backend adapter and the rendezvous ask here, so they agree.

    Example:

    >>> gpu_assignment("numpy", 2).gpus
    ()
    """
    from keras_mwms.devices import assignment as rules

    keys = (*rules.LOCAL_RANK_VARIABLES, rules.GPUS_PER_WORKER_ENV, "CUDA_VISIBLE_DEVICES")
    key = (backend, workers, tuple(os.environ.get(name) for name in keys))
    if key not in _assignments:
        _assignments[key] = rules.assign_gpus(backend, visible_gpu_count(backend), workers, os.environ)
    return _assignments[key]


def worker_identity(backend: str, workers: int) -> dict:
    """`{"host": …, "gpus": [identity of each GPU this worker trains on]}` for the rendezvous.

    `KERAS_MWMS_FAKE_GPU_UUIDS` (test-only) replaces the GPU list, so a CPU machine can
    exercise the same-GPU check.

    Example:

    >>> from unittest import mock
    >>> with mock.patch.dict("os.environ", {"KERAS_MWMS_FAKE_GPU_UUIDS": "GPU-1,GPU-2"}):
    ...     worker_identity("numpy", 2)["gpus"]
    ['GPU-1', 'GPU-2']
    """
    import socket


    fake = settings.FAKE_GPU_UUIDS.read()
    if fake is not None:
        gpus = [name.strip() for name in fake.split(",") if name.strip()]
    else:
        assignment = gpu_assignment(backend, workers)
        identities = visible_gpu_identities() if assignment.gpus else []
        if backend == "torch" and assignment.gpus and len(identities) < assignment.visible:
            identities = _torch_gpu_identities(assignment.visible)
        gpus = [identities[index] if index < len(identities) else f"{socket.gethostname()}/cuda:{index}"
                for index in assignment.gpus]
    return {"host": socket.gethostname(), "gpus": gpus}


def _torch_gpu_identities(count: int) -> list[str]:
    """torch's own UUIDs (`get_device_properties(i).uuid`), where nvidia-smi is missing."""
    import torch

    identities = []
    for index in range(count):
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        identities.append(f"GPU-{uuid}" if uuid is not None else "")
    return identities if all(identities) else []


def configured_backend_name(environ=None) -> str:
    """The Keras backend a new process will use, read without importing Keras (for the launcher).

    `KERAS_BACKEND`, else `backend` in `$KERAS_HOME/keras.json` (default `~/.keras`), else
    Keras' default, "tensorflow".

    Example:

    >>> configured_backend_name({"KERAS_BACKEND": "jax"})
    'jax'
    """
    import json

    environ = os.environ if environ is None else environ
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    home = environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as file:
            return json.load(file).get("backend") or "tensorflow"
    except (OSError, ValueError, AttributeError):
        return "tensorflow"
