"""One benchmark worker process: join, fit every variant, sweep the all-reduce, write JSON.

Started by the driver (`keras_mwms.benchmark.runner`) through the launcher's `Gang`, so
`TF_CONFIG`, `KERAS_BACKEND` and the thread settings are already in the environment:

    python -m keras_mwms.benchmark.worker CONFIG.json ROLE RESULT_PREFIX

Worker i writes `RESULT_PREFIX.worker<i>.json`.

ROLE `keras_mwms` creates `keras_mwms.MultiWorkerMirroredStrategy()` and fits through it; in the
same processes, interleaved repeat by repeat, it runs the native peers that can share them
(JAX DataParallel and the torch DDP loop on the strategy's engine, and, with one process, plain
Keras 3 and tf-keras), then times the all-reduce. ROLE `tensorflow_native` runs the TensorFlow
peers on a plain `tf.distribute.MultiWorkerMirroredStrategy` (it cannot share a process with
keras_mwms' patched trainer). ROLE `scaling` fits keras_mwms alone at a sweep's further worker
count (`run_scaling_role`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

from keras_mwms import settings
from keras_mwms.benchmark import peers, torch_variants
from keras_mwms.benchmark.config import BenchmarkConfig
from keras_mwms.benchmark.fit import keras_mwms_fit, keras_mwms_fit_without_ledger
from keras_mwms.benchmark.models import parameter_count, synthetic_data
from keras_mwms.benchmark.timing import seconds_since_launch
from keras_mwms.devices import threads_per_worker

ROLES = ("keras_mwms", "tensorflow_native", "scaling", torch_variants.NIGHTLY_ROLE)
THREADS_ENV = settings.BENCH_THREADS.name


def configure_threads(backend_name: str, threads: int) -> None:
    """Pins the backend's compute threads (the driver also set OMP_NUM_THREADS and XLA_FLAGS)."""
    if backend_name == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    elif backend_name == "torch":
        import torch

        torch.set_num_threads(threads)


def versions(backend_name: str) -> dict[str, str]:
    import keras

    found = {"keras": keras.__version__}
    if backend_name == "tensorflow":
        import tensorflow as tf

        found["tensorflow"] = tf.__version__
        try:
            import tf_keras

            found["tf_keras"] = tf_keras.__version__
        except ImportError:
            pass
    elif backend_name == "jax":
        import jax

        found["jax"] = jax.__version__
    else:
        import torch

        found["torch"] = torch.__version__
    return found


class TimedRuns:
    """Collects the fits of one process; the first one also gets the start-up time."""

    def __init__(self) -> None:
        self.fits: list[dict] = []

    def add(self, function, *args) -> None:
        """Runs `function(*args)`, which returns a `FitTiming`, and keeps its result."""
        before = time.perf_counter()
        timing = function(*args)
        if not self.fits:
            since_launch = seconds_since_launch(before)
            if since_launch is not None:
                timing.startup_seconds = since_launch + timing.first_step_seconds
        self.fits.append(timing.to_dict())


def batch_configs(config: BenchmarkConfig, workers: int) -> list[BenchmarkConfig]:
    """The configs to fit: the global batch, and with one process also one worker's share of it.

    The share (global batch ÷ N, same threads as one of N workers) is one worker's compute
    without any synchronisation: the baseline of the sync overhead.

    Example:

    >>> from keras_mwms.benchmark.config import quick_config
    >>> [c.global_batch for c in batch_configs(quick_config(workers=2), 1)]
    [256, 128]
    >>> [c.global_batch for c in batch_configs(quick_config(workers=2), 2)]
    [256]
    """
    if workers > 1:
        return [config]
    return [config, dataclasses.replace(config, global_batch=config.global_batch // config.workers)]


def run_keras_mwms_role(config: BenchmarkConfig, backend_name: str, result: dict) -> None:
    import keras_mwms

    started = time.perf_counter()
    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    result["join_seconds"] = time.perf_counter() - started
    result["engine"] = strategy.backend.engine_description()
    workers = strategy.num_workers
    runs = TimedRuns()
    if "fit" in config.sections:
        for model_name, batch_config in ((name, each) for name in config.models
                                         for each in batch_configs(config, workers)):
            x, y = synthetic_data(batch_config, model_name)
            for repeat in range(config.repeats):
                arguments = (batch_config, model_name, repeat, x, y)
                ours = [keras_mwms_fit]
                if config.ledger_comparison and workers > 1:
                    # Ledger on and off take turns going first: no order bias between them.
                    ours = [keras_mwms_fit, keras_mwms_fit_without_ledger][::1 if repeat % 2 == 0 else -1]
                for function in ours:
                    runs.add(function, strategy, *arguments)
                peer_count = config.share_peers if batch_config is not config else len(peers.PEERS[backend_name])
                if backend_name == "jax":
                    runs.add(peers.jax_data_parallel_fit, strategy, *arguments)
                    if workers > 1 and strategy.backend.path == "flat":
                        runs.add(peers.jax_keras_mwms_data_parallel_fit, strategy, *arguments)
                elif backend_name == "torch":
                    runs.add(peers.torch_ddp_fit, strategy, *arguments)
                    torch_variants.add_torch_variants(runs, strategy, config, arguments,
                                                      batch_config is config)
                elif workers == 1:
                    for variant in peers.PEERS["tensorflow"][:peer_count]:
                        runs.add(peers.tensorflow_peer_fit, variant, None, *arguments)
    result["fits"] = runs.fits
    if workers > 1:
        result["allreduce"] = _allreduce_rows(strategy, config, backend_name)


def _allreduce_rows(strategy, config: BenchmarkConfig, backend_name: str) -> list[dict]:
    """The gang's all-reduce section: the 4-byte latency, the size sweep (with "allreduce") and
    each model's gradient bytes (with "fit")."""
    from keras_mwms.benchmark import allreduce

    rows = allreduce.measure(strategy, backend_name, [4], config.iterations_for, label="latency")
    if "allreduce" in config.sections:
        rows += allreduce.measure(strategy, backend_name, config.sizes, config.iterations_for)
    if "fit" in config.sections:
        for model_name in config.models:
            rows += allreduce.measure(strategy, backend_name, [4 * parameter_count(config, model_name)],
                                      config.iterations_for, label=f"gradients:{model_name}")
    return rows


def run_scaling_role(config: BenchmarkConfig, backend_name: str, result: dict) -> None:
    """A scaling sweep's further count: keras_mwms alone, weak scaling, then the all-reduce.

    The global batch is this gang's worker count × one worker's batch of the main run
    (`config.global_batch ÷ config.workers`); no peers (see `keras_mwms.benchmark.scaling`).
    """
    import keras_mwms

    started = time.perf_counter()
    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    result["join_seconds"] = time.perf_counter() - started
    result["engine"] = strategy.backend.engine_description()
    workers = strategy.num_workers
    weak = dataclasses.replace(config, global_batch=config.global_batch // config.workers * workers)
    runs = TimedRuns()
    if "fit" in config.sections:
        for model_name in config.models:
            x, y = synthetic_data(weak, model_name)
            for repeat in range(config.repeats):
                runs.add(keras_mwms_fit, strategy, weak, model_name, repeat, x, y)
    result["fits"] = runs.fits
    result["allreduce"] = _allreduce_rows(strategy, config, backend_name)


def run_tensorflow_native_role(config: BenchmarkConfig, workers: int, result: dict) -> None:
    started = time.perf_counter()
    tf_strategy = peers.tensorflow_native_strategy(workers)
    result["join_seconds"] = time.perf_counter() - started
    runs = TimedRuns()
    for model_name, batch_config in ((name, each) for name in config.models
                                     for each in batch_configs(config, workers)):
        x, y = synthetic_data(batch_config, model_name)
        for repeat in range(config.repeats):
            for variant in peers.PEERS["tensorflow"]:
                runs.add(peers.tensorflow_peer_fit, variant, tf_strategy, batch_config, model_name, repeat,
                         x, y)
    result["fits"] = runs.fits


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3 or argv[1] not in ROLES:
        print("usage: python -m keras_mwms.benchmark.worker CONFIG.json {keras_mwms|tensorflow_native|scaling|keras_nightly} "
              "RESULT_PREFIX", file=sys.stderr)
        return 2
    config_path, role, result_prefix = argv
    with open(config_path) as file:
        config = BenchmarkConfig.from_json(file.read())
    backend_name = os.environ.get("KERAS_BACKEND", "tensorflow")
    workers = settings.LOCAL_WORKERS.read()
    threads = settings.BENCH_THREADS.read() or threads_per_worker(workers)
    configure_threads(backend_name, threads)
    result = {"role": role, "backend": backend_name, "workers": workers, "threads": threads,
              "worker_index": json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]}
    if role == "keras_mwms":
        run_keras_mwms_role(config, backend_name, result)
    elif role == "scaling":
        run_scaling_role(config, backend_name, result)
    elif role == torch_variants.NIGHTLY_ROLE:
        torch_variants.run_keras_nightly_role(config, result)
    else:
        run_tensorflow_native_role(config, workers, result)
    result["versions"] = versions(backend_name)
    if role == torch_variants.NIGHTLY_ROLE:   # not the run's Keras: the report merges versions
        result["versions"] = {"keras_nightly": result["versions"]["keras"]}
    result_path = f"{result_prefix}.worker{result['worker_index']}.json"
    with open(result_path + ".tmp", "w") as file:
        json.dump(result, file, indent=1)
    os.replace(result_path + ".tmp", result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
