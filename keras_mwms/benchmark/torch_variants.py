"""The torch rows beyond keras_mwms' eager fit and the DDP loop (issue 22, items 1 and 5).

| variant                        | what it is                                                         |
|--------------------------------|--------------------------------------------------------------------|
| `keras_mwms jit_compile`       | keras_mwms' `fit` with `compile(jit_compile=True)`: Keras' torch.compile'd step, the gradient all-reduce after backward, outside the graph (its graph breaks are counted: `keras_mwms.benchmark.graph_breaks`) |
| `torch DDP + torch.compile`    | the hand-written DDP loop (`peers.torch_ddp_fit`) on `torch.compile(DDP(model))`: DDP's own compiled path (DDPOptimizer splits the graph at the buckets) |
| `plain Keras`                  | one process only: Keras' own `fit`, outside any strategy — the baseline of keras_mwms' one-process ratio |
| `keras-nightly DataParallel`   | N workers: keras-nightly's torch trainer (it wraps the model in DDP when `torch.distributed` is up and all-reduces each metric variable per step), each worker fitting its shard; a gang of its own (role `keras_nightly`) over the overlay `make keras-nightly` installs |

Each compiled fit starts from an empty TorchDynamo cache (`fresh_dynamo_cache`): Keras' torch
step guards on the identity and name of the model and its layers, so every new model compiles
its step again, and after 4 models in one process (2 cache entries each) Dynamo's
`recompile_limit` (8) ran the rest of the process's `train_step`s eagerly, silently: the
one-process rows of the conv net (the 5th–8th compiled model of a full run) were eager, with 0–1
graph breaks, and made the 2-worker compiled step look 2–3× slower than one process.

The compiled variants (their first steps are compilation) and the keras-nightly gang are left
out of `--quick` (`make bench-quick` stays under its budget). Without the overlay the
keras-nightly gang is skipped with `NIGHTLY_MISSING` in the report.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from keras_mwms.benchmark import peers
from keras_mwms.benchmark.config import BenchmarkConfig
from keras_mwms.benchmark.fit import timed_keras_fit
from keras_mwms.benchmark.models import LEARNING_RATE, build_keras_model
from keras_mwms.benchmark.timing import FitTiming

OURS_JIT = "keras_mwms jit_compile"
TORCH_DDP_COMPILED, PLAIN_KERAS, KERAS_NIGHTLY = peers.TORCH_DDP_COMPILED, peers.PLAIN_KERAS, peers.KERAS_NIGHTLY
NIGHTLY_ROLE = "keras_nightly"
NIGHTLY_OVERLAY = Path(__file__).resolve().parents[2] / "build" / "keras-overlays" / "keras-nightly"
NIGHTLY_MISSING = (f"keras-nightly peer skipped: no overlay at {NIGHTLY_OVERLAY} (`make keras-nightly` "
                   "installs it there, beside the default venv)")


def nightly_overlay() -> Path | None:
    """The keras-nightly overlay directory, or None when `make keras-nightly` has not made it.

    Example:

    >>> nightly_overlay() is None or (nightly_overlay() / "keras").is_dir()
    True
    """
    return NIGHTLY_OVERLAY if (NIGHTLY_OVERLAY / "keras").is_dir() else None


def nightly_gang_wanted(config: BenchmarkConfig, backend: str) -> bool:
    """Whether a run plans the keras-nightly gang (torch, fit, full run, overlay present).

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> nightly_gang_wanted(quick_config(backends=("torch",)), "torch")
    False
    """
    return (backend == "torch" and "fit" in config.sections and not config.quick
            and nightly_overlay() is not None)


def fresh_dynamo_cache() -> None:
    """Forgets every step TorchDynamo compiled in this process, so the next fit compiles its own.

    Without it, the benchmark's 5th compiled Keras model in one process runs eagerly (see the
    module docstring). Example:

    >>> import torch
    >>> fresh_dynamo_cache()
    >>> torch.compile(lambda x: x * 2, backend="eager")(torch.ones(1)).tolist()
    [2.0]
    """
    import torch

    torch._dynamo.reset()


def _compiled_keras(keras, config: BenchmarkConfig, model_name: str):
    model = build_keras_model(keras, config, model_name)
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    return model


def keras_mwms_jit_fit(strategy, config: BenchmarkConfig, model_name: str, repeat: int, x, y) -> FitTiming:
    """keras_mwms' `fit` of the global arrays with `jit_compile=True` (torch.compile'd step)."""
    import keras

    from keras_mwms.benchmark.graph_breaks import GraphBreaks

    def build():
        with strategy.scope():
            return _compiled_keras(keras, config, model_name)

    def fit(model, callbacks):
        model.fit(x, y, batch_size=config.global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)

    fresh_dynamo_cache()
    with GraphBreaks() as breaks:
        timing = timed_keras_fit(keras, OURS_JIT, model_name, repeat, config, build, fit)
    timing.graph_breaks, timing.recompile_limit_hits = breaks.count, breaks.recompile_limit_hits
    strategy.barrier(f"{OURS_JIT} {model_name} {repeat} done")
    return timing


def plain_keras_fit(config: BenchmarkConfig, model_name: str, repeat: int, x, y) -> FitTiming:
    """Keras' own `fit` outside any strategy (one process): the one-process baseline."""
    import keras

    def fit(model, callbacks):
        model.fit(x, y, batch_size=config.global_batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)

    return timed_keras_fit(keras, PLAIN_KERAS, model_name, repeat, config,
                           lambda: build_keras_model(keras, config, model_name), fit)


def torch_ddp_compiled_fit(strategy, config: BenchmarkConfig, model_name: str, repeat: int, x, y
                           ) -> FitTiming:
    """`peers.torch_ddp_fit`'s loop on `torch.compile` of the DDP-wrapped model (of the model alone)."""
    from keras_mwms.benchmark.graph_breaks import GraphBreaks

    fresh_dynamo_cache()
    with GraphBreaks() as breaks:
        timing = peers.torch_ddp_fit(strategy, config, model_name, repeat, x, y, compiled=True)
    timing.graph_breaks, timing.recompile_limit_hits = breaks.count, breaks.recompile_limit_hits
    return timing


def add_torch_variants(runs, strategy, config: BenchmarkConfig, arguments: tuple, full_batch: bool) -> None:
    """Adds this module's in-process torch variants to a keras_mwms-role process's `runs`."""
    workers = strategy.num_workers
    if workers == 1 and full_batch:
        runs.add(plain_keras_fit, *arguments)
    if config.quick:
        return
    runs.add(keras_mwms_jit_fit, strategy, *arguments)
    runs.add(torch_ddp_compiled_fit, strategy, *arguments)


def run_keras_nightly_role(config: BenchmarkConfig, result: dict) -> None:
    """One worker of the keras-nightly gang: gloo at the chief's TF_CONFIG port, Keras' own fit.

    keras-nightly wraps the model in `DistributedDataParallel` itself once `torch.distributed`
    is initialised; each worker fits its rows of every global batch (keras_mwms' split rule),
    `global_batch ÷ N` per step.
    """
    import datetime

    import keras
    import torch.distributed as dist

    from keras_mwms.benchmark.models import synthetic_data
    from keras_mwms.startup.cluster import split_address

    tf_config = json.loads(os.environ["TF_CONFIG"])
    addresses = tf_config["cluster"]["worker"]
    index, workers = tf_config["task"]["index"], len(addresses)
    host, port = split_address(addresses[0])
    started = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=index, world_size=workers,
                            timeout=datetime.timedelta(seconds=120))
    result["join_seconds"] = time.perf_counter() - started
    result["engine"] = "gloo"
    result["keras_nightly_version"] = keras.__version__
    fits = []
    for model_name in config.models:
        x, y = synthetic_data(config, model_name)
        rows = peers.local_rows(config, len(x), workers, index)
        for repeat in range(config.repeats):
            fits.append(_nightly_fit(keras, config, model_name, repeat, x[rows], y[rows], workers).to_dict())
            dist.barrier()
    result["fits"] = fits
    dist.destroy_process_group()


def _nightly_fit(keras, config: BenchmarkConfig, model_name: str, repeat: int, x, y, workers: int) -> FitTiming:
    def fit(model, callbacks):
        model.fit(x, y, batch_size=config.global_batch // workers, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)

    return timed_keras_fit(keras, KERAS_NIGHTLY, model_name, repeat, config,
                           lambda: build_keras_model(keras, config, model_name), fit)
