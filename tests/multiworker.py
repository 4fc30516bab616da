"""The one fixture every multi-process test uses: start N real workers, bounded, cleaned up.

Workers are started through the real launcher's `Gang` (free ports chosen at run time, own
process groups, `[worker i]`-prefixed output), with a deadline on the whole run; on expiry
or any exception every worker's process group is killed and the captured output is attached
to the failure.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keras_mwms.launch import Gang

REPO = Path(__file__).resolve().parent.parent
WORKERS_DIR = Path(__file__).resolve().parent / "workers"


class _Capture(io.TextIOBase):
    """A thread-safe text sink for the gang's prefixed output."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._parts.append(text)
        return len(text)

    def getvalue(self) -> str:
        with self._lock:
            return "".join(self._parts)


@dataclass
class GangResult:
    """How a gang ended: the first failure's code (0 if all succeeded) and all output."""

    returncode: int
    failed_worker: int | None
    output: str
    addresses: list[str]

    def lines(self, worker: int) -> list[str]:
        prefix = f"[worker {worker}] "
        return [line[len(prefix):] for line in self.output.splitlines() if line.startswith(prefix)]


def worker_env(backend: str | None = None, **extra: str) -> dict[str, str]:
    """Environment for test workers: one thread each, the repo importable, a backend chosen."""
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_MWMS_RENDEZVOUS_TIMEOUT": "60",
    }
    if backend:
        env["KERAS_BACKEND"] = backend
    env.update(extra)
    return env


def run_gang(command: Sequence[str], workers: int, timeout: float, env: dict[str, str] | None = None,
             grace_period: float = 5.0, per_worker_env: dict[int, dict[str, str]] | None = None) -> GangResult:
    """Runs `command` as `workers` workers; returns when all exit or one fails; bounded by `timeout`.

    On a failure the others are stopped, as the launcher does. Raises `AssertionError` with the
    output if the deadline passes.
    """
    capture = _Capture()
    gang = Gang(list(command), workers, grace_period=grace_period, extra_env=env or {},
                worker_env=per_worker_env)
    try:
        gang.start(capture)
        try:
            code, index = gang.wait(timeout=timeout)
        except TimeoutError:
            gang.stop()
            raise AssertionError(
                f"gang of {workers} did not finish within {timeout} s; output:\n{capture.getvalue()[-8000:]}"
            ) from None
    finally:
        gang.stop()
    return GangResult(code, index, capture.getvalue(), gang.addresses)


@dataclass
class LaunchResult:
    """How a `python -m keras_mwms.launch` run ended."""

    returncode: int
    output: str
    launcher_log: str


def run_launcher(launcher_args: Sequence[str], worker_command: Sequence[str], timeout: float,
                 env: dict[str, str] | None = None) -> LaunchResult:
    """Runs the real launcher CLI in its own process group, bounded by `timeout`."""
    import signal
    import subprocess

    command = [sys.executable, "-m", "keras_mwms.launch", *launcher_args, *worker_command]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        output, log = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, log = process.communicate()
        raise AssertionError(f"launcher did not finish within {timeout} s:\n{log[-4000:]}\n"
                             f"{output[-8000:]}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return LaunchResult(process.returncode, output, log)


def python_worker(script: str, *args: str) -> list[str]:
    """Command line running `tests/workers/<script>` with this interpreter."""
    return [sys.executable, "-u", str(WORKERS_DIR / script), *args]
