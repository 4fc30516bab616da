"""Elastic resume: a backup written by N workers restores on M, and the launcher's `--min-workers`.

One job of `tests/workers/exact_resume.py` (shuffled arrays, Adam on a decaying learning-rate
schedule, backups every 3 steps) is carried by four gangs on the torch backend: 2 workers, killed
at a seeded random global step (one after a backup), resumed by 3 workers, killed at a
later one, resumed by 2,
killed again, finished by 1 — so 2 → 3, 3 → 2 and 2 → 1, with the global batch unchanged.
The first gang also runs the uninterrupted reference job (2 workers, from scratch). Asserted:
every resume says in one line that the worker count changed and the global batch did not; the
`ExampleLedger` shows every example exactly once per epoch across the three crashes, each step's
rows split by that gang's replica contract, in the order `epoch_permutation(seed, epoch)` of the
one job seed; the optimizer ends at the reference's step count; the final weights are within
1e-5 of the reference's (workers of different counts add gradients in different orders).

torch only: its gangs start fastest, and the data order, the backup and the restore under test
are backend-neutral (`tests/test_exact_resume.py` covers every backend at a fixed count).

`--min-workers`: a gang of 3 whose worker 2 always dies (`tests/workers/lost_worker.py`, no ML
framework) shrinks after two failures in a row and finishes on 2 workers with exit code 0.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from keras_mwms.data import replica_slices
from keras_mwms.example_ledger import read_ledger
from keras_mwms.resume.data_order import epoch_permutation
from tests.multiworker import WORKERS_DIR, python_worker, run_gang, run_launcher, worker_env

SCENARIO = "exact_resume.py"
ROWS, GLOBAL_BATCH, EPOCHS = 60, 8, 2
STEPS_PER_EPOCH = -(-ROWS // GLOBAL_BATCH)
GANGS = (2, 3, 2, 1)
# Stream positions after which exact_resume.py's BackupAndRestore(save_freq=3) has backed up.
BACKUP_POSITIONS = [3, 6, 8, 11, 14]
GANG_TIMEOUT = 300
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    # Each gang must resume from a backup the previous one wrote: kill one step after a backup
    # position (every SAVE_FREQ steps and each epoch's end), so the next gang trains it again.
    rng = np.random.default_rng(2026)
    backups = sorted(rng.choice(BACKUP_POSITIONS, size=len(GANGS) - 1, replace=False).tolist())
    kills = [position + 1 for position in backups]
    elastic = {"name": "elastic", "variant": "arrays", "kills": kills}
    results, started = [], time.monotonic()
    for number, workers in enumerate(GANGS):
        plan = ([{"name": "reference", "variant": "arrays"}] if number == 0 else []) + [elastic]
        results.append(run_gang(python_worker(SCENARIO, "--out", str(out), "--plan", json.dumps(plan)),
                                workers, GANG_TIMEOUT, env=worker_env("torch", lean=True), grace_period=2))
    print(f"\nelastic chain {' -> '.join(map(str, GANGS))} workers, kills at {kills}: "
          f"{time.monotonic() - started:.1f} s")
    return out, kills, results


def weights(out, job: str, worker: int) -> list[np.ndarray]:
    with np.load(os.path.join(out, job, f"w{worker}.npz")) as data:
        return [data[f"arr_{index}"] for index in range(len(data.files))]


@pytest.mark.slow
@pytest.mark.torch
def test_each_gang_but_the_last_was_killed_and_the_last_finished(chain):
    out, kills, results = chain
    for result, kill in zip(results[:-1], kills):
        assert result.returncode != 0, result.output[-4000:]
        assert f"SIGKILL after stream position {kill}" in result.output, result.output[-4000:]
    assert results[-1].returncode == 0, results[-1].output[-6000:]


@pytest.mark.slow
@pytest.mark.torch
def test_every_restore_says_the_worker_count_changed_and_the_global_batch_did_not(chain):
    _, _, results = chain
    for before, after, result in zip(GANGS, GANGS[1:], results[1:]):
        line = (f"the backup was written by {before} worker(s), this job has {after}: the same "
                f"global batch of {GLOBAL_BATCH} rows")
        assert line in result.output, result.output[-6000:]


@pytest.mark.slow
@pytest.mark.torch
def test_final_weights_and_optimizer_step_match_the_uninterrupted_run(chain):
    out, _, _ = chain
    difference = max(float(np.abs(mine - theirs).max())
                     for mine, theirs in zip(weights(out, "elastic", 0), weights(out, "reference", 0)))
    print(f"\nelastic 2->3->2->1 vs uninterrupted 2 workers: max |dw| = {difference:.3g}")
    assert difference <= TOLERANCE
    for job in ("elastic", "reference"):
        with open(os.path.join(out, job, "done.w0")) as handle:
            assert json.load(handle)["iterations"] == EPOCHS * STEPS_PER_EPOCH, job


def effective_records(out) -> dict[tuple[int, int], tuple[dict, int, list[dict]]]:
    """`(epoch, step)` → (worker 0's record, that process's worker count, every worker's record
    of that step in the same process) for the steps whose updates the final weights hold."""
    per_worker = {worker: read_ledger(os.path.join(out, "elastic", "ledger"), worker)
                  for worker in range(max(GANGS))}
    # Split each worker's lines into processes (each starts with a `begin` line); the k-th
    # process of worker 0 is the k-th gang, and so is the k-th of any worker in that gang.
    processes = {worker: [] for worker in per_worker}
    for worker, records in per_worker.items():
        for record in records:
            if record.get("event") == "begin":
                processes[worker].append([record])
            else:
                processes[worker][-1].append(record)
    gangs_of = {worker: [gang for gang, size in enumerate(GANGS) if worker < size] for worker in per_worker}
    steps: dict = {}
    for gang, size in enumerate(GANGS):
        lines = processes[0][gang]
        begin = lines[0]
        resumed = (begin["epoch"], begin["step"])
        steps = {key: value for key, value in steps.items() if key < resumed}
        peers = {worker: {(line["epoch"], line["step"]): line
                          for line in processes[worker][gangs_of[worker].index(gang)][1:]}
                 for worker in range(size)}
        for line in lines[1:]:
            key = (line["epoch"], line["step"])
            steps[key] = (line, begin["workers"], [peers[worker].get(key) for worker in range(size)])
    return steps


@pytest.mark.slow
@pytest.mark.torch
def test_the_ledger_shows_every_example_exactly_once_per_epoch_across_worker_counts(chain):
    out, _, _ = chain
    steps = effective_records(out)
    assert sorted(steps) == [(epoch, step) for epoch in range(EPOCHS) for step in range(STEPS_PER_EPOCH)]
    seeds = {line["seed"] for worker in range(max(GANGS))
             for line in read_ledger(os.path.join(out, "elastic", "ledger"), worker) if line.get("event")}
    assert len(seeds) == 1, seeds
    seed = seeds.pop()
    counts = set()
    for epoch in range(EPOCHS):
        ids = []
        for step in range(STEPS_PER_EPOCH):
            record, workers, peers = steps[(epoch, step)]
            counts.add(workers)
            expected = epoch_permutation(seed, epoch, ROWS)[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
            assert record["ids"] == expected.tolist(), (epoch, step)
            # This gang's workers took their replica_slices of the global batch, all of it.
            for worker, (start, stop) in enumerate(replica_slices(GLOBAL_BATCH, workers, len(expected))):
                assert peers[worker] is not None and peers[worker]["local"] == record["ids"][start:stop]
            ids += record["ids"]
        assert sorted(ids) == list(range(ROWS)), epoch
    assert len(counts) > 1, f"the effective steps were all trained by {counts} workers"


@pytest.mark.slow
def test_min_workers_shrinks_a_gang_that_keeps_losing_worker_2_and_finishes_on_2():
    result = run_launcher(["--workers", "3", "--min-workers", "2", "--shrink-after", "2",
                           "--max-restarts", "3", "--grace-period", "2"],
                          [str(WORKERS_DIR / "lost_worker.py")], timeout=120)
    assert result.returncode == 0, result.launcher_log + result.output
    log = result.launcher_log
    assert log.count("starting 3 worker(s)") == 2 and log.count("starting 2 worker(s)") == 1, log
    assert ("with one worker fewer (3 -> 2, --min-workers 2): worker 2 failed 2 times in a row"
            in log), log
    assert "worker 0 of 2: trained" in result.output and "worker 1 of 2: trained" in result.output
