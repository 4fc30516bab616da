"""`make demo`: a real multi-worker job — classify scikit-learn's bundled digits.

Run it on two local workers (any backend):

    python -m keras_mwms.launch --workers 2 -m keras_mwms.demo
    KERAS_BACKEND=jax python -m keras_mwms.launch --workers 2 -m keras_mwms.demo

Every worker reads TF_CONFIG, meets its peers, trains the same model on its share of every
global batch, and reports the global metrics; the chief prints the summary.
"""

from __future__ import annotations

import argparse
import os
import sys


def load_digits():
    """The 8×8 digits (1,797 images) bundled with scikit-learn: offline, small, real."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        sys.exit("keras_mwms.demo needs scikit-learn for its offline dataset: pip install scikit-learn")
    import numpy as np

    digits = sklearn_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keras_mwms.demo")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch size")
    arguments = parser.parse_args(argv)

    import keras

    import keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    print(f"I am {resolver.task_name} (worker {strategy.worker_index} of {strategy.num_workers}, "
          f"chief={strategy.is_chief}) on {keras.backend.backend()}, pid {os.getpid()}; "
          f"{strategy.num_replicas_in_sync} replica(s) in sync", flush=True)

    (x_train, y_train), (x_test, y_test) = load_digits()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.Adam(3e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    # verbose=2 asks every worker for its epoch lines (the default shows only the chief's): the
    # demo prints both to show that the logged metrics are global, identical on every worker.
    history = model.fit(x_train, y_train, batch_size=arguments.batch_size,
                        epochs=arguments.epochs, validation_data=(x_test, y_test), verbose=2)
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=arguments.batch_size, verbose=0)
    if strategy.is_chief:
        print(f"chief: global test accuracy {accuracy:.3f} (loss {loss:.3f}) after "
              f"{len(history.history['loss'])} epochs on {strategy.num_workers} worker(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
