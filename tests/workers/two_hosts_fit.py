"""Two-host scenario: a short fit, then the TCP listeners of this worker's network namespace.

Run by `tests/test_two_hosts.py` once per worker, each in its own network namespace (its own
IP address on a veth pair), and without TF_CONFIG as the single-process reference:

    python tests/workers/two_hosts_fit.py OUT_DIR [--epochs 2]

Writes `OUT_DIR/w<index>.npz` (final weights) and `OUT_DIR/w<index>.json` with `listeners`:
the `ss -ltnH` lines seen after `fit` (the engine's sockets are still open then; the worker
is alone in its namespace, so every listener is its own), the resolver class the strategy
chose and whether TF_CONFIG was set (tests/test_resolvers_gangs.py starts it through torchrun,
an MPI-style and a Slurm-style environment).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=2)


def listeners() -> list[str]:
    """This namespace's listening TCP sockets as `ss -ltnH` prints them ([] without `ss`)."""
    try:
        listed = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [" ".join(line.split()) for line in listed.stdout.splitlines() if line.strip()]


def run_job(strategy, argv: list[str]) -> None:
    """The fit in `strategy`, then the dump (`tests/workers/jobs.py` runs it in a warm process:
    the single-process reference; `main` in a fresh one)."""
    import keras

    arguments = parser.parse_args(argv)
    index = strategy.worker_index
    keras.utils.set_random_seed(5)
    x, y = common.regression_data(rows=128)
    with strategy.scope():
        model = common.mlp(hidden=8)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    history = model.fit(x, y, batch_size=32, epochs=arguments.epochs, shuffle=False, verbose=0)
    common.save_result(arguments.out, index, model, history=history.history, listeners=listeners(),
                       num_workers=strategy.num_workers,
                       resolver=type(strategy.cluster_resolver).__name__,
                       tf_config_set=bool(os.environ.get("TF_CONFIG")))
    common.log("done")


def main() -> None:
    parser.parse_args()   # a bad flag fails before the strategy starts
    import keras_mwms

    # The strategy comes first: JAX and TensorFlow cannot join a cluster after they computed.
    run_job(keras_mwms.MultiWorkerMirroredStrategy(), sys.argv[1:])


if __name__ == "__main__":
    main()
