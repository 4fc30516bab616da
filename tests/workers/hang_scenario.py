"""Hang and straggler scenarios for the hang report and the straggler table (every backend).

    python hang_scenario.py OUT_DIR --fault data|desync|sigstop|chief-evaluate|usr1|none [options] --marker UNIQUE

Every worker trains a small MLP on a `keras.utils.PyDataset` of global batches: a warm-up
`fit` of one epoch (compiles, traces, first collectives), then the faulty part on worker
`--worker` (default 1):

* `data`: its PyDataset sleeps `--sleep` seconds making batch `--at-batch` of the second fit;
* `desync`: it runs one extra `model.train_on_batch` between the two fits;
* `callback-desync`: it runs one extra `model.train_on_batch` inside a callback's
  `on_epoch_end` of the second fit's first epoch (a user's callback doing work on one worker);
* `sigstop`: it stops itself (SIGSTOP) at batch `--at-batch` of the second fit;
* `chief-evaluate`: the tf.distribute habit `if strategy.is_chief: model.evaluate(...)` after the
  warm-up fit (the chief is the faulty worker); the other workers' scripts end there;
* `usr1`: making batch `--at-batch` of the second fit, it asks for a report (`kill -USR1`
  itself) and sleeps `--sleep` seconds, so the report catches it outside a collective while
  its peer waits in one; the job is healthy and must finish;
* `none`: a fit of `--epochs` epochs as it is, then one where `--delay D` makes worker
  `--worker`'s PyDataset sleep D seconds per batch (a straggler).

The faulting worker writes `OUT/fault.json` (worker, kind, wall-clock time). A worker whose
second fit returns writes `OUT/w<index>.json` with `completed: true` and the chief's straggler
reports of that fit (`--tensorboard DIR` adds `keras_mwms.callbacks.TensorBoard`).
`--marker` only tags the command line (orphan checks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

GLOBAL_BATCH = 32


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fault", choices=("data", "desync", "callback-desync", "sigstop", "chief-evaluate", "usr1", "none"), required=True)
    parser.add_argument("--worker", type=int, default=1)
    parser.add_argument("--at-batch", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=30.0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--tensorboard", default=None, help="log directory of our TensorBoard")
    parser.add_argument("--shuffle", action="store_true", help="fit with shuffle=True")
    parser.add_argument("--with-block", action="store_true",
                        help="train inside `with strategy:` (closed as an error leaves it)")
    parser.add_argument("--marker", default="")
    return parser.parse_args()


def record_fault(out: str, index: int, kind: str) -> None:
    with open(os.path.join(out, "fault.json"), "w") as handle:
        json.dump({"worker": index, "kind": kind, "time": time.time()}, handle)
    print(f"FAULT {kind} on worker {index} at {time.time():.3f}", flush=True)


def main() -> None:
    arguments = parse_arguments()
    os.makedirs(arguments.out, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    import keras_mwms

    index = common.worker_index()
    faulty = index == arguments.worker
    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    with strategy if arguments.with_block else contextlib.nullcontext():
        train(arguments, strategy, index, faulty)


def train(arguments: argparse.Namespace, strategy, index: int, faulty: bool) -> None:
    """The scenario's model, fits and fault (see the module docstring)."""
    import common
    import keras

    import keras_mwms
    from keras_mwms.diagnostics import straggler

    x, y = common.regression_data(GLOBAL_BATCH * arguments.batches)

    class Batches(keras.utils.PyDataset):
        """Global batches of (x, y); the faulty worker's copy sleeps where the scenario says."""

        def __init__(self):
            super().__init__()
            self.armed = False

        def __len__(self):
            return arguments.batches

        def __getitem__(self, item):
            if self.armed and faulty:
                if arguments.fault in ("data", "usr1") and item == arguments.at_batch:
                    self.armed = False
                    record_fault(arguments.out, index, arguments.fault)
                    if arguments.fault == "usr1":
                        os.kill(os.getpid(), signal.SIGUSR1)
                    time.sleep(arguments.sleep)
                if arguments.delay:
                    time.sleep(arguments.delay)
            rows = slice(item * GLOBAL_BATCH, (item + 1) * GLOBAL_BATCH)
            return x[rows], y[rows]

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if arguments.fault == "sigstop" and faulty and batch == arguments.at_batch:
                record_fault(arguments.out, index, "sigstop")
                os.kill(os.getpid(), signal.SIGSTOP)

        def on_epoch_end(self, epoch, logs=None):
            if arguments.fault == "callback-desync" and faulty and epoch == 0 and data.armed:
                record_fault(arguments.out, index, "callback-desync")
                self.model.train_on_batch(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])

    with strategy.scope():
        model = common.mlp()
        model.compile(optimizer="sgd", loss="mse")
    data = Batches()
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    common.log("warm-up fit done")
    if arguments.fault == "chief-evaluate":
        if strategy.is_chief:
            record_fault(arguments.out, index, "chief-evaluate")
            model.evaluate(data, verbose=0)
        common.save_result(arguments.out, index, completed=True, epoch_reports=[])
        return
    if arguments.fault == "desync" and faulty:
        record_fault(arguments.out, index, "desync")
        model.train_on_batch(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])
    reports = []

    class Reports(keras.callbacks.Callback):
        """Keeps the chief's straggler report of every epoch of the fit it is given to."""

        def __init__(self, fit):
            super().__init__()
            self.fit = fit

        def on_epoch_end(self, epoch, logs=None):
            report = straggler.last_epoch_report()
            if report is not None and report["epoch"] == epoch:
                reports.append({"fit": self.fit, **report})

    if arguments.fault == "none":   # the straggler case: a fit without the delay first
        model.fit(data, epochs=arguments.epochs, verbose=0, shuffle=False, callbacks=[Reports("plain")])
    data.armed = True
    callbacks = [StopAt(), Reports("delayed" if arguments.delay else "plain")]
    if arguments.tensorboard:
        callbacks.append(keras_mwms.callbacks.TensorBoard(arguments.tensorboard))
    model.fit(data, epochs=arguments.epochs, verbose=0, shuffle=arguments.shuffle, callbacks=callbacks)
    common.save_result(arguments.out, index, completed=True, epoch_reports=reports)


if __name__ == "__main__":
    main()
