"""Torch-backend training scenario: fit + evaluate + predict, dumped for the tests.

Run by every worker of a gang (and without TF_CONFIG as the single-process reference):

    python torch_scenario.py OUT_DIR --data arrays --optimizer sgd --epochs 2 [--shuffle] ...

Writes `OUT_DIR/w<index>.npz` (final weights) and `OUT_DIR/w<index>.json` (history, evaluate,
predict digest, initial weights' digest, timings).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def make_inputs(kind: str, x, y, batch_size: int, shuffle: bool):
    """The same global batches as numpy arrays, tf.data, a PyDataset or a torch DataLoader."""
    if kind == "arrays":
        return dict(x=x, y=y, batch_size=batch_size, shuffle=shuffle)
    if kind == "tfdata":
        import tensorflow as tf

        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        if shuffle:
            dataset = dataset.shuffle(len(x), seed=5, reshuffle_each_iteration=True)
        return dict(x=dataset.batch(batch_size))
    if kind == "dataloader":
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return dict(x=DataLoader(dataset, batch_size=batch_size, shuffle=shuffle))
    if kind == "pydataset":
        import keras

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return -(-len(x) // batch_size)

            def __getitem__(self, index):
                rows = slice(index * batch_size, (index + 1) * batch_size)
                return x[rows], y[rows]

        return dict(x=Batches())
    raise ValueError(kind)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--data", default="arrays")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="steps_per_epoch (0: all)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--batch-norm", action="store_true")
    parser.add_argument("--unsynchronized", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--seed-by-worker", action="store_true")
    parser.add_argument("--classification", action="store_true")
    arguments = parser.parse_args()

    import keras
    import numpy as np

    import keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    index = strategy.worker_index
    keras.utils.set_random_seed(100 + index if arguments.seed_by_worker else 100)
    if arguments.classification:
        x, y = common.classification_data(arguments.rows)
        outputs, loss, metrics = common.NUM_CLASSES, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), ["accuracy"]
    else:
        x, y = common.regression_data(arguments.rows)
        outputs, loss, metrics = 1, "mse", ["mae"]
    optimizer = (keras.optimizers.SGD(0.05, momentum=0.9) if arguments.optimizer == "sgd"
                 else keras.optimizers.Adam(1e-3))
    with strategy.scope():
        model = common.mlp(outputs, batch_norm=arguments.batch_norm, dropout=arguments.dropout,
                           synchronized=not arguments.unsynchronized)
        model.compile(optimizer=optimizer, loss=loss, metrics=metrics,
                      jit_compile=arguments.jit)
    initial = [np.asarray(w) for w in model.get_weights()]
    inputs = make_inputs(arguments.data, x, y, arguments.batch_size, arguments.shuffle)
    fit_kwargs = dict(epochs=arguments.epochs, verbose=0)
    if arguments.steps:
        fit_kwargs["steps_per_epoch"] = arguments.steps
    history = model.fit(**inputs, **fit_kwargs)
    evaluation = model.evaluate(x, y, batch_size=arguments.batch_size, verbose=0, return_dict=True)
    predictions = model.predict(x, batch_size=arguments.batch_size, verbose=0)
    common.save_result(
        arguments.out, index, model,
        history={key: [float(v) for v in values] for key, values in history.history.items()},
        evaluate={key: float(value) for key, value in evaluation.items()},
        initial_weight_sum=float(sum(np.abs(w).sum() for w in initial)),
        predict_shape=list(predictions.shape),
        optimizer_class=type(model.optimizer).__mro__[1].__module__,
        optimizer_iterations=int(model.optimizer.iterations.numpy()),
    )
    np.save(os.path.join(arguments.out, f"predict{index}.npy"), predictions)
    common.log("done")


if __name__ == "__main__":
    main()
