"""The native peers keras_mwms is compared with, each on the same model, data and global batch.

| backend    | peer variant            | what users would run instead of keras_mwms                     |
|------------|-------------------------|----------------------------------------------------------------|
| tensorflow | `keras3+tf.distribute`  | Keras 3 + `tf.distribute.MultiWorkerMirroredStrategy`, with only the two Keras 3.15.1 crash fixes (`backend_class("tensorflow").crash_repairs()`) |
| tensorflow | `tf-keras+tf.distribute`| tf-keras 2.21 (legacy Keras 2) + `tf.distribute.MultiWorkerMirroredStrategy` |
| jax        | `keras.DataParallel`    | Keras' own `fit` (unpatched) under `keras.distribution.DataParallel`, each process feeding its shard |
| jax        | `keras_mwms DataParallel path` | keras_mwms' `fit` with the model pinned to its previous (pre-flat) path: `KERAS_MWMS_JAX_PATH=dataparallel` behaviour |
| torch      | `torch DDP loop`        | a hand-written `DistributedDataParallel` loop on the equivalent torch.nn model |
| torch      | `torch DDP + torch.compile`, `keras-nightly DataParallel`, `plain Keras` | the same loop compiled, Keras' own torch DDP, Keras alone (`keras_mwms.benchmark.torch_variants`) |

With one process every peer runs without any strategy (plain Keras, plain tf-keras, a plain
torch loop), which is the single-process baseline.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from keras_mwms.benchmark.config import BenchmarkConfig
from keras_mwms.benchmark.fit import timed_keras_fit
from keras_mwms.benchmark.models import LEARNING_RATE, build_keras_model, build_torch_model
from keras_mwms.benchmark.timing import FitTiming

KERAS3_TF_DISTRIBUTE = "keras3+tf.distribute"
TF_KERAS_TF_DISTRIBUTE = "tf-keras+tf.distribute"
JAX_DATA_PARALLEL = "keras.DataParallel"
JAX_KERAS_MWMS_DATA_PARALLEL = "keras_mwms DataParallel path"
TORCH_DDP_LOOP = "torch DDP loop"
TORCH_DDP_COMPILED = "torch DDP + torch.compile"
KERAS_NIGHTLY = "keras-nightly DataParallel"   # its gang: keras_mwms.benchmark.torch_variants
PLAIN_KERAS = "plain Keras"                    # one process, torch
PEERS = {"tensorflow": (KERAS3_TF_DISTRIBUTE, TF_KERAS_TF_DISTRIBUTE),
         "jax": (JAX_DATA_PARALLEL, JAX_KERAS_MWMS_DATA_PARALLEL),
         "torch": (TORCH_DDP_LOOP, TORCH_DDP_COMPILED, KERAS_NIGHTLY, PLAIN_KERAS)}


def tensorflow_native_strategy(workers: int):
    """`tf.distribute.MultiWorkerMirroredStrategy()` from TF_CONFIG with only the crash fixes; None alone."""
    if workers == 1:
        return None
    import tensorflow as tf

    from keras_mwms.backends import backend_class

    # Only the two Keras 3.15.1 crash fixes (keras-team/keras#20585), none of keras_mwms' wrappers.
    backend_class("tensorflow").crash_repairs().install()
    return tf.distribute.MultiWorkerMirroredStrategy()


def tensorflow_peer_fit(variant: str, tf_strategy, config: BenchmarkConfig, model_name: str, repeat: int,
                        x, y) -> FitTiming:
    """Keras 3 or tf-keras `fit` of the global arrays under `tf_strategy` (or none), timed."""
    if variant == KERAS3_TF_DISTRIBUTE:
        import keras as keras_module
    else:
        import tf_keras as keras_module

    def build():
        with tf_strategy.scope() if tf_strategy is not None else contextlib.nullcontext():
            return build_keras_model(keras_module, config, model_name)

    def fit(model, callbacks):
        model.fit(x, y, batch_size=config.global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)

    return timed_keras_fit(keras_module, variant, model_name, repeat, config, build, fit)


def local_rows(config: BenchmarkConfig, rows: int, workers: int, worker_index: int) -> np.ndarray:
    """This worker's rows of every global batch, in step order (keras_mwms' split rule).

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> local_rows(quick_config(global_batch=4), 8, 2, 1).tolist()
    [2, 3, 6, 7]
    """
    from keras_mwms.data import worker_row_indices

    return np.concatenate(worker_row_indices(rows, config.global_batch, workers, worker_index))


def jax_data_parallel_fit(strategy, config: BenchmarkConfig, model_name: str, repeat: int, x, y) -> FitTiming:
    """Keras' own, unpatched `fit` under the `DataParallel` distribution, fed this worker's shard."""
    import keras

    # The JAX table is the process's one, installed by the strategy: its row's original is Keras' fit.
    plain_fit = strategy.backend.patch_table().original("fit-global-batches")
    rows = local_rows(config, len(x), strategy.num_workers, strategy.worker_index)
    # keras_mwms' flat path leaves no distribution set globally: enter Keras' own DataParallel.
    distribution = strategy.backend.distribution

    def scope():
        return distribution.scope() if distribution is not None else contextlib.nullcontext()

    def build():
        with scope():
            model = build_keras_model(keras, config, model_name)
        strategy.backend.pin_path(model, "dataparallel")  # keep keras_mwms' flat step out
        return model

    def fit(model, callbacks):
        with scope():
            plain_fit(model, x[rows], y[rows], batch_size=config.global_batch // strategy.num_workers,
                      epochs=1, shuffle=False, verbose=0, callbacks=callbacks)

    timing = timed_keras_fit(keras, JAX_DATA_PARALLEL, model_name, repeat, config, build, fit)
    strategy.barrier(f"{JAX_DATA_PARALLEL} {model_name} {repeat} done")
    return timing


def jax_keras_mwms_data_parallel_fit(strategy, config: BenchmarkConfig, model_name: str, repeat: int,
                                     x, y) -> FitTiming:
    """keras_mwms' `fit` with the model pinned to the DataParallel path (the flat path's baseline)."""
    import keras

    def build():
        with strategy.scope():
            model = build_keras_model(keras, config, model_name)
        strategy.backend.pin_path(model, "dataparallel")
        return model

    def fit(model, callbacks):
        model.fit(x, y, batch_size=config.global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)

    timing = timed_keras_fit(keras, JAX_KERAS_MWMS_DATA_PARALLEL, model_name, repeat, config, build, fit)
    strategy.barrier(f"{JAX_KERAS_MWMS_DATA_PARALLEL} {model_name} {repeat} done")
    return timing


def torch_ddp_fit(strategy, config: BenchmarkConfig, model_name: str, repeat: int, x, y,
                  compiled: bool = False) -> FitTiming:
    """A hand-written DDP training loop (Adam, cross-entropy) on the strategy's process group.

    `compiled`: the network (DDP-wrapped with several workers) goes through `torch.compile`.
    """
    import torch
    from torch import nn

    workers, rank = strategy.num_workers, strategy.worker_index
    local_batch = config.global_batch // workers
    per_step = x.reshape(config.steps, workers, local_batch, *x.shape[1:])[:, rank]
    inputs = torch.from_numpy(np.ascontiguousarray(per_step))
    if model_name == "conv":
        inputs = inputs.permute(0, 1, 4, 2, 3).contiguous()
    labels = torch.from_numpy(np.ascontiguousarray(
        y.reshape(config.steps, workers, local_batch)[:, rank]))
    step_ends: list[float] = []
    setup_started = time.perf_counter()
    torch.manual_seed(0)
    model = build_torch_model(config, model_name)
    network = nn.parallel.DistributedDataParallel(model) if workers > 1 else model
    variant = TORCH_DDP_COMPILED if compiled else TORCH_DDP_LOOP
    if compiled:
        network = torch.compile(network)
    optimizer = torch.optim.Adam(model.parameters(), LEARNING_RATE)
    loss_function = nn.CrossEntropyLoss()
    loss = None
    for step in range(config.steps):
        optimizer.zero_grad()
        loss = loss_function(network(inputs[step]), labels[step])
        loss.backward()
        optimizer.step()
        step_ends.append(time.perf_counter())
    float(loss.detach())
    finished = time.perf_counter()
    strategy.barrier(f"{variant} {model_name} {repeat} done")
    return FitTiming.from_times(variant, model_name, repeat, step_ends, finished, setup_started,
                                config.warmup_steps, config.global_batch)
