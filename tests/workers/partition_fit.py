"""A partition mid-fit: worker 1 takes its own network link down at a train step.

Run by `tests/test_two_hosts.py` with each worker in its own network namespace (the link is
worker 1's end of the veth pair joining them):

    python tests/workers/partition_fit.py OUT_DIR --link LINK [--cut-at-step 12] [--timeout-seconds T]

Every worker trains a small MLP for many epochs; worker 1 runs `ip link set LINK down` after
train step `--cut-at-step` and writes `OUT_DIR/fault.json` (the wall-clock time of the cut). The
job must then end on both sides, each naming the other (`keras_mwms.WorkerLostError` or a hang
verdict), without a native abort. `--timeout-seconds` sets `CommunicationOptions.timeout_seconds`
(below the hang threshold it once let JAX's heartbeat abort both workers with SIGABRT).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--link", required=True, help="worker 1's end of the veth pair")
parser.add_argument("--cut-at-step", type=int, default=12)
parser.add_argument("--timeout-seconds", type=float, default=None)


def main() -> None:
    arguments = parser.parse_args()
    import keras

    import keras_mwms

    options = keras_mwms.CommunicationOptions(timeout_seconds=arguments.timeout_seconds)
    strategy = keras_mwms.MultiWorkerMirroredStrategy(communication_options=options)
    index = strategy.worker_index

    class CutTheLink(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if index == 1 and self.steps == arguments.cut_at_step:
                subprocess.run(["ip", "link", "set", arguments.link, "down"], check=True, timeout=30)
                with open(os.path.join(arguments.out, "fault.json"), "w") as handle:
                    json.dump({"time": time.time(), "step": self.steps}, handle)
                common.log(f"link {arguments.link} cut after train step {self.steps}")

    x, y = common.regression_data(rows=128)
    with strategy.scope():
        model = common.mlp(hidden=8)
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=32, epochs=100_000, shuffle=False, verbose=0, callbacks=[CutTheLink()])


if __name__ == "__main__":
    main()
