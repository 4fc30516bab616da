"""A full disk under BackupAndRestore and ModelCheckpoint: every worker stops, nothing partial stays.

The backup (or checkpoint) directory is a 256 KiB tmpfs filled up before training (leaving
room for exactly one backup, or for nothing), so the chief's write fails with ENOSPC in the
middle of a real 2-worker `fit`. Expected: every worker exits non-zero on its own within
`EXIT_BOUND` seconds of the chief's failure, the chief's message names the directory and "No
space left", the directory holds only complete, referenced checkpoints (the last good backup
stays loadable), and no worker process is left behind.

One backend (torch) is enough: the write path is shared by all backends
(`keras_mwms/resume/backup_files.py` and `keras_mwms/resume/io.py`, called by the backend-neutral callbacks
only on the chief); how the other workers notice the chief's exit is each backend's crashed-peer
handling, covered per backend in `tests/test_faults.py`.

Needs root to mount a tmpfs; skipped with the reason otherwise; always unmounted afterwards.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.multiworker import python_worker, watch_gang, worker_env

BACKEND = "torch"
DISK_BYTES = 256 * 1024
PAGE = 4096
ONE_BACKUP_BYTES = 6 * PAGE  # one backup of the scenario's model fits (4 pages), a second does not
EXIT_BOUND = 60.0  # seconds from the chief's failure to the last worker's exit
HARD_DEADLINE = 300.0

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _fill(directory: Path, leave_bytes: int) -> None:
    """Fills the file system of `directory` up, then frees `leave_bytes` again."""
    descriptor = os.open(directory / ".filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        written = 0
        try:
            while True:
                written += os.write(descriptor, b"\0" * PAGE)
        except OSError:
            pass
        os.ftruncate(descriptor, max(0, written - leave_bytes))
    finally:
        os.close(descriptor)


@pytest.fixture
def full_disk(tmp_path):
    """`make(leave_bytes)` → a directory on a tiny, (nearly) full tmpfs, unmounted at the end."""
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (mount -t tmpfs); run the tests as root, as CI does")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")

    def make(leave_bytes: int) -> Path:
        _fill(mount_point, leave_bytes)
        return mount_point

    try:
        yield make
    finally:
        # Lazy unmount: a file a killed worker still held open must not keep the mount alive.
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)


def run_until_all_exit(out: Path, *args: str) -> tuple[dict, dict, str, str]:
    """Runs 2 workers; each must exit on its own. Returns codes, exit times, output, orphans."""
    marker = f"kmwms-disk-{uuid.uuid4().hex[:12]}"
    watched = watch_gang(python_worker("full_disk.py", str(out), "--marker", marker, *args), 2,
                         HARD_DEADLINE, env=worker_env(BACKEND, lean=True), marker=marker)
    return watched.codes, watched.exit_times, watched.output, watched.orphans


def lines_of(output: str, worker: int) -> str:
    prefix = f"[worker {worker}] "
    return "\n".join(line[len(prefix):] for line in output.splitlines() if line.startswith(prefix))


def assert_everyone_stopped(codes, exit_times, output, orphans) -> float:
    """Both workers exited non-zero on their own, the last within EXIT_BOUND of the chief."""
    assert set(exit_times) == {0, 1}, f"a worker did not exit within {HARD_DEADLINE} s:\n{output[-6000:]}"
    assert codes[0] != 0 and codes[1] != 0, f"exit codes {codes}:\n{output[-6000:]}"
    spread = max(exit_times.values()) - exit_times[0]
    assert spread <= EXIT_BOUND, f"the last worker exited {spread:.1f} s after the chief:\n{output[-6000:]}"
    assert not orphans, f"processes left behind: {orphans}"
    return spread


def test_backup_on_a_full_disk_stops_every_worker_and_keeps_the_last_good_backup(full_disk, tmp_path):
    from keras_mwms.resume.backup_files import POINTER_FILE, read_checkpoint

    backup = full_disk(ONE_BACKUP_BYTES) / "backup"
    started = time.time()
    codes, exit_times, output, orphans = run_until_all_exit(tmp_path / "out", "--backup", str(backup))
    spread = assert_everyone_stopped(codes, exit_times, output, orphans)
    print(f"\n[full disk] BackupAndRestore ({BACKEND}): codes {codes}, chief exited at "
          f"{exit_times[0] - started:.1f} s, the other worker {spread:.1f} s later")
    chief = lines_of(output, 0)
    assert "BackupAndRestore could not write a backup" in chief and str(backup) in chief, chief[-4000:]
    assert "No space left on device" in chief, chief[-4000:]
    assert "worker 0" in lines_of(output, 1), lines_of(output, 1)[-4000:]
    # Only complete, referenced backups are visible: the first epoch's, still loadable.
    import json

    pointer = json.loads((backup / POINTER_FILE).read_text())
    assert sorted(os.listdir(backup)) == sorted([POINTER_FILE, pointer["current"]])
    metadata, _ = read_checkpoint(str(backup / pointer["current"]))
    assert metadata["epoch"] == 1, metadata


def test_model_checkpoint_on_a_full_disk_stops_every_worker_and_leaves_no_file(full_disk, tmp_path):
    directory = full_disk(0) / "ckpt"
    target = directory / "model-{epoch:02d}.weights.h5"
    started = time.time()
    codes, exit_times, output, orphans = run_until_all_exit(tmp_path / "out", "--checkpoint", str(target))
    spread = assert_everyone_stopped(codes, exit_times, output, orphans)
    print(f"\n[full disk] ModelCheckpoint ({BACKEND}): codes {codes}, chief exited at "
          f"{exit_times[0] - started:.1f} s, the other worker {spread:.1f} s later")
    chief = lines_of(output, 0)
    assert str(directory / "model-01.weights.h5") in chief, chief[-4000:]
    assert "No space left on device" in chief, chief[-4000:]
    assert os.listdir(directory) == [], "a partial checkpoint file is visible"
