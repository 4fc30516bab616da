"""`ExampleLedger`: which global examples every training step consumed, across crashes (for tests).

A test that kills and restarts a job wants to prove "every example exactly once per epoch, none
repeated, none skipped". This callback writes, after every training step, the global example
ids of that step's global batch — the ids the input *served* for that step, read off the
resumable input (`keras_mwms.resume.resumable_inputs`), not recomputed — and this worker's share of
them (its rows of the global batch, `keras_mwms.data.replica_slices`), one JSON line per step,
to `<directory>/ledger.w<worker>.jsonl`, flushed at once so a SIGKILL loses nothing already
written. Each process's first line (`"event": "begin"`) says where it started: the epoch and
step it resumed at, the attempt (`KERAS_MWMS_ATTEMPT`) and the worker count.

`effective_steps(records)` replays such lines: the steps a later attempt trained again (after
the backup it resumed from) replace the earlier attempt's, as their updates did.

Global example ids: a row's index for arrays and torch datasets; for a `PyDataset`, batch `b`'s
row `r` is `b × (rows of batch 0) + r`.

Example:

```python
ledger = keras_mwms.example_ledger.ExampleLedger("/tmp/ledger")
model.fit(x, y, shuffle=True, epochs=2, callbacks=[backup, ledger])
```
"""

from __future__ import annotations

import json
import os

import keras

from keras_mwms import settings
from keras_mwms.callbacks import coordination
from keras_mwms.data import replica_slices
from keras_mwms.resume import resumable_inputs


class ExampleLedger(keras.callbacks.Callback):
    """Records the global example ids of every training step, per worker (see the module doc).

    Opt-in, for tests: shuffled inputs of a fit with this callback take keras_mwms' resumable
    order, as with `keras_mwms.callbacks.BackupAndRestore`.

    Example:

    >>> ledger = ExampleLedger("/tmp/ledger")
    >>> ledger.directory
    '/tmp/ledger'

    Args:
        directory: where `ledger.w<worker>.jsonl` is appended to (created if missing).
    """

    keras_mwms_resumable_order = True

    def __init__(self, directory: str):
        super().__init__()
        self.directory = str(directory)
        self._epoch = 0
        self._begun = False

    def _write(self, record: dict) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"ledger.w{coordination.worker_index()}.jsonl")
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def on_train_begin(self, logs=None):
        self._begun = False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        fit_input = resumable_inputs.active_for(self.model)
        stream = fit_input.stream if fit_input is not None else None
        if stream is None:
            raise ValueError(
                "ExampleLedger: this fit's input has no resumable order, so the ledger cannot "
                "tell which examples a step used. Use arrays or a keras.utils.PyDataset with "
                "shuffle=True, or a torch DataLoader that shuffles, on a keras_mwms strategy.")
        order = stream.order
        if not self._begun:
            self._begun = True
            epoch, step = order.locate(order.start)
            self._write({"event": "begin", "epoch": epoch, "step": step,
                         "attempt": settings.ATTEMPT.read(),
                         "workers": coordination.num_workers(), "seed": order.seed,
                         "steps_per_epoch": order.steps_per_epoch})
        position = order.position(self._epoch, batch)
        served = stream.served.get(position)
        if served is None:
            raise RuntimeError(f"ExampleLedger: step {batch} of epoch {self._epoch + 1} trained, "
                               f"but the input served no batch for stream position {position}.")
        workers, worker = coordination.num_workers(), coordination.worker_index()
        start, stop = replica_slices(stream.global_batch_rows, workers, len(served))[worker]
        self._write({"epoch": self._epoch, "step": batch, "ids": served.tolist(),
                     "local": served[start:stop].tolist()})


def read_ledger(directory: str, worker: int) -> list[dict]:
    """The lines `ExampleLedger` wrote for `worker` in `directory`, in order.

    Example:

    >>> read_ledger("/nonexistent", 0)
    []
    """
    path = os.path.join(directory, f"ledger.w{worker}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def effective_steps(records: list[dict]) -> dict[tuple[int, int], dict]:
    """`(epoch, step)` → the record whose update the final weights hold.

    A process that resumed at `(epoch, step)` (its `begin` line) trained every later step again
    from the backup: its records replace those of earlier processes from that point on, and
    the steps an earlier process trained past the backup are dropped (their updates were lost
    with it).

    Example:

    >>> lines = [{"event": "begin", "epoch": 0, "step": 0}, {"epoch": 0, "step": 0, "ids": [1]},
    ...          {"epoch": 0, "step": 1, "ids": [2]},          # lost: the backup was at step 1
    ...          {"event": "begin", "epoch": 0, "step": 1}, {"epoch": 0, "step": 1, "ids": [3]}]
    >>> {key: record["ids"] for key, record in effective_steps(lines).items()}
    {(0, 0): [1], (0, 1): [3]}
    """
    steps: dict[tuple[int, int], dict] = {}
    for record in records:
        if record.get("event") == "begin":
            resumed = (record["epoch"], record["step"])
            steps = {key: value for key, value in steps.items() if key < resumed}
            continue
        steps[(record["epoch"], record["step"])] = record
    return steps
