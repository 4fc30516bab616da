"""Ray Train scenario: `two_hosts_fit.py`'s fit as a `train_loop_per_worker`, on a local Ray cluster.

Run by `tests/test_resolvers_gangs.py` with an interpreter that has `ray[train]`:

    python tests/workers/ray_fit.py OUT_DIR tensorflow torch jax

One `ray.init` (2 CPUs, no dashboard), then per backend one 2-worker trainer: TensorflowTrainer
(Ray writes TF_CONFIG), TorchTrainer (Ray sets MASTER_ADDR/RANK/WORLD_SIZE and has already called
`init_process_group`; keras_mwms joins that group), JaxTrainer (on CPU Ray starts nothing: the
loop hands keras_mwms `RayTrainClusterResolver`). Each worker fits with keras_mwms'
BackupAndRestore and reports every epoch's metrics with `ray.train.report` (the chief with a
checkpoint, so they become the run's `result.metrics`). On TensorFlow and torch, worker 1 fails at
the start of epoch 2 of the first attempt; Ray restarts the group (`FailureConfig(max_failures=1)`)
and BackupAndRestore resumes from epoch 1, so the weights must still equal one process's.
Writes `OUT_DIR/<backend>/w<index>.{npz,json}` and `OUT_DIR/<backend>/ray.json` (what Ray got).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

EPOCHS = 2


def train_loop_per_worker(config: dict) -> None:
    """The user's script, as Ray runs it in every worker."""
    import keras
    import ray.train

    import keras_mwms

    group_before = _torch_group_initialised()
    resolver = keras_mwms.resolvers.RayTrainClusterResolver() if config["backend"] == "jax" else None
    strategy = keras_mwms.MultiWorkerMirroredStrategy(cluster_resolver=resolver)
    out, index = config["out"], strategy.worker_index
    keras.utils.set_random_seed(5)
    x, y = common.regression_data(rows=128)
    with strategy.scope():
        model = common.mlp(hidden=8)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")

    class FailOnce(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            marker = Path(out, "failed-once")
            if config["fail_once"] and index == 1 and epoch == 1 and not marker.exists():
                marker.touch()
                raise RuntimeError("planned failure of worker 1 at epoch 2 (first attempt)")

    class ReportToRay(keras.callbacks.Callback):
        """The guide's recipe: every worker reports (Ray's barrier); the chief attaches a checkpoint,
        so its metrics become the run's `result.metrics`."""

        def on_epoch_end(self, epoch, logs=None):
            metrics = {"epoch": epoch, **{name: float(value) for name, value in logs.items()}}
            if not strategy.is_chief:
                ray.train.report(metrics)
                return
            with tempfile.TemporaryDirectory() as folder:
                self.model.save_weights(os.path.join(folder, "model.weights.h5"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

    callbacks = [keras_mwms.callbacks.BackupAndRestore(os.path.join(out, "backup")), FailOnce(), ReportToRay()]
    history = model.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    common.save_result(out, index, model, history=history.history, num_workers=strategy.num_workers,
                       resolver=type(strategy.cluster_resolver).__name__,
                       source=keras_mwms.resolvers.detect.describe_source(strategy.cluster_resolver),
                       group_before=group_before)
    strategy.close()
    # Ray created the torch process group and destroys it itself: closing must leave it alone.
    Path(out, f"closed{index}.json").write_text(json.dumps({"group_after_close": _torch_group_initialised()}))


def _torch_group_initialised() -> bool | None:
    """Whether a torch process group exists in this process (None where torch is not loaded)."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed

    return torch.distributed.is_initialized()


def trainer_for(backend: str):
    if backend == "tensorflow":
        from ray.train.tensorflow import TensorflowTrainer

        return TensorflowTrainer
    if backend == "torch":
        from ray.train.torch import TorchTrainer

        return TorchTrainer
    from ray.train.v2.jax import JaxTrainer

    return JaxTrainer


def main() -> None:
    import ray
    import ray.train

    out_root, backends = Path(sys.argv[1]), sys.argv[2:]
    repo = str(common.REPO)
    # Two 1-CPU workers; the driver's own processes stay light (no dashboard, short timeouts).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": repo, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                                       "KERAS_MWMS_RENDEZVOUS_TIMEOUT": "60"}})
    try:
        for backend in backends:
            started = time.monotonic()
            out = out_root / backend
            out.mkdir(parents=True, exist_ok=True)
            trainer = trainer_for(backend)(
                train_loop_per_worker, train_loop_config={"backend": backend, "out": str(out), "fail_once": backend != "jax"},
                scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
                run_config=ray.train.RunConfig(
                    name=f"keras_mwms-{backend}", storage_path=str(out / "ray"),
                    failure_config=ray.train.FailureConfig(max_failures=1),
                    worker_runtime_env={"env_vars": {"KERAS_BACKEND": backend}}))
            result = trainer.fit()
            (out / "ray.json").write_text(json.dumps(
                {"metrics": result.metrics, "error": repr(result.error) if result.error else None,
                 "checkpoint": bool(result.checkpoint), "seconds": time.monotonic() - started}, default=float))
            common.log(f"{backend}: trainer.fit() returned after {time.monotonic() - started:.1f} s")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
