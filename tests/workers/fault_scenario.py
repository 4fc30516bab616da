"""One fault-injection scenario for every backend (`KERAS_BACKEND`); options choose the fault.

    python fault_scenario.py OUT_DIR [options] --marker UNIQUE

Start-up faults (before or around the strategy):

* `--late-worker I --late-seconds S`: worker I waits until the chief is in the rendezvous, then
  S seconds more, before it imports anything (so the chief waits at least S seconds);
* `--extra-host HOST:PORT`: a worker that does not exist (e.g. `no-such-host.invalid:1`) is
  appended to the cluster in TF_CONFIG, so the live workers must name it;
* `--change-tf-config`: TF_CONFIG is changed after the strategy was created (fit must warn).

Training faults (worker I, at batch `--at-batch` of the first epoch):

* `--stop-worker I`: the worker stops itself with SIGSTOP (a hung peer);
* `--raise-worker I`: a callback raises `RuntimeError` on that worker only;
* `--uneven-worker I --uneven-rows N`: a first `fit` where that worker passes only N rows
  (its error is recorded as `uneven_error`), then the run goes on with the other options;
* `--nan-worker I`: that worker's data has NaN targets at that batch (use with TerminateOnNaN).

Writes `OUT/w<index>.json` (error, warnings, history, seconds) and `w<index>.npz` when fit
returned; the faulting worker writes `OUT/fault.json` with the wall-clock time of the fault.
Exits 2 when the strategy or fit raised. `--marker` is not used: it tags the command line so
the test can find orphan processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

BATCH_SIZE = 32


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--marker", default="")
    parser.add_argument("--late-worker", type=int, default=None)
    parser.add_argument("--late-seconds", type=float, default=0.0)
    parser.add_argument("--extra-host", default=None)
    parser.add_argument("--change-tf-config", action="store_true")
    parser.add_argument("--stop-worker", type=int, default=None)
    parser.add_argument("--raise-worker", type=int, default=None)
    parser.add_argument("--uneven-worker", type=int, default=None)
    parser.add_argument("--uneven-rows", type=int, default=0)
    parser.add_argument("--nan-worker", type=int, default=None)
    parser.add_argument("--at-batch", type=int, default=3)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=None,
                        help="CommunicationOptions.timeout_seconds (default: the backend's)")
    return parser.parse_args()


def tf_config_index() -> int:
    return int(json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0))


def record_fault(out: str, index: int, kind: str) -> None:
    with open(os.path.join(out, "fault.json"), "w") as handle:
        json.dump({"worker": index, "kind": kind, "time": time.time()}, handle)
    print(f"FAULT {kind} on worker {index} at {time.time():.3f}", flush=True)


def main() -> None:
    arguments = parse_arguments()
    os.makedirs(arguments.out, exist_ok=True)
    index = tf_config_index()
    if arguments.late_worker == index:
        # Late relative to the chief, whatever the import times: wait until the chief is in the
        # rendezvous (its port accepts), then S seconds more, and only then import anything.
        from keras_mwms.startup.cluster import split_address
        from keras_mwms.startup.network import wait_until_accepting

        chief = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0]
        wait_until_accepting(*split_address(chief), timeout=300)
        print(f"worker {index} starts {arguments.late_seconds:.0f} s after the chief", flush=True)
        time.sleep(arguments.late_seconds)
    if arguments.extra_host:
        config = json.loads(os.environ["TF_CONFIG"])
        config["cluster"]["worker"].append(arguments.extra_host)
        os.environ["TF_CONFIG"] = json.dumps(config)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import warnings

    import common
    import keras  # noqa: F401 - imported first, as scripts do: the strategy's own time is measured
    import numpy as np

    import keras_mwms

    def fail(stage: str, error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}"
        print(f"ERROR during {stage}: {message}", flush=True)
        common.save_result(arguments.out, index, error=message, stage=stage, end_time=time.time(),
                           strategy_started=started, uneven_error=uneven_error,
                           uneven_seconds=uneven_seconds)
        sys.exit(2)

    started = time.time()
    uneven_error = uneven_seconds = None
    try:
        strategy = keras_mwms.MultiWorkerMirroredStrategy(
            keras_mwms.CommunicationOptions(timeout_seconds=arguments.timeout))
    except Exception as error:  # noqa: BLE001 - the test inspects what was raised
        fail("strategy", error)
    strategy_seconds = time.time() - started
    if arguments.change_tf_config:
        config = json.loads(os.environ["TF_CONFIG"])
        config["cluster"]["worker"] = list(reversed(config["cluster"]["worker"]))
        os.environ["TF_CONFIG"] = json.dumps(config)

    x, y = common.regression_data(arguments.rows)
    if arguments.nan_worker == index:
        y = y.copy()
        y[arguments.at_batch * BATCH_SIZE:(arguments.at_batch + 1) * BATCH_SIZE] = np.nan

    at_batch = arguments.at_batch

    class Sabotage(keras.callbacks.Callback):
        """Injects the chosen training fault on one worker, in the first epoch."""

        def __init__(self):
            super().__init__()
            self.epoch = 0
            self.last_batch = None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self.last_batch = (self.epoch, batch)
            if self.epoch or batch != at_batch:
                return
            if arguments.stop_worker == index:
                record_fault(arguments.out, index, "sigstop")
                os.kill(os.getpid(), signal.SIGSTOP)
            if arguments.raise_worker == index:
                record_fault(arguments.out, index, "raise")
                raise RuntimeError(f"injected failure in a callback on worker {index} "
                                   f"at batch {batch}")

    sabotage = Sabotage()
    callbacks = [sabotage]
    if arguments.nan_worker is not None:
        callbacks.append(keras.callbacks.TerminateOnNaN())
    with strategy.scope():
        model = common.mlp()
        model.compile(optimizer="sgd", loss="mse")
    uneven_error = uneven_seconds = None
    if arguments.uneven_worker is not None:
        rows = arguments.uneven_rows if arguments.uneven_worker == index else len(x)
        fit_started = time.time()
        try:
            model.fit(x[:rows], y[:rows], batch_size=BATCH_SIZE, epochs=1, verbose=0)
        except Exception as error:  # noqa: BLE001 - the test inspects what was raised
            uneven_error, uneven_seconds = f"{type(error).__name__}: {error}", time.time() - fit_started
            print("UNEVEN", uneven_error, flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            history = model.fit(x, y, batch_size=BATCH_SIZE, epochs=arguments.epochs, verbose=0,
                                shuffle=False, callbacks=callbacks)
        except Exception as error:  # noqa: BLE001 - recorded, then the worker exits non-zero
            fail("fit", error)
    tf_config_warnings = [str(warning.message) for warning in caught if "TF_CONFIG" in str(warning.message)]
    for text in tf_config_warnings:
        print("WARNING", text, flush=True)
    common.save_result(arguments.out, index, model, error=None, warnings=tf_config_warnings,
                       history={key: [float(v) for v in values] for key, values in history.history.items()},
                       last_batch=sabotage.last_batch, strategy_seconds=strategy_seconds,
                       strategy_started=started, uneven_error=uneven_error,
                       uneven_seconds=uneven_seconds,
                       end_time=time.time())


if __name__ == "__main__":
    main()
