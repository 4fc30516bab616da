"""The gang launcher and the `keras-mwms` CLI (keras_mwms/launch.py, keras_mwms/cli.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_mwms.launch import Gang, describe_exit, exit_code_of, find_free_ports
from keras_mwms.startup.cluster import parse_tf_config
from tests.multiworker import REPO, WORKERS_DIR, run_launcher, worker_env

WORKER = str(WORKERS_DIR / "launch_worker.py")
STUBBORN_WORKER = str(WORKERS_DIR / "launch_stubborn_worker.py")


# The launcher's own process handling is under test, so it is started directly, not via tests.multiworker.
def launch(tmp_path: Path, *launcher_args: str, worker_args=(), timeout=60, wait=True):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "keras_mwms.launch", *launcher_args, WORKER,
               "--pid-dir", str(pid_dir), *worker_args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    if not wait:
        return process, pid_dir
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, out, err, pid_dir


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def worker_pids(pid_dir: Path) -> list[int]:
    return [int(path.read_text()) for path in pid_dir.glob("*.pid")]


def assert_no_survivors(pid_dir: Path) -> None:
    pids = worker_pids(pid_dir)
    assert pids, "the workers never started"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)], "worker processes survived the launcher"


def test_all_workers_succeed(tmp_path):
    code, out, err, pid_dir = launch(tmp_path, "--workers", "3")
    assert code == 0, err
    for index in range(3):
        assert f"[worker {index}] hello from index {index} attempt 0 of 3" in out
        assert f"[worker {index}] stderr line from {index}" in out
        assert f"[worker {index}] index {index} done" in out
    assert "all 3 worker(s) finished successfully" in err
    assert "threads=" in out
    assert_no_survivors(pid_dir)


def test_one_failure_stops_the_others_and_returns_its_code(tmp_path):
    started = time.monotonic()
    code, out, err, pid_dir = launch(
        tmp_path, "--workers", "3", "--grace-period", "2",
        worker_args=["--fail-index", "1", "--fail-code", "3", "--sleep", "120"])
    elapsed = time.monotonic() - started
    assert code == 3, err
    assert "worker 1 failed with exit code 3" in err
    assert elapsed < 30, f"the survivors were not stopped promptly ({elapsed:.1f} s)"
    assert "index 0 done" not in out
    assert_no_survivors(pid_dir)


def test_workers_that_ignore_sigterm_are_killed_after_the_grace_period(tmp_path):
    started = time.monotonic()
    code, _, err, pid_dir = launch(
        tmp_path, "--workers", "2", "--grace-period", "1",
        worker_args=["--fail-index", "0", "--sleep", "120", "--ignore-sigterm"])
    assert code == 3, err
    assert time.monotonic() - started < 30
    assert_no_survivors(pid_dir)


def test_restart_recovers_a_first_attempt_failure(tmp_path):
    code, out, err, pid_dir = launch(tmp_path, "--workers", "2", "--max-restarts", "2",
                                     "--grace-period", "2",
                                     worker_args=["--fail-first-attempt", "--sleep", "1"])
    assert code == 0, err
    assert "worker 1 failed with exit code 7" in err
    assert "restarting the gang (restart 1 of 2)" in err
    assert "attempt 2/3" in err
    assert "[worker 1] hello from index 1 attempt 1 of 2" in out
    assert_no_survivors(pid_dir)


def test_restart_budget_is_bounded(tmp_path):
    code, _, err, pid_dir = launch(tmp_path, "--workers", "2", "--max-restarts", "1",
                                   "--grace-period", "1", worker_args=["--fail-index", "0"])
    assert code == 3
    assert err.count("starting 2 worker(s)") == 2
    assert "giving up" in err
    assert_no_survivors(pid_dir)


def test_sigterm_to_the_launcher_is_forwarded(tmp_path):
    process, pid_dir = launch(tmp_path, "--workers", "2", "--grace-period", "2",
                              worker_args=["--sleep", "120"], wait=False)
    try:
        deadline = time.monotonic() + 30
        while len(worker_pids(pid_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM" in err
    assert_no_survivors(pid_dir)


def test_ctrl_c_under_preload_reaches_the_workers_through_the_launcher(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the launcher's whole process group) under --preload: the
    preloaded process sits in a session of its own, so the workers get the launcher's forwarded
    SIGINT (their KeyboardInterrupt), not a SIGKILL from a preloaded process that died of it."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_mwms.launch", "--workers", "2", "--grace-period", "5", "--preload",
         WORKER, "--pid-dir", str(pid_dir), "--sleep", "120"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        wait_until(lambda: len(worker_pids(pid_dir)) == 2, 60, "the workers never started")
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT" in err and "every worker exited" in err, err
    for index in range(2):
        assert f"[worker {index}] KeyboardInterrupt" in out, out
    assert_no_survivors(pid_dir)


def wait_until(condition, timeout: float, failure: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


def start_stubborn_gang(tmp_path: Path, grace_period: float):
    """A launcher with 2 workers that ignore SIGTERM and SIGINT, each with such a child."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "keras_mwms.launch", "--workers", "2", "--grace-period",
             str(grace_period), STUBBORN_WORKER, "--pid-dir", str(pid_dir)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
            stderr=log)
    wait_until(lambda: len(worker_pids(pid_dir)) == 4, 60, "the workers and their children never started")
    return process, pid_dir, log_path


def kill_leftovers(process: subprocess.Popen, pid_dir: Path) -> None:
    """After a failed test: SIGKILL what the launcher left, by pid, if the pid is still ours."""
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)
    for pid in worker_pids(pid_dir):
        try:
            ours = str(pid_dir) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except FileNotFoundError:
            continue
        if ours:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_launcher_kills_workers_that_ignore_the_signal(tmp_path, signum):
    grace_period = 2.0
    process, pid_dir, log_path = start_stubborn_gang(tmp_path, grace_period)
    try:
        signalled = time.monotonic()
        process.send_signal(signum)
        process.wait(timeout=grace_period + 20)
        elapsed = time.monotonic() - signalled
    finally:
        kill_leftovers(process, pid_dir)
    log = log_path.read_text()
    assert process.returncode == 128 + signum, log
    assert elapsed < grace_period + 10, f"the launcher took {elapsed:.1f} s to exit"
    assert f"worker(s) 0, 1 still running after the {grace_period:g} s grace period, killed" in log
    assert_no_survivors(pid_dir)


def test_a_second_signal_kills_at_once(tmp_path):
    process, pid_dir, log_path = start_stubborn_gang(tmp_path, grace_period=120)
    try:
        process.send_signal(signal.SIGTERM)
        # Two signals that arrive before the handler runs are one signal to Python.
        wait_until(lambda: "received SIGTERM" in log_path.read_text(), 30,
                   "the launcher never reported the first signal")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        elapsed = time.monotonic() - signalled
    finally:
        kill_leftovers(process, pid_dir)
    log = log_path.read_text()
    assert process.returncode == 128 + signal.SIGTERM, log
    assert elapsed < 10, f"the launcher took {elapsed:.1f} s to exit after the second signal"
    assert "killed every worker on the second signal" in log
    assert_no_survivors(pid_dir)


@pytest.mark.parametrize("preload", [False, True], ids=["fresh", "preload"])
def test_workers_die_with_a_killed_launcher(tmp_path, preload):
    process, pid_dir = launch(tmp_path, "--workers", "2", *(["--preload"] if preload else []),
                              worker_args=["--sleep", "120"], wait=False)
    try:
        deadline = time.monotonic() + 30
        while len(worker_pids(pid_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        process.kill()
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert_no_survivors(pid_dir)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_preload_forks_every_worker_and_restart_and_keeps_their_exit_codes(tmp_path, monkeypatch, threads):
    # OMP_NUM_THREADS=2: numpy's OpenBLAS pool would start a thread at import; it is kept off.
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    code, out, err, pid_dir = launch(tmp_path, "--workers", "2", "--max-restarts", "1", "--grace-period", "2",
                                     "--preload", worker_args=["--fail-first-attempt"], timeout=120)
    assert code == 0, err + out
    assert "--preload: Keras, its backend and keras_mwms imported once" in err, err
    assert "worker 1 failed with exit code 7" in err and "attempt 2/2" in err, err
    for attempt in range(2):
        for index in range(2):
            assert (f"[worker {index}] hello from index {index} attempt {attempt} of 2 threads={threads} "
                    "preloaded=True") in out, out
    assert "[worker 1] stderr line from 1" in out   # stderr joins stdout, prefixed
    assert "index 0 done" in out and "fresh" not in err, err
    assert len(worker_pids(pid_dir)) == 4
    assert_no_survivors(pid_dir)


def test_preload_without_a_fork_starts_workers_fresh_and_says_why(tmp_path, monkeypatch):
    # numpy's OpenBLAS pool starts a thread at import with 2 threads asked (the user's own
    # OPENBLAS_NUM_THREADS, which preloading keeps): forking is refused.
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    code, out, err, pid_dir = launch(tmp_path, "--workers", "2", "--preload", timeout=120)
    assert code == 0, err + out
    assert "threads run after the imports" in err and "starting workers fresh" in err, err
    assert err.count("--preload:") == 1, err   # once, not once per worker
    for index in range(2):
        assert f"hello from index {index} attempt 0 of 2 threads=1 preloaded=False" in out, out
    assert_no_survivors(pid_dir)


def test_usage_errors(tmp_path):
    for arguments, phrase in [(["--workers", "0", "x.py"], "at least 1"),
                              (["--workers", "2", "missing.py"], "not found"),
                              (["--workers", "2"], "give the training script")]:
        completed = subprocess.run([sys.executable, "-m", "keras_mwms.launch", *arguments],
                                   cwd=REPO, capture_output=True, text=True, timeout=60,
                                   env={**os.environ, "PYTHONPATH": str(REPO)})
        assert completed.returncode == 2
        assert phrase in completed.stderr


def test_gang_sets_one_tf_config_per_worker():
    gang = Gang([sys.executable, "-c", "pass"], workers=3, port_base=41000)
    configs = [parse_tf_config(gang._environment(index)["TF_CONFIG"]) for index in range(3)]
    assert [c["task_id"] for c in configs] == [0, 1, 2]
    assert all(c["cluster"]["worker"] == ["localhost:41000", "localhost:41001", "localhost:41002"]
               for c in configs)


def test_free_ports_and_exit_descriptions():
    assert len(set(find_free_ports(5))) == 5
    assert exit_code_of(-9) == 137 and exit_code_of(3) == 3
    assert describe_exit(-15) == "signal SIGTERM" and describe_exit(2) == "exit code 2"


def test_free_ports_are_never_given_twice_to_gangs_started_at_once(monkeypatch):
    """CI once gave two gangs started in threads the same chief port (17475): each found it free
    before either listened, and one gang's worker joined the other's rendezvous. The span here is
    so narrow that, without the process-wide record, 12 threads would collide almost surely."""
    import random
    import threading

    from keras_mwms import launch

    span = range(20000, 20048)
    monkeypatch.setattr(launch, "_ports_below_ephemeral_range",
                        lambda: random.SystemRandom().sample(span, len(span)))
    given: list[list[int]] = []
    start = threading.Barrier(12)

    def take():
        start.wait(timeout=30)
        given.append(find_free_ports(2))

    threads = [threading.Thread(target=take) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    ports = [port for pair in given for port in pair]
    assert len(given) == 12 and len(set(ports)) == len(ports), given


def test_cli_tf_config_prints_valid_json():
    completed = subprocess.run(
        [sys.executable, "-m", "keras_mwms.cli", "tf-config", "--workers", "n1:2222,n2:2222",
         "--index", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == {"cluster": {"worker": ["n1:2222", "n2:2222"]},
                                            "task": {"type": "worker", "index": 1}}


def test_cli_tf_config_rejects_a_bad_index():
    completed = subprocess.run(
        [sys.executable, "-m", "keras_mwms.cli", "tf-config", "--workers", "n1:2222", "--index", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2
    assert "task.index" in completed.stderr


@pytest.mark.parametrize("arguments,code", [([], 2), (["--help"], 0), (["bogus"], 2)])
def test_cli_dispatch(arguments, code):
    completed = subprocess.run([sys.executable, "-m", "keras_mwms.cli", *arguments], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == code


def test_cli_version_and_the_help_of_launch_and_benchmark():
    def run(*arguments):
        return subprocess.run([sys.executable, "-m", "keras_mwms.cli", *arguments], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    from keras_mwms.version import __version__

    assert run("--version").stdout.strip() == f"keras-mwms {__version__}"
    launch_help = " ".join(run("launch", "--help").stdout.split())
    for default in ("(default 0)", "(default localhost)", "(default 10)"):
        assert default in launch_help, launch_help
    benchmark_help = run("benchmark", "--help").stdout
    for command in ("accumulation", "compression", "orchestrators"):
        assert command in benchmark_help.split("positional arguments")[0], benchmark_help


@pytest.mark.torch
def test_one_worker_by_choice_is_not_warned_about(tmp_path):
    """`launch --workers 1` (one TensorFlow worker with all GPUs, say) is deliberate: no
    single-worker warning, which still comes without the launcher."""
    script = tmp_path / "alone.py"
    script.write_text("import warnings\n"
                      "with warnings.catch_warnings(record=True) as caught:\n"
                      "    warnings.simplefilter('always')\n"
                      "    import keras_mwms\n"
                      "    strategy = keras_mwms.MultiWorkerMirroredStrategy()\n"
                      "print('workers', strategy.num_workers,\n"
                      "      'warned', sum('running a single worker' in str(w.message) for w in caught))\n")
    launched = run_launcher(["--workers", "1"], [str(script)], timeout=120, env=worker_env("torch", lean=True),
                            preload=False)
    assert launched.returncode == 0, launched.output + launched.launcher_log
    assert "workers 1 warned 0" in launched.output, launched.output
    alone = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={**os.environ, **worker_env("torch", lean=True)})
    assert "workers 1 warned 1" in alone.stdout, alone.stdout + alone.stderr

