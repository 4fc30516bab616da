"""The row ledger: a model whose weights record which rows every step used, and with what weight.

Runs in every worker of a gang, and with `--plain` as the reference (one process of plain
Keras; keras_mwms is not imported at all):

    python row_ledger.py OUT BACKEND [--plain] [--only VARIANT,VARIANT]

The model is `Dense(1, use_bias=False, kernel_initializer="zeros")` on one-hot row ids
(`x = identity(ROWS)`), trained with a loss that returns `y_pred` itself, reduced by Keras'
default "sum_over_batch_size", and `SGD(learning_rate=1.0)`. The gradient does not depend on
the weights: one step changes kernel row i by exactly `-(times row i is in the global batch) /
(rows in the global batch)`. A callback records the kernel after every batch, so the ledger of
kernels shows every step's rows and weights: data correctness by construction.

`ROWS = 50` rows in global batches of `GLOBAL_BATCH = 8`: six full batches and a last one of 2
rows; on 3 workers a full batch splits 3/3/2 and the last 1/1/0 (an empty shard).

Each variant (one input pipeline, see `VARIANTS`) builds its own model from the same seed and
writes `OUT/<variant>/ledger<index>.npy` (kernel after every step, steps × ROWS float32) and
`OUT/<variant>/w<index>.json` (epoch and batch of every step, or the error it raised). A variant
that raises is recorded and the next one runs; a per-variant watchdog ends a hung worker.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROWS = 50
GLOBAL_BATCH = 8
EPOCHS = 2
SEED = 1234
TFDATA_SHUFFLE_SEED = 5
# A variant is 14 steps; even a loaded 2-core box runs one in well under a minute.
VARIANT_DEADLINE_SECONDS = 180

# name → (input kind, shuffle, tf.data AutoShardPolicy name or None, seeds differ by worker).
# Ordered so that the variants most likely to break the collective group (mismatched step
# counts) run last.
VARIANTS = {
    "arrays": ("arrays", False, None, False),
    "arrays_shuffled": ("arrays", True, None, False),
    "pydataset": ("pydataset", False, None, False),
    "pydataset_shuffled": ("pydataset", True, None, False),
    "tfdata_auto": ("tfdata", False, "AUTO", False),
    "tfdata_auto_shuffled": ("tfdata", True, "AUTO", False),
    "tfdata_data": ("tfdata", False, "DATA", False),
    "tfdata_data_shuffled": ("tfdata", True, "DATA", False),
    "dataloader": ("dataloader", False, None, False),
    "dataloader_shuffled": ("dataloader", True, None, False),
    # As most scripts run: each worker's global RNGs seeded differently (the chief with SEED).
    # `shuffle=True` must still give one global order, the chief's, as in one process. A tf.data
    # shuffle is the user's own pipeline, seeded by the user, so it is not among these.
    "arrays_shuffled_worker_seeds": ("arrays", True, None, True),
    "pydataset_shuffled_worker_seeds": ("pydataset", True, None, True),
    "dataloader_shuffled_worker_seeds": ("dataloader", True, None, True),
    "generator": ("generator", False, None, False),
    "tfdata_off": ("tfdata_off", False, "OFF", False),
}
TORCH_ONLY = ("dataloader", "dataloader_shuffled", "dataloader_shuffled_worker_seeds")
# AutoShardPolicy.OFF: each worker feeds its own part of the rows; one process has no such parts.
OFF_VARIANTS = ("tfdata_off",)


def reference_variant(name: str) -> str | None:
    """The plain-Keras variant `name` must match: the chief's seed is SEED; None for OFF."""
    if name in OFF_VARIANTS:
        return None
    return name.removesuffix("_worker_seeds")


def variants_for(backend: str, plain: bool) -> list[str]:
    """The variants a run on `backend` covers (the plain reference: those the gangs compare with)."""
    return [name for name in VARIANTS
            if (backend == "torch" or name not in TORCH_ONLY)
            and (not plain or reference_variant(name) == name)]


def steps_per_epoch() -> int:
    return -(-ROWS // GLOBAL_BATCH)


def off_part(num_workers: int, worker_index: int) -> tuple[int, int]:
    """Rows `[start, stop)` that worker `worker_index` feeds under AutoShardPolicy.OFF.

    Every worker gets the same number of rows, so the same number of batches (OFF needs equal
    lengths), and that number is not a multiple of GLOBAL_BATCH, so each part ends in a partial
    batch: 25 rows each on 2 workers, 15 each (rows 45-49 unused) on 3.
    """
    length = ROWS // num_workers
    while length % GLOBAL_BATCH == 0:
        length -= 1
    return worker_index * length, (worker_index + 1) * length


def ledger_loss(y_true, y_pred):
    """The prediction itself: its mean over the batch has gradient `count(row) / batch rows`."""
    return y_pred


def make_input(kind: str, shuffle: bool, policy: str | None, num_workers: int, worker_index: int):
    """`fit` keyword arguments feeding the ledger rows as global batches of GLOBAL_BATCH."""
    import numpy as np

    x = np.eye(ROWS, dtype="float32")
    y = np.zeros((ROWS, 1), dtype="float32")
    if kind == "arrays":
        return dict(x=x, y=y, batch_size=GLOBAL_BATCH, shuffle=shuffle)
    if kind == "generator":
        def global_batches():
            while True:
                for start in range(0, ROWS, GLOBAL_BATCH):
                    yield x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]

        return dict(x=global_batches(), steps_per_epoch=steps_per_epoch())
    if kind == "pydataset":
        import keras

        class LedgerBatches(keras.utils.PyDataset):
            def __len__(self):
                return steps_per_epoch()

            def __getitem__(self, index):
                rows = slice(index * GLOBAL_BATCH, (index + 1) * GLOBAL_BATCH)
                return x[rows], y[rows]

        return dict(x=LedgerBatches(), shuffle=shuffle)
    if kind in ("tfdata", "tfdata_off"):
        import tensorflow as tf

        if kind == "tfdata_off":
            start, stop = off_part(num_workers, worker_index)
            x, y = x[start:stop], y[start:stop]
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        if shuffle:
            dataset = dataset.shuffle(len(x), seed=TFDATA_SHUFFLE_SEED, reshuffle_each_iteration=True)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = getattr(
            tf.data.experimental.AutoShardPolicy, policy)
        return dict(x=dataset.batch(GLOBAL_BATCH).with_options(options))
    if kind == "dataloader":
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return dict(x=DataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=shuffle))
    raise ValueError(f"unknown input kind {kind!r}")


def run_variant(strategy, name: str, out: str, index: int) -> None:
    import keras
    import numpy as np

    kind, shuffle, policy, seed_by_worker = VARIANTS[name]
    ledger, epochs, batches = [], [], []

    class Ledger(keras.callbacks.Callback):
        """Records the kernel after every training batch."""

        def __init__(self):
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            ledger.append(np.asarray(self.model.get_weights()[0], dtype="float32").reshape(-1).copy())
            epochs.append(self.epoch)
            batches.append(int(batch))

    keras.utils.set_random_seed(SEED + 1000 * index if seed_by_worker else SEED)
    num_workers = strategy.num_workers if strategy is not None else 1
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential([
            keras.Input((ROWS,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=1.0), loss=ledger_loss)
    model.fit(**make_input(kind, shuffle, policy, num_workers, index), epochs=EPOCHS, verbose=0,
              callbacks=[Ledger()])
    np.save(os.path.join(out, f"ledger{index}.npy"),
            np.stack(ledger) if ledger else np.zeros((0, ROWS), "float32"))
    common.save_result(out, index, variant=name, status="done", error=None, epochs=epochs,
                       batches=batches, num_workers=num_workers)


PARSER = argparse.ArgumentParser()
PARSER.add_argument("out")
PARSER.add_argument("backend", help="the KERAS_BACKEND this run uses (chooses the variants)")
PARSER.add_argument("--plain", action="store_true", help="plain Keras, one process (the reference)")
PARSER.add_argument("--only", default="", help="comma-separated variant names (default: all)")


def run_job(strategy, argv: list[str]) -> None:
    """The variants of the command line `argv` (without the script) in `strategy` (None: plain
    Keras), one after another (`tests/workers/jobs.py` runs it in a warm process)."""
    arguments = PARSER.parse_args(argv)
    index = strategy.worker_index if strategy is not None else 0
    names = arguments.only.split(",") if arguments.only else variants_for(arguments.backend, strategy is None)
    for name in names:
        target = os.path.join(arguments.out, name)
        os.makedirs(target, exist_ok=True)
        common.save_result(target, index, variant=name, status="started", error=None)
        common.log("variant", name)
        faulthandler.dump_traceback_later(VARIANT_DEADLINE_SECONDS, exit=True)
        try:
            run_variant(strategy, name, target, index)
        except Exception as error:  # recorded for the test; the next variant still runs
            common.log("variant", name, "raised", type(error).__name__)
            common.save_result(target, index, variant=name, status="error",
                               error=f"{type(error).__name__}: {error}"[:2000],
                               traceback=traceback.format_exc()[-6000:])
        finally:
            faulthandler.cancel_dump_traceback_later()
    common.log("done")


def main() -> None:
    strategy = None
    if not PARSER.parse_args().plain:
        import keras_mwms

        # First, before any Keras or TensorFlow op: TensorFlow needs the strategy before its runtime starts.
        strategy = keras_mwms.MultiWorkerMirroredStrategy()
    run_job(strategy, sys.argv[1:])


if __name__ == "__main__":
    main()
