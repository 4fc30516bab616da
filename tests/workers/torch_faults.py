"""Torch-backend fault scenarios: NCCL on CPU, a crashed peer, a hung peer.

    python torch_faults.py OUT_DIR nccl|crash|hang

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


if __name__ == "__main__":
    main()
