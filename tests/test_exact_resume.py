"""Exact resume with `shuffle=True`: 5 seeded random kill points per backend, real restarts.

One `python -m keras_mwms.launch --workers 2 --max-restarts 5` run per backend of
`tests/workers/exact_resume.py` serves every case: its plan is an uninterrupted reference job
per input (numpy arrays, a `keras.utils.PyDataset`, and on torch a `DataLoader` with
`shuffle=True`) and five jobs of the same model, each SIGKILLed once (its last worker kills
itself after a seeded random global step, any epoch), the input kinds taking turns. The
launcher restarts the gang after each kill; the restarted workers skip finished jobs and
resume the killed one from its `BackupAndRestore` backup (every 3 steps), so the steps after
that backup are trained twice, as after a real crash.

Asserted per killed job: the final weights are bit-identical to the reference's (and on both
workers); the `ExampleLedger` shows every example exactly once in each epoch, each step's
global ids split between the workers by the replica contract, and each step's ids are
`keras_mwms.resume.data_order.epoch_permutation(seed, epoch)`'s — a pure function of the job seed
(one for the whole job, kept across the restart) and the epoch.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from keras_mwms.example_ledger import effective_steps, read_ledger
from keras_mwms.resume.data_order import epoch_permutation
from tests.multiworker import WORKERS_DIR, run_launcher, worker_env

BACKENDS = ("tensorflow", "jax", "torch")
SCENARIO = str(WORKERS_DIR / "exact_resume.py")
ROWS, GLOBAL_BATCH, EPOCHS = 60, 8, 2
STEPS_PER_EPOCH = -(-ROWS // GLOBAL_BATCH)
KILLS_PER_BACKEND = 5
RUN_TIMEOUT = 600
SECONDS: dict[str, float] = {}


def variants(backend: str) -> list[str]:
    return ["arrays", "pydataset"] + (["dataloader"] if backend == "torch" else [])


def plan(backend: str) -> list[dict]:
    """References first, then the killed jobs: a seeded random global step each, kinds in turn."""
    rng = np.random.default_rng(["tensorflow", "jax", "torch"].index(backend) + 2020)
    positions = rng.integers(1, EPOCHS * STEPS_PER_EPOCH, size=KILLS_PER_BACKEND)
    kinds = variants(backend)
    jobs = [{"name": f"reference-{kind}", "variant": kind} for kind in kinds]
    jobs += [{"name": f"kill{number}-{kinds[number % len(kinds)]}",
              "variant": kinds[number % len(kinds)], "kills": [int(position)]}
             for number, position in enumerate(positions)]
    return jobs


@pytest.fixture(scope="module", params=[pytest.param(backend, marks=getattr(pytest.mark, backend))
                                        for backend in BACKENDS])
def run(request, tmp_path_factory):
    import json

    backend = request.param
    out = tmp_path_factory.mktemp(f"exact-resume-{backend}")
    jobs = plan(backend)
    started = time.monotonic()
    result = run_launcher(
        ["--workers", "2", "--max-restarts", str(KILLS_PER_BACKEND), "--grace-period", "1"],
        [SCENARIO, "--out", str(out), "--plan", json.dumps(jobs)],
        timeout=RUN_TIMEOUT, env=worker_env(backend, lean=True))
    SECONDS[backend] = time.monotonic() - started
    print(f"\nexact resume, {backend}: {SECONDS[backend]:.1f} s for {len(jobs)} jobs, "
          f"{result.launcher_log.count('restarting the gang')} restarts; kills at "
          f"{[job['kills'][0] for job in jobs if 'kills' in job]}")
    return backend, out, jobs, result


def weights(out, job: str, worker: int) -> list[np.ndarray]:
    with np.load(os.path.join(out, job, f"w{worker}.npz")) as data:
        return [data[f"arr_{index}"] for index in range(len(data.files))]


def killed_jobs(jobs):
    return [job for job in jobs if "kills" in job]


@pytest.mark.slow
def test_every_killed_job_was_restarted_and_finished(run):
    backend, out, jobs, result = run
    assert result.returncode == 0, result.launcher_log + result.output[-6000:]
    assert result.launcher_log.count("restarting the gang") == KILLS_PER_BACKEND, result.launcher_log
    for job in killed_jobs(jobs):
        assert os.path.exists(os.path.join(out, job["name"], f"killed-{job['kills'][0]}")), job


@pytest.mark.slow
def test_final_weights_are_bit_identical_to_the_uninterrupted_run(run):
    backend, out, jobs, _ = run
    for job in killed_jobs(jobs):
        reference = weights(out, f"reference-{job['variant']}", 0)
        for worker in (0, 1):
            for mine, theirs in zip(weights(out, job["name"], worker), reference):
                np.testing.assert_array_equal(mine, theirs, err_msg=f"{backend} {job}")


def ledger_by_epoch(out, job: str, worker: int) -> tuple[dict, list[dict]]:
    records = read_ledger(os.path.join(out, job, "ledger"), worker)
    return effective_steps(records), [record for record in records if record.get("event")]


@pytest.mark.slow
def test_the_ledger_shows_every_example_once_per_epoch_across_the_crash(run):
    backend, out, jobs, _ = run
    for job in jobs:
        steps, begins = ledger_by_epoch(out, job["name"], 0)
        assert sorted(steps) == [(epoch, step) for epoch in range(EPOCHS)
                                 for step in range(STEPS_PER_EPOCH)], (job, begins)
        for epoch in range(EPOCHS):
            ids = np.concatenate([steps[(epoch, step)]["ids"] for step in range(STEPS_PER_EPOCH)])
            assert sorted(ids.tolist()) == list(range(ROWS)), (backend, job, epoch)
        # Each step's global batch is split between the workers: worker 0's rows, then 1's.
        other, _ = ledger_by_epoch(out, job["name"], 1)
        for key, record in steps.items():
            assert record["local"] + other[key]["local"] == record["ids"], (backend, job, key)
        if "kills" in job:
            assert len(begins) == 2, (backend, job, begins)   # killed once, resumed once
            resumed = begins[1]
            assert resumed["epoch"] * STEPS_PER_EPOCH + resumed["step"] <= job["kills"][0]


@pytest.mark.slow
def test_the_order_is_a_pure_function_of_the_seed_and_the_epoch(run):
    backend, out, jobs, _ = run
    for job in jobs:
        steps, begins = ledger_by_epoch(out, job["name"], 0)
        seeds = {begin["seed"] for begin in begins}
        assert len(seeds) == 1, (job, begins)   # the restart took the backup's seed
        seed = seeds.pop()
        for (epoch, step), record in steps.items():
            if job["variant"] == "pydataset":   # a unit is one batch of GLOBAL_BATCH rows
                batch = int(epoch_permutation(seed, epoch, STEPS_PER_EPOCH)[step])
                expected = list(range(batch * GLOBAL_BATCH, min((batch + 1) * GLOBAL_BATCH, ROWS)))
            else:
                expected = epoch_permutation(seed, epoch, ROWS)[
                    step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH].tolist()
            assert record["ids"] == expected, (backend, job, epoch, step)
