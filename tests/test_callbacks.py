"""keras_mwms.callbacks end to end: real workers, real kills, the real launcher's restarts.

For each backend one module-scoped set of runs of `tests/workers/resume_scenario.py` (every
backend's runs, lone scripts and TensorBoard gang three at a time, `tests.multiworker.concurrently`):
an uninterrupted reference (with ModelCheckpoint and TensorBoard), a worker SIGKILLed
mid-epoch with `save_freq="epoch"` (under Keras' own `keras.callbacks.BackupAndRestore`, which
keras_mwms runs as its own), one SIGKILLed mid-epoch with `save_freq=4`, and the chief
killed half-way through writing a backup. Each faulty run is restarted by
`python -m keras_mwms.launch --max-restarts 1` and must end with the reference's weights.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from tests.multiworker import (
    WORKERS_DIR,
    ProcessesResult,
    Spawn,
    concurrently,
    python_worker,
    run_gang,
    run_launcher,
    run_processes,
    selected_params,
    worker_env,
)
from tests.workers.common import load_result, load_weights, max_weight_difference

BACKENDS = ["tensorflow", "jax", "torch"]
SCENARIO = str(WORKERS_DIR / "resume_scenario.py")
RUN_TIMEOUT = 420
FAULTS = {
    "reference": ["--checkpoints"],
    # Keras' own BackupAndRestore, as a user script has it (before: 'unable to lock file').
    "kill_epoch": ["--keras-callbacks", "--kill-at-step", "9", "--kill-worker", "1"],
    "kill_steps": ["--save-freq", "4", "--kill-at-step", "11", "--kill-worker", "1"],
    "kill_during_save": ["--kill-during-save", "2", "--double-checkpoint"],
    "sigterm": ["--sigterm-at-step", "7", "--sigterm-worker", "1", "--preemption-check-steps", "4"],
}
# Single-process scripts (no TF_CONFIG), run in the same pool as the launcher runs.
LONE_SCRIPTS = ("callbacks_single.py", "backup_corruption.py")
# A gang of 2 started without the launcher, each worker with its own TMPDIR; in the same pool.
TENSORBOARD_GANG = "tensorboard_scratch.py"


def epochs_logged(out_dir, worker):
    path = os.path.join(out_dir, f"epochs.w{worker}.jsonl")
    with open(path) as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="module")
def all_runs(request, tmp_path_factory):
    """Every selected backend's five launcher runs, its lone scripts (`LONE_SCRIPTS`) and its
    TensorBoard gang, three at a time across backends: a restart's stop and start, and a lone
    process, leave a core idle. Keyed (backend, fault name or script)."""
    fault_jobs = [(backend, name) for backend in selected_params(request, "runs") for name in FAULTS]
    lone_jobs = [(backend, script) for backend in selected_params(request, "backend")
                 for script in (*LONE_SCRIPTS, TENSORBOARD_GANG)]
    roots = {backend: tmp_path_factory.mktemp(f"callbacks-{backend}")
             for backend in dict.fromkeys(backend for backend, _ in fault_jobs + lone_jobs)}
    seconds = {}

    def run(job):
        backend, name = job
        if name in LONE_SCRIPTS:   # no TF_CONFIG; checked by its own test (`result_lines`)
            return run_processes([Spawn(python_worker(name), worker_env(backend, lean=True))], timeout=300)
        if name == TENSORBOARD_GANG:
            return run_tensorboard_gang(backend, roots[backend] / "tensorboard")
        out, backup = roots[backend] / name, roots[backend] / f"{name}-backup"
        started = time.monotonic()
        result = run_launcher(
            ["--workers", "2", "--max-restarts", "0" if name == "reference" else "1", "--grace-period", "3"],
            [SCENARIO, "--out", str(out), "--backup", str(backup), *FAULTS[name]],
            timeout=RUN_TIMEOUT, env=worker_env(backend, lean=True))
        seconds[job] = time.monotonic() - started
        return out, backup, result

    results = concurrently(run, fault_jobs + lone_jobs)
    for backend in dict.fromkeys(backend for backend, _ in fault_jobs):
        print_fault_table(backend, {name: results[(backend, name)] for name in FAULTS},
                          {name: seconds[(backend, name)] for name in FAULTS})
    return results


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, all_runs):
    """One backend's five runs, {fault name: (out, backup, LaunchResult)}."""
    return request.param, {name: all_runs[(request.param, name)] for name in FAULTS}


def print_fault_table(backend, results, seconds):
    """The fault-injection matrix of one backend (shown with `pytest -s`): time, restarts, Δw."""
    print(f"\ncallback fault matrix, {backend} (2 workers, 3 epochs x 8 steps, launcher --max-restarts 1):")
    print(f"{'fault':<18} {'exit':>4} {'seconds':>8} {'restarts':>8}  max|dw| vs uninterrupted")
    try:
        reference = load_weights(results["reference"][0], 0)
    except OSError:
        reference = None
    for name, (out, _, result) in results.items():
        try:
            delta = f"{max_weight_difference(load_weights(out, 0), reference):.3g}"
        except (OSError, TypeError):
            delta = "-"
        restarts = result.launcher_log.count("restarting the gang")
        print(f"{name:<18} {result.returncode:>4} {seconds[name]:>8.1f} {restarts:>8}  {delta}")



@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_run_succeeds_and_workers_agree(runs, fault):
    _, results = runs
    out, backup, result = results[fault]
    assert result.returncode == 0, result.launcher_log + result.output[-6000:]
    assert max_weight_difference(load_weights(out, 0), load_weights(out, 1)) == 0.0
    assert not backup.exists(), "the chief did not delete the backup after a successful fit"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill_epoch", "kill_steps", "kill_during_save", "sigterm"])
def test_restarted_run_ends_with_the_uninterrupted_weights(runs, fault):
    _, results = runs
    reference = load_weights(results["reference"][0], 0)
    out, _, result = results[fault]
    assert "restarting the gang" in result.launcher_log, result.launcher_log
    assert max_weight_difference(load_weights(out, 0), reference) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("fault,resumed_epoch,resumed_step", [
    ("kill_epoch", 1, 0), ("kill_steps", 1, 4), ("kill_during_save", 1, 0), ("sigterm", 1, 4)])
def test_every_epoch_is_logged_once_and_resumes_at_the_saved_step(runs, fault, resumed_epoch, resumed_step):
    _, results = runs
    out, _, result = results[fault]
    # When the chief dies inside its epoch-end backup, the other worker still logs that
    # epoch before it notices; the job as a whole (the chief's log) has every epoch once.
    for worker in (0,) if fault == "kill_during_save" else (0, 1):
        epochs = [row["epoch"] for row in epochs_logged(out, worker)]
        assert epochs == [0, 1, 2], epochs
        second_attempt = [row["epoch"] for row in epochs_logged(out, worker) if row["attempt"] == "1"]
        assert second_attempt[0] == resumed_epoch
    assert f"at epoch {resumed_epoch + 1}, step {resumed_step}" in result.output


@pytest.mark.slow
def test_model_checkpoint_best_only_is_written_by_the_chief_alone(runs):
    _, results = runs
    out, _, _ = results["reference"]
    assert not (out / "ckpt_w1").exists() and not (out / "tb_w1").exists()
    saved = sorted(os.listdir(out / "ckpt_w0"))
    assert all(name.startswith("model-") and name.endswith(".weights.h5") for name in saved), saved
    history = load_result(out, 0)["history"]
    assert history == load_result(out, 1)["history"], "the logs differ between workers"
    val_loss = history["val_loss"]
    improving = [epoch + 1 for epoch in range(len(val_loss))
                 if val_loss[epoch] == min(val_loss[: epoch + 1])]
    assert saved == [f"model-{epoch:02d}.weights.h5" for epoch in improving]
    assert (out / "tb_w0" / "train").is_dir()


def result_lines(ran: ProcessesResult) -> list[list[str]]:
    """A lone script's `RESULT ...` lines, split; fails with its output unless it exited 0."""
    assert ran.codes == [0], ran.log(3000)
    return [line.split()[1:] for line in ran.outputs[0].splitlines() if line.startswith("RESULT")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_docstring_interrupt_and_resume_example(backend, all_runs):
    assert result_lines(all_runs[(backend, "callbacks_single.py")])[0] == ["6", "6"]


def test_backup_write_is_atomic_and_keeps_the_previous_one(tmp_path):
    from keras_mwms.resume.backup_files import FORMAT, read_checkpoint, write_backup

    first = write_backup(str(tmp_path), {"format": FORMAT, "epoch": 1}, [np.ones(3)], keep_previous=True)
    second = write_backup(str(tmp_path), {"format": FORMAT, "epoch": 2}, [np.zeros(3)], keep_previous=True)
    third = write_backup(str(tmp_path), {"format": FORMAT, "epoch": 3}, [np.zeros(3)], keep_previous=False)
    assert first != second != third
    assert sorted(os.listdir(tmp_path)) == sorted(["latest.json", third])
    (tmp_path / ".tmp-keras_mwms-leftover").mkdir()
    write_backup(str(tmp_path), {"format": FORMAT, "epoch": 4}, [np.zeros(3)], keep_previous=True)
    assert not any(name.startswith(".tmp-") for name in os.listdir(tmp_path))
    pointer = json.loads((tmp_path / "latest.json").read_text())
    metadata, arrays = read_checkpoint(str(tmp_path / pointer["current"]))
    assert metadata["epoch"] == 4 and np.array_equal(arrays[0], np.zeros(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_backup_falls_back_and_unwritable_dir_is_a_clear_error(backend, all_runs):
    lines = result_lines(all_runs[(backend, "backup_corruption.py")])
    results = dict(line[:2] for line in lines)
    assert results == {"fallback_first_epoch": "2", "fallback_warned": "True",
                       "corrupt_error": "True", "unwritable": "True"}, lines


@pytest.mark.slow
def test_sigterm_on_one_worker_backs_up_and_stops_every_worker(runs):
    _, results = runs
    _, _, result = results["sigterm"]
    assert "failed with exit code 143" in result.launcher_log, result.launcher_log
    for worker in (0, 1):
        assert any("preempted (SIGTERM)" in line and "epoch 2, step 4" in line
                   for line in result.output.splitlines() if line.startswith(f"[worker {worker}]")), \
            result.output[-6000:]


def run_tensorboard_gang(backend, folder):
    """2 workers fit under keras_mwms' TensorBoard, each with its own TMPDIR, then one is
    interrupted on purpose; returns (GangResult, the two TMPDIRs)."""
    temp_dirs = [folder / f"tmp_w{index}" for index in range(2)]
    for temp_dir in temp_dirs:
        temp_dir.mkdir(parents=True)
    result = run_gang(python_worker(TENSORBOARD_GANG, "--log-dir", str(folder / "logs")),
                      workers=2, timeout=300, env=worker_env(backend, lean=True), grace_period=60,
                      per_worker_env={index: {"TMPDIR": str(temp_dirs[index])} for index in range(2)})
    return result, temp_dirs


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensorboard_leaves_no_scratch_directory_on_any_worker(backend, all_runs):
    result, temp_dirs = all_runs[(backend, TENSORBOARD_GANG)]
    for index in range(2):
        assert any("scratch after fit: []" in line for line in result.lines(index)), result.output[-6000:]
    assert result.returncode == 1 and "interrupted on purpose" in result.output, result.output[-6000:]
    left = [path.name for temp_dir in temp_dirs for path in temp_dir.iterdir()
            if path.name.startswith("keras_mwms-tensorboard-")]
    assert not left, f"left behind: {left}"


class _TwoWorkerStandIn:
    """An active strategy of 2 workers, as `keras_mwms.callbacks.coordination` sees one."""

    num_workers, worker_index, is_chief = 2, 1, False


def test_keras_own_callbacks_are_made_worker_aware_and_share_the_users_state(monkeypatch):
    """Which Keras callbacks run as keras_mwms' (`keras_mwms.callbacks.worker_aware`); the
    user's object keeps its class and sees what the twin did; subclasses keep their methods.
    Multi-worker behaviour: tests/test_user_scripts.py (keras_callbacks, backup_and_restore)."""
    import keras

    from keras_mwms import active
    from keras_mwms import callbacks as ours
    from keras_mwms.callbacks.worker_aware import worker_aware
    from keras_mwms.resume import resumable_inputs

    class CountingCheckpoint(keras.callbacks.ModelCheckpoint):
        def on_epoch_end(self, epoch, logs=None):
            self.counted = getattr(self, "counted", 0) + 1

    checkpoint = keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True)
    counting = CountingCheckpoint("e{epoch}.weights.h5", save_weights_only=True)
    backup = keras.callbacks.BackupAndRestore("backup", save_freq=3, delete_checkpoint=False)
    stopper, own = keras.callbacks.EarlyStopping(), ours.TensorBoard("logs")
    aware = worker_aware([checkpoint, [counting, keras.callbacks.CSVLogger("log.csv")],
                          keras.callbacks.TensorBoard("logs"), backup, stopper, own])
    assert [type(callback) for callback in aware[:3]] == [ours.ModelCheckpoint, type(aware[1]), ours.CSVLogger]
    assert isinstance(aware[1], CountingCheckpoint) and isinstance(aware[1], ours.ModelCheckpoint)
    assert type(aware[1]).__name__ == "CountingCheckpoint" and type(aware[3]) is ours.TensorBoard
    assert type(checkpoint) is keras.callbacks.ModelCheckpoint, "the user's object changed class"
    aware[0].best = 0.25
    aware[1].on_epoch_end(0)
    assert checkpoint.best == 0.25 and counting.counted == 1
    assert type(aware[4]) is ours.BackupAndRestore
    # fit sees the user's object before the swap: its shuffled input already takes the resumable order.
    assert resumable_inputs.wants_resumable_order([backup])
    assert (aware[4].backup_dir, aware[4].save_freq, aware[4].delete_checkpoint) == ("backup", 3, False)
    assert aware[5] is stopper and aware[6] is own

    class MyBackup(keras.callbacks.BackupAndRestore):
        pass

    mine = MyBackup("backup")
    assert worker_aware([mine]) == [mine], "one worker: a subclass stays Keras' own"
    monkeypatch.setattr(active, "_session", active.Session(_TwoWorkerStandIn(), None))
    with pytest.raises(ValueError, match="MyBackup subclasses keras.callbacks.BackupAndRestore.*"
                                         "keras_mwms.callbacks.BackupAndRestore"):
        worker_aware([mine])
