"""Version smoke worker: 2 epochs of SGD, then of Adam, on a small MLP, as a worker or as plain Keras.

Runs in each worker of a gang (`keras_mwms.MultiWorkerMirroredStrategy`) and, with
`--reference`, as one process of plain Keras (no keras_mwms) — whatever Keras release the
environment carries (`scripts/version_smoke.py` puts an overlay first on PYTHONPATH).

With `--backup DIR --kill-at-step K`, worker 1 SIGKILLs itself after global step K on the
launcher's first attempt; `keras_mwms.callbacks.BackupAndRestore(DIR, save_freq=4)` makes the
restarted gang resume at the saved step, so its final weights must equal the reference's.

On torch each worker also counts the collectives of four steady-state steps of the SGD fit
with torch's profiler (every `c10d::` operation, whoever issues it: keras_mwms, or Keras' own
torch distribution from 3.16 on, its DDP reducer included), so a Keras release that adds a
collective per step shows up in the smoke.

The suite runs the installed release's cell in its shared warm gangs (`run_job`,
`tests/test_versions.py`); the smoke runs the other releases as scripts.

Writes `<out>/w<index>.npz` (final weights) and `<out>/w<index>.json` (Keras version, history,
evaluate loss, collectives per step), and the Adam model's `<out>/adam/w<index>.npz` (16
steps: Adam amplifies reduction-order noise, so it is compared over at most 20).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import common

PARSER = argparse.ArgumentParser()
PARSER.add_argument("--out", required=True)
PARSER.add_argument("--reference", action="store_true", help="one process of plain Keras")
PARSER.add_argument("--backup", default=None)
PARSER.add_argument("--kill-at-step", type=int, default=-1)
PARSER.add_argument("--jit-compile", action="store_true", help="compile(jit_compile=True) (manual runs)")

EPOCHS, GLOBAL_BATCH = 2, 32


def run_job(strategy, argv: list[str]) -> None:
    """The SGD fit and the Adam fit of the command line `argv` in `strategy` (None: one process of
    plain Keras); `tests/workers/jobs.py` runs it in a warm process."""
    import keras

    arguments = PARSER.parse_args(argv)
    x, y = common.regression_data(rows=256)

    def build(optimizer=None):
        keras.utils.set_random_seed(5)
        model = common.mlp(hidden=16)
        model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                      jit_compile=True if arguments.jit_compile else "auto")
        return model

    def in_scope(make):
        if strategy is None:
            return make()
        with strategy.scope():
            return make()

    index = 0 if strategy is None else strategy.worker_index
    model = in_scope(build)
    callbacks, counter = [], None
    if strategy is not None and arguments.backup:
        import keras_mwms

        callbacks = [keras_mwms.callbacks.BackupAndRestore(arguments.backup, save_freq=4),
                     _kill_worker_one(keras, index, arguments.kill_at_step)]
    elif strategy is not None and keras.backend.backend() == "torch":
        counter = _count_collectives(keras)
        callbacks = [counter]
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        callbacks=callbacks)
    loss = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)["loss"]
    common.save_result(arguments.out, index, model, keras=keras.__version__, backend=keras.backend.backend(),
                       history=history.history, evaluate_loss=loss,
                       collectives_per_step=counter.per_step if counter else None)
    if not arguments.backup:
        adam = in_scope(lambda: build(keras.optimizers.Adam(0.01)))
        adam.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        common.save_result(os.path.join(arguments.out, "adam"), index, adam, keras=keras.__version__)
    common.log("done", keras.__version__)


def _count_collectives(keras):
    class CountCollectives(keras.callbacks.Callback):
        """torch: the collectives per step of the first epoch's steps FIRST..LAST, by torch's profiler."""

        FIRST, LAST = 2, 5

        def __init__(self):
            super().__init__()
            self.profiler, self.epoch, self.per_step = None, 0, None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if self.epoch == 0 and batch == self.FIRST:
                import torch.profiler

                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.__enter__()

        def on_train_batch_end(self, batch, logs=None):
            if self.profiler is not None and batch == self.LAST:
                self.profiler.__exit__(None, None, None)
                counts: dict[str, int] = {}
                for event in self.profiler.events():
                    if event.name.startswith("c10d::"):
                        counts[event.name] = counts.get(event.name, 0) + 1
                steps = self.LAST - self.FIRST + 1
                self.per_step, self.profiler = {name: count / steps for name, count in counts.items()}, None

    return CountCollectives()


def _kill_worker_one(keras, index: int, step: int):
    class KillWorkerOne(keras.callbacks.Callback):
        """SIGKILLs worker 1 after global step `step`, on the launcher's first attempt only."""

        def __init__(self):
            super().__init__()
            self.steps = 0

        def on_train_batch_end(self, batch, logs=None):
            self.steps += 1
            if index == 1 and self.steps == step and os.environ.get("KERAS_MWMS_ATTEMPT", "0") == "0":
                common.log(f"fault injection: SIGKILL after step {self.steps}")
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    return KillWorkerOne()


def main() -> None:
    strategy = None
    if not PARSER.parse_args().reference:
        import keras_mwms

        strategy = keras_mwms.MultiWorkerMirroredStrategy()
    run_job(strategy, sys.argv[1:])


if __name__ == "__main__":
    main()
