"""Scenario worker for every backend: fit, evaluate and predict, dumping what the tests assert on.

Runs in every worker of a gang and, without TF_CONFIG, as the single-process reference under
the same flags; the backend is KERAS_BACKEND's. One scenario writes its dumps into OUT:

    KERAS_BACKEND=jax python tests/workers/fit_scenario.py /tmp/fit --data dataset --optimizer adam

Named scenarios run one after another in the same processes, so worker start-up is paid once;
each writes into OUT/NAME. Flags before the first `--scenario` apply to every scenario, and a
scenario's own flags (after `NAME:`) override them:

    KERAS_BACKEND=torch python tests/workers/fit_scenario.py /tmp/fit --verbose 0 \\
        --scenario "sgd: --seed-by-worker" --scenario "adam: --optimizer adam --shuffle"

Dumps of worker i (0 for the reference): `w<i>.init.npz` (weights before fit), `w<i>.npz`
(after fit), `w<i>.predict.npy` (predict on the evaluation rows) and `w<i>.json`: history,
evaluate, batches run per epoch, replicas, is_chief, seed_probe (a draw of numpy's global
generator right after seeding, to show whether workers were seeded differently), weight sums
before fit and at train begin, optimizer class and iterations, predict shape, fit seconds, graph breaks of
`torch.compile` during fit and the functions TorchDynamo's recompile_limit stopped compiling (torch),
what only one backend reports (`backend_details`) and, with `--primitives`, the custom-loop API.
`load_dump(out, index)` reads them back (numpy only, no backend).
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

FLAGS = argparse.ArgumentParser(add_help=False)
FLAGS.add_argument("--data", default="arrays", choices=["arrays", "dataset", "pydataset", "dataloader", "dataset_off"],
                   help="numpy arrays, tf.data (global batches), a keras PyDataset, a torch DataLoader, or "
                        "tf.data pre-sharded by worker with auto-sharding OFF")
FLAGS.add_argument("--task", default="regression", choices=["regression", "classification"])
FLAGS.add_argument("--rows", type=int, default=256, help="training rows")
FLAGS.add_argument("--batch-size", type=int, default=32, help="global batch size")
FLAGS.add_argument("--shuffle", action="store_true", help="shuffle the rows (batches of a PyDataset) each epoch")
FLAGS.add_argument("--batch-norm", choices=["synchronized", "local"], default=None,
                   help="add BatchNormalization(synchronized=True), or an ordinary one (global moments unless "
                        "CommunicationOptions.batch_norm_statistics='per_worker')")
FLAGS.add_argument("--dropout", type=float, default=0.0, help="add Dropout with this rate")
FLAGS.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
FLAGS.add_argument("--learning-rate", type=float, default=None, help="default: 0.05 for SGD, 1e-2 for Adam")
FLAGS.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
FLAGS.add_argument("--seed", type=int, default=0, help="keras.utils.set_random_seed value")
FLAGS.add_argument("--seed-by-worker", action="store_true", help="worker i seeds with SEED + i")
FLAGS.add_argument("--epochs", type=int, default=2)
FLAGS.add_argument("--steps-per-epoch", type=int, default=None)
FLAGS.add_argument("--steps-per-execution", type=int, default=1)
FLAGS.add_argument("--jit-compile", action="store_true", help="compile(jit_compile=True) instead of 'auto'")
FLAGS.add_argument("--validation", default="none", choices=["none", "data", "split"],
                   help="validation_data (96 held-out rows) or validation_split=0.25")
FLAGS.add_argument("--evaluate-on", default="holdout", choices=["holdout", "training", "none"],
                   help="evaluate/predict on 100 held-out rows with sample weights, on the training rows, or "
                        "not at all (a compiled scenario's test and predict steps each compile again)")
FLAGS.add_argument("--evaluate-batch-size", type=int, default=None, help="default: --batch-size")
FLAGS.add_argument("--verbose", default="auto", choices=["auto", "0", "1", "2"],
                   help="verbose of fit, evaluate and predict")
FLAGS.add_argument("--primitives", action="store_true",
                   help="after predict, exercise run/reduce/barrier/broadcast/distributed datasets")
FLAGS.add_argument("--kill-worker", type=int, default=None,
                   help="this worker exits with os._exit(9) after batch --kill-after-batch (fault tests)")
FLAGS.add_argument("--kill-after-batch", type=int, default=5)
FLAGS.add_argument("--compression", default=None, choices=["bf16", "fp16"],
                   help="CommunicationOptions(compression=...) for this scenario; the dump then holds "
                        "wire_bytes_per_step either way")
FLAGS.add_argument("--no-torch-overlap", action="store_true",
                   help="CommunicationOptions(torch_overlap=False): torch reduces gradients after backward")
FLAGS.add_argument("--record-path", action="store_true",
                   help="dump w<i>.path.npz: per weight, the sum over steps of |weight change| (the "
                        "scale of compression's rounding bound)")
FLAGS.add_argument("--accumulation", type=int, default=None,
                   help="the optimizer's gradient_accumulation_steps; the dump then counts collectives by kind")
FLAGS.add_argument("--custom-train-step", action="store_true",
                   help="a model class whose train_step overrides Keras' (calling it)")
FLAGS.add_argument("--fits", type=int, default=1, help="call fit this many times (History: the last)")
FLAGS.add_argument("--seconds-per-batch", type=float, default=0.0,
                   help="sleep after every batch, so a fault lands mid-epoch")


def scenario_spec(text: str) -> tuple[str, list[str]]:
    name, separator, flags = text.partition(":")
    if not separator or not name.strip():
        raise argparse.ArgumentTypeError(f"--scenario {text!r}: expected 'NAME: FLAGS', e.g. 'adam: --optimizer adam'")
    return name.strip(), shlex.split(flags)


def parse_command_line(argv: list[str]) -> list[tuple[str, argparse.Namespace]]:
    """The scenarios to run, as (output folder, flags)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[FLAGS],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output folder")
    parser.add_argument("--scenario", action="append", type=scenario_spec, default=[], metavar="'NAME: FLAGS'",
                        help="run a named scenario into OUT/NAME (repeatable)")
    shared = parser.parse_args(argv)
    if not shared.scenario:
        return [(shared.out, shared)]
    # Attributes already in the namespace keep their value; the scenario's flags override them.
    return [(os.path.join(shared.out, name), FLAGS.parse_args(flags, namespace=copy.copy(shared)))
            for name, flags in shared.scenario]


def make_inputs(arguments, strategy, index: int, x, y) -> dict:
    """`fit` arguments feeding the same global batches in the form `--data` names."""
    batch_size, shuffle = arguments.batch_size, arguments.shuffle
    if arguments.data == "arrays":
        return dict(x=x, y=y, batch_size=batch_size, shuffle=shuffle)
    if arguments.data == "pydataset":
        import keras

        class Batches(keras.utils.PyDataset):
            """The rows as a PyDataset of global batches."""

            def __len__(self):
                return -(-len(x) // batch_size)

            def __getitem__(self, item):
                rows = slice(item * batch_size, (item + 1) * batch_size)
                return x[rows], y[rows]

        # fit(shuffle=True) shuffles the order of a PyDataset's batches.
        return dict(x=Batches(), shuffle=shuffle)
    if arguments.data == "dataloader":
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return dict(x=DataLoader(dataset, batch_size=batch_size, shuffle=shuffle))
    import tensorflow as tf

    if arguments.data == "dataset_off":
        # Each worker reads its own share of the rows: the input is pre-sharded, so sharding is OFF.
        own = slice(index, None, strategy.num_workers)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return dict(x=tf.data.Dataset.from_tensor_slices((x[own], y[own])).batch(batch_size).with_options(options))
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        dataset = dataset.shuffle(len(x), seed=5, reshuffle_each_iteration=True)
    return dict(x=dataset.batch(batch_size))


def build_model(arguments, outputs: int, loss, metrics):
    """The MLP of `common.mlp`, compiled; call inside `strategy.scope()`."""
    import keras

    synchronized = arguments.batch_norm == "synchronized"
    if synchronized and keras.backend.backend() == "jax":
        # Keras accepts synchronized=True only on TensorFlow (keras_mwms adds torch); the JAX
        # DataParallel step already computes batch statistics over the global batch.
        raise SystemExit("--batch-norm synchronized is not available on JAX: use --batch-norm local "
                         "(the DataParallel path normalizes over the global batch anyway)")
    model = common.mlp(outputs, batch_norm=arguments.batch_norm is not None, dropout=arguments.dropout,
                       synchronized=synchronized, custom_train_step=arguments.custom_train_step)
    accumulation = {"gradient_accumulation_steps": arguments.accumulation} if arguments.accumulation else {}
    if arguments.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(arguments.learning_rate or 0.05, momentum=arguments.momentum,
                                         **accumulation)
    else:
        optimizer = keras.optimizers.Adam(arguments.learning_rate or 1e-2, **accumulation)
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics, steps_per_execution=arguments.steps_per_execution,
                  jit_compile=True if arguments.jit_compile else "auto")
    return model


def weight_sum(model) -> float:
    import numpy as np

    return float(sum(np.abs(weight).sum() for weight in model.get_weights()))


def make_recorder(arguments, index: int):
    """A callback counting batches per epoch, recording the weights at train begin, injecting faults."""
    import keras

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches: list[int] = []
            self.weight_sum_at_train_begin = None

        def on_train_begin(self, logs=None):
            self.weight_sum_at_train_begin = weight_sum(self.model)

        def on_epoch_begin(self, epoch, logs=None):
            self.batches.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.batches[-1] += 1
            if arguments.seconds_per_batch:
                time.sleep(arguments.seconds_per_batch)
            if index == arguments.kill_worker and batch == arguments.kill_after_batch:
                common.log(f"simulating a crash at {time.time():.3f}: os._exit(9)")
                os._exit(9)

    return Recorder()


def PathLength(out: str, index: int):
    """A callback summing |weight change| over the steps, per weight; dumped at train end."""
    import keras
    import numpy as np

    class PathLength(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.previous = [np.asarray(weight, np.float64) for weight in self.model.get_weights()]
            self.lengths = [np.zeros_like(weight) for weight in self.previous]

        def on_train_batch_end(self, batch, logs=None):
            current = [np.asarray(weight, np.float64) for weight in self.model.get_weights()]
            for length, before, after in zip(self.lengths, self.previous, current):
                length += np.abs(after - before)
            self.previous = current

        def on_train_end(self, logs=None):
            np.savez(os.path.join(out, f"w{index}.path.npz"), *self.lengths)

    return PathLength()


def backend_details(strategy, model) -> dict:
    """What only one backend reports about how it trained."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        # "flat" (keras_mwms' own step, one all-reduce) or "dataparallel" (SPMD over the global batch).
        return {"path": strategy.backend.model_path(model)}
    if backend == "torch":
        from keras_mwms.backends.torch.state import diagnostics

        # Gradient buckets reduced during backward; steps whose metric states rode in the last
        # gradient bucket; Adam updates run in place. 0 where the fast path was not taken.
        return diagnostics(model)
    return {}


def graph_breaks():
    """torch: a context recording TorchDynamo's graph breaks (`jit_compile=True`); else nothing."""
    import contextlib

    import keras

    if keras.backend.backend() != "torch":
        return contextlib.nullcontext()
    from keras_mwms.benchmark.graph_breaks import GraphBreaks

    return GraphBreaks()


def record_primitives_jax(strategy, index: int) -> dict:
    """The custom-loop API on JAX: numpy values per replica, tf.data global batches."""
    import numpy as np
    import tensorflow as tf

    results = {}
    strategy.barrier("primitives")
    results["broadcast"] = strategy.backend.broadcast_object({"from": index, "tag": "hello"})
    per_replica = strategy.run(lambda v: v * 1.0, args=(np.float32(index + 1),))
    results["local_results"] = len(strategy.experimental_local_results(per_replica))
    results["reduce_sum"] = float(strategy.reduce("SUM", per_replica, axis=None))
    results["reduce_mean"] = float(strategy.reduce("MEAN", per_replica, axis=None))
    # A custom loop reduces whole nests, e.g. (loss, gradients); mixed dtypes on purpose.
    nested = strategy.run(lambda v: (v, [np.full(3, v, "float32"), np.float16(2 * v)]), args=(np.float32(index + 1),))
    for op in ("SUM", "MEAN"):
        total, (vector, half) = strategy.reduce(op, nested, axis=None)
        results[f"reduce_nested_{op.lower()}"] = [float(total), vector.tolist(), float(half), str(half.dtype)]
    global_batches = tf.data.Dataset.from_tensor_slices(np.arange(16, dtype="float32")).batch(8)
    results["distributed_sums"] = [
        float(strategy.reduce("SUM", strategy.run(lambda b: b.sum(), args=(batch,)), axis=None))
        for batch in strategy.experimental_distribute_dataset(global_batches)]
    return results


def record_primitives_torch(strategy, index: int) -> dict:
    """The custom-loop API on torch: torch tensors per replica, lists of numpy global batches."""
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
    strategy.barrier("primitives")

    def dataset_fn(context: keras_mwms.InputContext):
        batch = context.get_per_replica_batch_size(8)
        rows = np.arange(32, dtype="float32")[context.input_pipeline_id::context.num_input_pipelines]
        return [rows[i:i + batch] for i in range(0, len(rows), batch)]

    results["from_function"] = [b.tolist() for b in strategy.distribute_datasets_from_function(dataset_fn)]
    global_batches = [np.arange(i, i + 8, dtype="float32") for i in range(0, 32, 8)]
    results["distributed"] = [b.tolist() for b in strategy.experimental_distribute_dataset(global_batches)]
    return results


def record_primitives(strategy, index: int) -> dict:
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        return record_primitives_jax(strategy, index)
    if backend == "torch":
        return record_primitives_torch(strategy, index)
    raise SystemExit(f"--primitives is not implemented for {backend}: tests/workers/tensorflow_seed.py "
                     "exercises the TensorFlow custom-loop API")


def run_scenario(strategy, out: str, arguments) -> None:
    import keras
    import numpy as np

    index = strategy.worker_index
    keras.utils.set_random_seed(arguments.seed + (index if arguments.seed_by_worker else 0))
    state = np.random.get_state()
    seed_probe = float(np.random.random())
    np.random.set_state(state)   # the probe must not move what the scenario draws next
    if arguments.task == "classification":
        data, outputs = common.classification_data, common.NUM_CLASSES
        loss, metrics = keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]
    else:
        data, outputs, loss, metrics = common.regression_data, 1, "mse", ["mae"]
    x, y = data(arguments.rows)
    import dataclasses

    changes = {"compression": arguments.compression}
    if arguments.no_torch_overlap:
        changes["torch_overlap"] = False
    # This scenario's options, put back when it ends: in a warm process (`tests/workers/jobs.py`)
    # the next job must not train compressed because this one did.
    before = strategy.backend.options
    strategy.backend.options = dataclasses.replace(before, **changes)
    try:
        _fit_and_dump(strategy, out, arguments, index, data, outputs, loss, metrics, x, y, seed_probe)
    finally:
        strategy.backend.options = before


def _fit_and_dump(strategy, out: str, arguments, index: int, data, outputs: int, loss, metrics, x, y,
                  seed_probe: float) -> None:
    import keras
    import numpy as np

    with strategy.scope():
        model = build_model(arguments, outputs, loss, metrics)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"w{index}.init.npz"), *model.get_weights())
    weight_sum_before_fit = weight_sum(model)

    verbose = arguments.verbose if arguments.verbose == "auto" else int(arguments.verbose)
    fit_kwargs = make_inputs(arguments, strategy, index, x, y)
    if arguments.validation == "data":
        fit_kwargs.update(validation_data=data(96, seed=3))
    elif arguments.validation == "split":
        fit_kwargs.update(validation_split=0.25)
    recorder = make_recorder(arguments, index)
    callbacks = [recorder] + ([PathLength(out, index)] if arguments.record_path else [])
    from keras_mwms.backends.compression import WIRE

    WIRE.reset()
    from keras_mwms.diagnostics import LEDGER

    collectives_before = dict(LEDGER.kinds)
    started = time.time()
    breaks = graph_breaks()
    with breaks:
        for _ in range(arguments.fits):
            history = model.fit(**fit_kwargs, epochs=arguments.epochs, steps_per_epoch=arguments.steps_per_epoch,
                                callbacks=callbacks, verbose=verbose)
    fit_seconds = time.time() - started
    wire_bytes_per_step = WIRE.per_step(sum(recorder.batches))
    collectives = {kind: count - collectives_before.get(kind, 0) for kind, count in LEDGER.kinds.items()
                   if count > collectives_before.get(kind, 0)}

    evaluate_batch_size = arguments.evaluate_batch_size or arguments.batch_size
    if arguments.evaluate_on == "holdout":
        x_eval, y_eval = data(100, seed=9)
        sample_weight = np.linspace(0.5, 2.0, len(x_eval)).astype("float32")
    else:
        x_eval, y_eval, sample_weight = x, y, None
    if arguments.evaluate_on == "none":
        evaluation, prediction = {}, np.zeros((0,), "float32")
    else:
        evaluation = model.evaluate(x_eval, y_eval, sample_weight=sample_weight, batch_size=evaluate_batch_size,
                                    verbose=verbose, return_dict=True)
        prediction = model.predict(x_eval, batch_size=evaluate_batch_size, verbose=verbose)
    np.save(os.path.join(out, f"w{index}.predict.npy"), prediction)
    results = dict(
        history={key: [float(value) for value in values] for key, values in history.history.items()},
        evaluate={key: float(value) for key, value in evaluation.items()},
        batches=recorder.batches,
        replicas=strategy.num_replicas_in_sync,
        is_chief=strategy.is_chief,
        seed_probe=seed_probe,
        weight_sum_before_fit=weight_sum_before_fit,
        weight_sum_at_train_begin=recorder.weight_sum_at_train_begin,
        optimizer_class=type(model.optimizer).__module__,
        optimizer_iterations=int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        predict_shape=list(prediction.shape),
        fit_seconds=fit_seconds,
        wire_bytes_per_step=wire_bytes_per_step,
        fit_collectives=collectives,
        graph_breaks=getattr(breaks, "count", None),
        graph_break_reasons=getattr(breaks, "reasons", None),
        recompile_limit_hits=getattr(breaks, "recompile_limit_hits", None),
        **backend_details(strategy, model),
    )
    if arguments.primitives:
        results.update(record_primitives(strategy, index))
    common.save_result(out, index, model, **results)
    common.log("done", out, results["evaluate"])


def load_dump(out: str, index: int) -> dict:
    """What `run_scenario` wrote for worker `index` under `out`: the json fields plus `initial`
    and `final` (lists of weight arrays) and `predictions`."""
    import numpy as np

    result = common.load_result(out, index)
    with np.load(os.path.join(out, f"w{index}.init.npz")) as initial:
        result["initial"] = [initial[f"arr_{i}"] for i in range(len(initial.files))]
    result["final"] = common.load_weights(out, index)
    result["predictions"] = np.load(os.path.join(out, f"w{index}.predict.npy"))
    return result


def run_job(strategy, argv: list[str]) -> None:
    """Every scenario of the command line `argv` (without the script), in `strategy`
    (`tests/workers/jobs.py` runs it in a warm process; `main` in a fresh one)."""
    if strategy is None:
        raise SystemExit("fit_scenario needs a keras_mwms strategy: it cannot run in a plain-Keras process")
    common.log(f"worker {strategy.worker_index}/{strategy.num_workers}, replicas {strategy.num_replicas_in_sync}")
    for out, arguments in parse_command_line(argv):
        common.log("scenario", out)
        run_scenario(strategy, out, arguments)


def main() -> None:
    scenarios = sys.argv[1:]
    parse_command_line(scenarios)   # a bad flag fails before the strategy starts
    import keras_mwms

    run_job(keras_mwms.MultiWorkerMirroredStrategy(), scenarios)


if __name__ == "__main__":
    main()
