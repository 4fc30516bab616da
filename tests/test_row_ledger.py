"""Row ledger: every step's rows and weights, read off the weights, on every backend and input.

`tests/workers/row_ledger.py` trains a model whose kernel changes by exactly
`-(times row i is in the step's global batch) / (rows in that global batch)` per step, and
records the kernel after every step (its docstring explains why). So the ledger shows, step
by step, which rows each step used and with what weight, and the assertions are exact:

(a) every worker's ledger is bit-identical to every other worker's;
(b) each step's kernel change is `-k/B_t` for the rows it used, `B_t` the rows of that step's
    global batch; no input here repeats a row within a global batch, so k = 1 and B_t is the
    number of rows the step moved, each by exactly 1/B_t; and the global batches have the
    pipeline's sizes, 8 rows six times and then 2 in every epoch (a shuffled PyDataset permutes
    whole batches, so there the 2-row batch may come at any step);
(c) every row is used exactly once per epoch;
(d) the steps use the same rows, in the same order, as plain Keras in one process with the same
    seed — shuffled inputs included: the seed fixes the order, and N workers must train like
    one process on the same global batches.

The ledger sees what a step does to the weights, not which replica computed which row: a
placement that keeps every row's global weight (say, a partial batch split evenly over the
replicas instead of filling them in order) passes here, as it should for the model's result.

Inputs (`row_ledger.VARIANTS`): numpy arrays, a PyDataset and a torch DataLoader (torch only),
each unshuffled, shuffled, and shuffled with every worker seeded differently (the chief with the
reference's seed; `shuffle=True` must still give one global order); tf.data unshuffled and
shuffled (shared seed, reshuffle_each_iteration) under AutoShardPolicy AUTO and DATA; a Python
generator of global batches with steps_per_epoch; tf.data under AutoShardPolicy.OFF.

50 rows in global batches of 8 make uneven splits (3/3/2 on 3 workers) and partial last batches
(2 rows: 1/1/0, an empty shard). The suite's shared warm gang per (backend, worker count) runs
every input variant, and its shared plain-Keras process per backend is the reference
(`tests/shared_gangs.py`).

`AutoShardPolicy.OFF` (variant `tfdata_off`): each worker feeds its own rows (`off_part`), so
there is no single-process run with the same data, and how the workers' batches combine into
steps is the backend's choice (TensorFlow splits each worker's batch into one piece per replica
and feeds one piece per step; the others may feed a worker's whole batch per step). (a), (c) and
the first half of (b) — each step weighs its B_t rows 1/B_t — are well defined and asserted;
the batch sizes of (b) and the order of (d) are not, and are not asserted.
"""

from __future__ import annotations

import os
import sys
from fractions import Fraction

import numpy as np
import pytest

from tests.multiworker import REPO
from tests.shared_gangs import LATE, PLAIN, SHARED, Runner, gang

sys.path.insert(0, str(REPO / "tests" / "workers"))
import common  # noqa: E402
import row_ledger  # noqa: E402

BACKENDS = ("tensorflow", "jax", "torch")
WORKER_COUNTS = (2, 3)
GANG_TIMEOUT = 600
TOLERANCE = 1e-6
# A kernel entry moved by a step when it changed by more than this (the smallest true weight
# is 1/8; per-worker weighting bugs give 1/24 at the least).
USED = 1e-4


# -- running the workers -------------------------------------------------------------------

class Run:
    """One run's dumps: a gang (workers ≥ 2) or the plain-Keras reference (workers = 1)."""

    def __init__(self, backend: str, workers: int, out: str, output: str, failure: str | None):
        self.backend, self.workers, self.out = backend, workers, out
        self.output, self.failure = output, failure

    @property
    def label(self) -> str:
        return (f"{self.backend} plain Keras (one process)" if self.workers == 1
                else f"{self.backend} {self.workers} workers")

    def ledger(self, variant: str, index: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The kernel after every step (steps × ROWS) and each step's epoch; fails if missing."""
        directory = os.path.join(self.out, variant)
        try:
            result = common.load_result(directory, index)
        except FileNotFoundError:
            pytest.fail(f"{self.label}, {variant}: worker {index} wrote no result — the run ended "
                        f"before this variant ({self.failure or 'no failure recorded'}); output "
                        f"tail:\n{self.output[-6000:]}")
        if result["status"] == "error":
            pytest.fail(f"{self.label}, {variant}: worker {index} raised {result['error']}\n"
                        f"{result.get('traceback', '')[-1500:]}")
        if result["status"] != "done":
            pytest.fail(f"{self.label}, {variant}: worker {index} started the variant and never "
                        f"finished it ({self.failure or 'no failure recorded'}); output tail:\n"
                        f"{self.output[-6000:]}")
        return (np.load(os.path.join(directory, f"ledger{index}.npy")).astype(np.float64),
                np.asarray(result["epochs"], dtype=int))


def _runner(backend: str, workers: int) -> Runner:
    """The suite's shared warm processes (`tests/shared_gangs.py`): its gangs of 2 and 3, and
    its plain-Keras process as the reference (workers = 1)."""
    return Runner(backend, PLAIN) if workers == 1 else gang(backend, workers)


# After the shared processes' other jobs (`LATE`): a variant that leaves the workers at different
# step counts may leave the gang's collectives unusable.
for _backend in BACKENDS:
    for _workers in (1, *WORKER_COUNTS):
        SHARED.add(__name__, _runner(_backend, _workers), "variants", "row_ledger",
                   ["{out}", _backend, *(["--plain"] if _workers == 1 else [])], seconds=GANG_TIMEOUT, order=LATE)


@pytest.fixture(scope="module")
def runs(shared_runs):
    """`runs(backend, workers)`: that run's dumps (workers=1: the reference)."""
    def get(backend: str, workers: int) -> Run:
        runner = _runner(backend, workers)
        out = shared_runs.folder(runner, __name__, "variants")
        return Run(backend, workers, out, shared_runs.output(runner, __name__, "variants").output, None)

    return get


# -- reading a ledger ------------------------------------------------------------------------

def _rows(rows) -> str:
    """`[0, 1, 2, 6, 7]` → `"0-2,6-7"`."""
    rows = sorted(int(row) for row in rows)
    if not rows:
        return "none"
    parts, start = [], rows[0]
    for previous, row in zip(rows, rows[1:] + [None]):
        if row != previous + 1:
            parts.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = row
    return ",".join(parts)


def _fraction(value: float) -> str:
    fraction = Fraction(value).limit_denominator(400)
    return f"{fraction}" if abs(float(fraction) - value) <= TOLERANCE else f"{value:.6g}"


def _describe(weights: dict[int, float]) -> str:
    """`{0: .125, 1: .125, 7: .5}` → `"rows 0-1 weighted 1/8, row 7 weighted 1/2"`."""
    if not weights:
        return "no rows"
    groups: dict[str, list[int]] = {}
    for row, weight in sorted(weights.items()):
        groups.setdefault(_fraction(weight), []).append(row)
    return ", ".join(f"row{'s' if len(rows) > 1 else ''} {_rows(rows)} weighted {weight}"
                     for weight, rows in groups.items())


def _step_weights(ledger: np.ndarray) -> list[dict[int, float]]:
    """Each step's rows and weights: `{row: -(kernel change)}` for the rows that moved."""
    previous = np.zeros(ledger.shape[1])
    steps = []
    for kernel in ledger:
        delta = kernel - previous
        steps.append({int(row): float(-delta[row]) for row in np.flatnonzero(np.abs(delta) > USED)})
        previous = kernel
    return steps


def _where(step: int, epochs: np.ndarray) -> str:
    epoch = int(epochs[step])
    return f"step {step} (epoch {epoch}, batch {step - int(np.searchsorted(epochs, epoch))})"


def _pipeline_batch_rows() -> list[int]:
    """Rows of each global batch of one epoch, in pipeline order: 8, …, 8, 2."""
    return [min(row_ledger.GLOBAL_BATCH, row_ledger.ROWS - start)
            for start in range(0, row_ledger.ROWS, row_ledger.GLOBAL_BATCH)]


def _weight_problems(steps: list[dict[int, float]], epochs: np.ndarray) -> list[str]:
    """Steps whose rows are not all weighted 1/(rows the step used).

    No input here puts a row twice into one global batch, so a step's global batch is exactly
    the rows whose kernel moved, B_t of them, each with k = 1.
    """
    problems = []
    for step, weights in enumerate(steps):
        batch_rows = len(weights)
        off = [row for row, weight in weights.items() if abs(weight - 1 / batch_rows) > TOLERANCE]
        if off:
            problems.append(f"{_where(step, epochs)}: {_describe(weights)}; expected its "
                            f"{batch_rows} rows weighted 1/{batch_rows} each")
    return problems


def _batch_size_problems(variant: str, steps: list[dict[int, float]], epochs: np.ndarray) -> list[str]:
    """Epochs whose global batches do not have the pipeline's sizes (8 × 6 then 2, per epoch).

    A shuffled PyDataset permutes whole batches, so there the sizes may come in any order.
    """
    expected = _pipeline_batch_rows()
    problems = []
    for epoch in range(row_ledger.EPOCHS):
        sizes = [len(steps[step]) for step in np.flatnonzero(epochs == epoch)]
        kind, shuffle, _, _ = row_ledger.VARIANTS[variant]
        same = (sorted(sizes) == sorted(expected) if kind == "pydataset" and shuffle
                else sizes == expected)
        if not same:
            problems.append(f"epoch {epoch}: global batches of {sizes} rows, expected {expected}")
    return problems


def _epoch_batches(steps: list[dict[int, float]], epochs: np.ndarray, epoch: int) -> list[list[int]]:
    return [sorted(steps[step]) for step in np.flatnonzero(epochs == epoch)]


def _order_hints(steps, epochs, expected, expected_epochs) -> list[str]:
    """What an order mismatch looks like, epoch by epoch (another epoch's order, no shuffle, …)."""
    hints = []
    reference = {epoch: _epoch_batches(expected, expected_epochs, epoch)
                 for epoch in range(row_ledger.EPOCHS)}
    in_order = [list(range(start, start + size)) for start, size in
                zip(range(0, row_ledger.ROWS, row_ledger.GLOBAL_BATCH), _pipeline_batch_rows())]
    for epoch in range(row_ledger.EPOCHS):
        mine = _epoch_batches(steps, epochs, epoch)
        if not mine or mine == reference[epoch]:
            continue
        others = [other for other, batches in reference.items() if other != epoch and batches == mine]
        if others:
            hints.append(f"hint: epoch {epoch} runs plain Keras's epoch {others[0]} order")
        elif mine == in_order and reference[epoch] != in_order:
            hints.append(f"hint: epoch {epoch} is not shuffled at all; plain Keras shuffles")
        elif sorted(mine) == sorted(reference[epoch]):
            hints.append(f"hint: epoch {epoch} has plain Keras's global batches, in another order")
        elif epoch > 0 and mine == _epoch_batches(steps, epochs, epoch - 1) \
                and reference[epoch] != reference[epoch - 1]:
            hints.append(f"hint: epoch {epoch} repeats epoch {epoch - 1}'s order; plain Keras reshuffles")
    return hints


# -- the cases --------------------------------------------------------------------------------

def _cases():
    cases = []
    for backend in BACKENDS:
        for workers in WORKER_COUNTS:
            for variant in row_ledger.variants_for(backend, plain=False):
                cases.append(pytest.param(backend, workers, variant, id=f"{backend}-{workers}w-{variant}",
                                          marks=[getattr(pytest.mark, backend), pytest.mark.slow]))
    return cases


CASES = _cases()


@pytest.mark.parametrize("backend,workers,variant", CASES)
def test_workers_hold_bit_identical_ledgers(runs, backend, workers, variant):
    """(a) After every step every worker holds the same kernel, bit for bit."""
    run = runs(backend, workers)
    first, epochs = run.ledger(variant, 0)
    for index in range(1, workers):
        other, _ = run.ledger(variant, index)
        assert other.shape == first.shape, (
            f"{run.label}, {variant}: worker {index} ran {len(other)} steps, worker 0 {len(first)}")
        differing = np.flatnonzero((other != first).any(axis=1))
        if differing.size:
            step = int(differing[0])
            rows = np.flatnonzero(other[step] != first[step])
            pytest.fail(
                f"{run.label}, {variant}: worker {index}'s kernel differs from worker 0's after "
                f"{differing.size} of {len(first)} steps, first after {_where(step, epochs)}: rows "
                f"{_rows(rows)}; worker 0 that step: {_describe(_step_weights(first)[step])}; "
                f"worker {index}: {_describe(_step_weights(other)[step])}")


@pytest.mark.parametrize("backend,workers,variant", CASES)
def test_each_step_weighs_its_rows_by_the_global_batch(runs, backend, workers, variant):
    """(b) Step t changes the kernel by exactly -1/B_t on each of the B_t rows of its global batch.

    And the global batches have the pipeline's sizes, 8 × 6 then 2 per epoch (OFF: undefined).
    """
    run = runs(backend, workers)
    ledger, epochs = run.ledger(variant, 0)
    steps = _step_weights(ledger)
    problems = _weight_problems(steps, epochs)
    if variant not in row_ledger.OFF_VARIANTS:
        problems += _batch_size_problems(variant, steps, epochs)
    assert not problems, f"{run.label}, {variant} ({len(steps)} steps):\n" + "\n".join(problems)


@pytest.mark.parametrize("backend,workers,variant", CASES)
def test_every_row_is_used_once_per_epoch(runs, backend, workers, variant):
    """(c) Each epoch's steps together use every row exactly once (OFF: every worker's rows)."""
    run = runs(backend, workers)
    ledger, epochs = run.ledger(variant, 0)
    steps = _step_weights(ledger)
    rows = set(range(row_ledger.ROWS))
    if variant in row_ledger.OFF_VARIANTS:
        rows = set(range(row_ledger.off_part(workers, workers - 1)[1]))
    problems = []
    for epoch in range(row_ledger.EPOCHS):
        used: dict[int, list[int]] = {}
        for step in np.flatnonzero(epochs == epoch):
            for row in steps[step]:
                used.setdefault(row, []).append(int(step))
        missing = sorted(rows - set(used))
        repeated = {row: at for row, at in sorted(used.items()) if len(at) > 1}
        foreign = sorted(set(used) - rows)
        if missing:
            problems.append(f"epoch {epoch}: rows {_rows(missing)} never used")
        if repeated:
            problems.append(f"epoch {epoch}: used in several steps: " + ", ".join(
                f"row {row} in steps {at}" for row, at in list(repeated.items())[:12])
                + (f" (and {len(repeated) - 12} more rows)" if len(repeated) > 12 else ""))
        if foreign:
            problems.append(f"epoch {epoch}: rows {_rows(foreign)} used, though no worker feeds them")
    if not (epochs == row_ledger.EPOCHS - 1).any():
        problems.append(f"only epochs {sorted(set(epochs.tolist()))} ran")
    assert not problems, f"{run.label}, {variant} ({len(steps)} steps):\n" + "\n".join(problems)


@pytest.mark.parametrize("backend,workers,variant", CASES)
def test_batches_match_plain_keras_in_one_process(runs, backend, workers, variant):
    """(d) Step by step the same rows as plain Keras with the same seed, shuffled inputs included.

    `*_worker_seeds` variants seed each worker differently, the chief as the reference: they
    must follow the same input seeded once.
    """
    reference_variant = row_ledger.reference_variant(variant)
    if reference_variant is None:
        pytest.skip("AutoShardPolicy.OFF: each worker feeds its own rows; one process has no "
                    "such data, and how workers' batches combine into steps is backend-defined")
    run = runs(backend, workers)
    ledger, epochs = run.ledger(variant, 0)
    reference = runs(backend, 1)
    expected_ledger, expected_epochs = reference.ledger(reference_variant, 0)
    steps, expected = _step_weights(ledger), _step_weights(expected_ledger)
    problems = []
    for step in range(max(len(steps), len(expected))):
        mine = sorted(steps[step]) if step < len(steps) else None
        theirs = sorted(expected[step]) if step < len(expected) else None
        if mine != theirs:
            where = _where(step, epochs if step < len(steps) else expected_epochs)
            problems.append(f"{where}: rows {'(no step)' if mine is None else _rows(mine)}; plain "
                            f"Keras: {'(no step)' if theirs is None else _rows(theirs)}")
    assert not problems, (
        f"{run.label}, {variant}: {len(problems)} of {max(len(steps), len(expected))} steps use "
        f"other rows than plain Keras ({len(steps)} vs {len(expected)} steps):\n"
        + "\n".join(_order_hints(steps, epochs, expected, expected_epochs) + problems))


@pytest.mark.parametrize("backend", [pytest.param(backend, marks=[getattr(pytest.mark, backend),
                                                                   pytest.mark.slow])
                                     for backend in BACKENDS])
def test_plain_keras_reference_is_a_valid_ledger(runs, backend):
    """The construction itself: one process of plain Keras meets (b) and (c) on every input."""
    reference = runs(backend, 1)
    problems = []
    for variant in row_ledger.variants_for(backend, plain=True):
        ledger, epochs = reference.ledger(variant, 0)
        steps = _step_weights(ledger)
        problems += [f"{variant} {problem}" for problem in
                     _weight_problems(steps, epochs) + _batch_size_problems(variant, steps, epochs)]
        for epoch in range(row_ledger.EPOCHS):
            used = sorted(row for step in np.flatnonzero(epochs == epoch) for row in steps[step])
            if used != list(range(row_ledger.ROWS)):
                problems.append(f"{variant} epoch {epoch}: rows used {_rows(used)} "
                                f"({len(used)} uses of {row_ledger.ROWS} rows)")
    assert not problems, f"{reference.label}:\n" + "\n".join(problems)
