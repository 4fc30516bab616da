"""Torch-backend fault scenarios: NCCL on CPU, a crashed peer, a hung peer, custom-loop surface.

    python torch_faults.py OUT_DIR nccl|crash|hang|surface

* `nccl`: requests CommunicationImplementation.NCCL; records how long the error took.
* `crash`: worker 1 dies (os._exit(3)) in the middle of fit; survivors must exit non-zero
  naming worker 1.
* `hang`: worker 1 stops responding (sleeps) in the middle of fit with a 10 s collective
  timeout; survivors must exit non-zero naming worker 1.
* `surface`: exercises run / reduce / experimental_local_results / barrier /
  broadcast_object / distribute_datasets_from_function / experimental_distribute_dataset.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    import keras

    import keras_mwms

    index = common.worker_index()
    if mode == "nccl":
        started = time.monotonic()
        try:
            keras_mwms.MultiWorkerMirroredStrategy(keras_mwms.CommunicationOptions(
                implementation=keras_mwms.CommunicationImplementation.NCCL))
        except Exception as error:  # noqa: BLE001 - the test inspects what was raised
            common.save_result(out, index, error=f"{type(error).__name__}: {error}",
                               error_seconds=time.monotonic() - started)
            sys.exit(2)
        common.save_result(out, index, error=None)
        return

    timeout = 10 if mode == "hang" else None
    strategy = keras_mwms.MultiWorkerMirroredStrategy(
        keras_mwms.CommunicationOptions(timeout_seconds=timeout))
    if mode == "surface":
        surface(strategy, out, index)
        return

    class Sabotage(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if index == 1 and batch == 3:
                common.log("worker 1 sabotages:", mode)
                if mode == "crash":
                    os._exit(3)
                time.sleep(600)

    x, y = common.regression_data(512)
    with strategy.scope():
        model = common.mlp()
        model.compile(optimizer="sgd", loss="mse")
    started = time.monotonic()
    common.log("fit starts")
    try:
        model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[Sabotage()])
    except Exception as error:  # noqa: BLE001 - recorded, then the worker exits non-zero
        common.save_result(out, index, error=f"{type(error).__name__}: {error}",
                           error_seconds=time.monotonic() - started)
        raise
    common.save_result(out, index, error=None)


def surface(strategy, out: str, index: int) -> None:
    import numpy as np
    import torch

    import keras_mwms

    local = torch.tensor([float(index + 1), 10.0 * (index + 1)])
    per_replica = strategy.run(lambda t: t * 2, args=(local,))
    results = {
        "local_results": len(strategy.experimental_local_results(per_replica)),
        "sum": strategy.reduce("SUM", per_replica, axis=None).tolist(),
        "mean": strategy.reduce("MEAN", per_replica, axis=None).tolist(),
        "mean_axis0": float(strategy.reduce("MEAN", per_replica, axis=0)),
        "broadcast": strategy.backend.broadcast_object({"from": index})["from"],
    }
    strategy.barrier("surface")

    def dataset_fn(context: keras_mwms.InputContext):
        batch = context.get_per_replica_batch_size(8)
        rows = np.arange(32, dtype="float32")[context.input_pipeline_id::context.num_input_pipelines]
        return [rows[i:i + batch] for i in range(0, len(rows), batch)]

    results["from_function"] = [b.tolist() for b in strategy.distribute_datasets_from_function(dataset_fn)]
    global_batches = [np.arange(i, i + 8, dtype="float32") for i in range(0, 32, 8)]
    results["distributed"] = [b.tolist() for b in
                              strategy.experimental_distribute_dataset(global_batches)]
    common.save_result(out, index, **results)


if __name__ == "__main__":
    main()
