"""A benchmark's gang of processes, started, bounded and cleaned up in one place.

`accumulation`, `compression` and `orchestrators` each start a few worker processes (their
own command lines and environments), wait for all of them under one deadline, stop the rest
at the first failure, and report the logs' tails when anything failed.

>>> import sys, tempfile
>>> from pathlib import Path
>>> log = Path(tempfile.mkdtemp()) / "hello.log"
>>> run_bounded([([sys.executable, "-c", "print('hello')"], None, log)], timeout=60, what="demo")
>>> log.read_text()
'hello\\n'
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def run_bounded(commands: Sequence[tuple[list[str], dict[str, str] | None, Path]], timeout: float,
                what: str) -> None:
    """Runs `(argv, env, log_path)` processes together, each in its own process group.

    Returns when all exited 0. Raises `RuntimeError` naming `what`, each exit code and each
    log's tail when one fails or the deadline of `timeout` seconds passes; every process still
    running is then killed with its group.
    """
    processes, logs = [], []
    try:
        for argv, env, log_path in commands:
            logs.append(open(log_path, "w"))
            processes.append(subprocess.Popen(argv, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout
        while any(process.poll() is None for process in processes):
            if time.monotonic() > deadline or any(process.returncode not in (None, 0) for process in processes):
                break
            time.sleep(0.5)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        for log in logs:
            log.close()
    codes = [process.returncode for process in processes]
    if any(codes):
        tails = "\n".join(f"--- process {index} (exit {code}):\n" + Path(log_path).read_text()[-3000:]
                          for index, (code, (_, _, log_path)) in enumerate(zip(codes, commands)))
        raise RuntimeError(f"{what} failed or ran past {timeout:.0f} s:\n{tails}")
