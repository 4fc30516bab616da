"""Torch-backend training scenario: fit + evaluate + predict, dumped for the tests.

Run by every worker of a gang (and without TF_CONFIG as the single-process reference):

    python torch_scenario.py OUT_DIR SCENARIO [SCENARIO ...]

Scenarios (see `SCENARIOS`, plus `surface` for the custom-loop API) run one after another in
the same processes, so worker start-up is paid once. Each writes `OUT_DIR/<scenario>/w<index>.npz`
(final weights), `.../w<index>.json` (history, evaluate, weight digests) and
`.../predict<index>.npy`.
"""

from __future__ import annotations

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


SCENARIOS = {
    "sgd_arrays": dict(data="arrays", optimizer="sgd", seed_by_worker=True),
    "tfdata_adam": dict(data="tfdata", shuffle=True, optimizer="adam", batch_norm=True,
                        unsynchronized=True),
    "dropout": dict(data="arrays", shuffle=True, dropout=0.3),
    "jit": dict(data="arrays", jit=True, epochs=1),
    # The eager twin of "jit": the one-process reference the compiled gang must match.
    "jit_eager": dict(data="arrays", jit=False, epochs=1),
    "dataloader_bn": dict(data="dataloader", shuffle=True, batch_norm=True, batch_size=48,
                          classification=True),
    "pydataset_adam": dict(data="pydataset", optimizer="adam", batch_size=40, rows=280),
}


def run_scenario(strategy, out: str, data="arrays", optimizer="sgd", epochs=2, rows=256,
                 batch_size=32, shuffle=False, batch_norm=False, unsynchronized=False,
                 dropout=0.0, jit=False, seed_by_worker=False, classification=False) -> None:
    import keras
    import numpy as np

    index = strategy.worker_index
    keras.utils.set_random_seed(100 + index if seed_by_worker else 100)
    seed_probe = float(np.random.random())   # shows whether this worker was seeded differently
    if classification:
        x, y = common.classification_data(rows)
        outputs, loss, metrics = common.NUM_CLASSES, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), ["accuracy"]
    else:
        x, y = common.regression_data(rows)
        outputs, loss, metrics = 1, "mse", ["mae"]
    with strategy.scope():
        model = common.mlp(outputs, batch_norm=batch_norm, dropout=dropout,
                           synchronized=not unsynchronized)
        model.compile(optimizer=(keras.optimizers.SGD(0.05, momentum=0.9) if optimizer == "sgd"
                                 else keras.optimizers.Adam(1e-3)),
                      loss=loss, metrics=metrics, jit_compile=jit)
    start_sums = []

    class RecordStart(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            start_sums.append(float(sum(np.abs(w).sum() for w in self.model.get_weights())))

    before = float(sum(np.abs(w).sum() for w in model.get_weights()))
    history = model.fit(**make_inputs(data, x, y, batch_size, shuffle), epochs=epochs, verbose=0,
                        callbacks=[RecordStart()])
    evaluation = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    predictions = model.predict(x, batch_size=batch_size, verbose=0)
    from keras_mwms.backends.torch.state import diagnostics

    fast_paths = diagnostics(model)
    common.save_result(
        out, index, model,
        history={key: [float(v) for v in values] for key, values in history.history.items()},
        evaluate={key: float(value) for key, value in evaluation.items()},
        weight_sum_before_fit=before,
        seed_probe=seed_probe,
        weight_sum_at_train_begin=start_sums[0],
        optimizer_class=type(model.optimizer).__module__,
        optimizer_iterations=int(model.optimizer.iterations.numpy()),
        # Gradient buckets reduced during backward (keras_mwms.backends.torch.overlap); 0: none.
        overlap_buckets=fast_paths["overlap_buckets"],
        # Steps whose metric states were summed in the last gradient bucket (no own all-reduce).
        metric_states_in_gradient_bucket=fast_paths["metric_states_in_gradient_bucket"],
        # Steps whose Adam update ran in place (keras_mwms.backends.torch.fused_adam).
        fused_adam_steps=fast_paths["fused_adam_steps"],
    )
    np.save(os.path.join(out, f"predict{index}.npy"), predictions)


def run_surface(strategy, out: str) -> None:
    import numpy as np
    import torch

    import keras_mwms

    index = strategy.worker_index
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


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    import keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    for name in names:
        common.log("scenario", name)
        target = os.path.join(out, name)
        if name == "surface":
            run_surface(strategy, target)
        else:
            run_scenario(strategy, target, **SCENARIOS[name])
    common.log("done")


if __name__ == "__main__":
    main()
