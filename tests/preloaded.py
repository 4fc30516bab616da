"""Test workers forked from a process that has already imported Keras: start-up paid once.

The suite's side of `keras_mwms.startup.preload` (which holds the preloaded process, the fork
and what makes a fork the same as a fresh start; `python -m keras_mwms.launch --preload` uses
it too): one preloaded process per import-time environment (`import_time_key`), started on
demand, at most `MAX_RUNNING` at once (the least recently used idle one stops), and the forked
workers' CPU counted for the suite's time table.

`popen(argv, env, ...)` is the one entry point: it answers a `subprocess.Popen` (or a
`ForkedProcess`, with the same `pid`, `stdout`, `poll`, `wait`, `returncode`, `send_signal`,
`kill`) and forks only where that is the same as a fresh start (the package module's rules) and
the caller asks for what a fork gives (stdin /dev/null, stdout a pipe with stderr in it, a
session of its own). `tests.multiworker.run_launcher` sets `KERAS_MWMS_PRELOAD=1`, so the
launcher's workers are forked too (by the launcher's own preloaded process).

`KERAS_MWMS_TEST_FRESH_PROCESSES=1` turns forking off for a run (every worker a fresh process,
the launcher without `--preload`). Where freshness is the point of a test (first-run output,
version overlays, a crash at import) the test keeps `subprocess.Popen`.

CPU: a forked child is reaped by its preloaded process, which reports its CPU seconds with its
end (`reaped_cpu_seconds()`, what `tests/suite_budget.py` adds to the session's own children).
A preloaded process lives until the session's pid is gone (not a parent-death signal: that one
follows the *thread* that started it, and the suite starts them from pool threads).

    process = popen([sys.executable, "-u", "tests/workers/fit_scenario.py"], env=worker_env("torch"))
    output = process.stdout.read()      # the worker's stdout and stderr
    assert process.wait(timeout=300) == 0
"""

from __future__ import annotations

import atexit
import os
import subprocess
import threading
import time
from pathlib import Path

from keras_mwms.startup.preload import ForkedProcess, PreloadedProcess, import_time_key

REPO = Path(__file__).resolve().parent.parent
FRESH_ENV = "KERAS_MWMS_TEST_FRESH_PROCESSES"
MAX_RUNNING = 8         # preloaded processes alive at once (the suite's environments: about 14)


class _Preloaded(PreloadedProcess):
    """One running preloaded process of the session, with its children and their CPU."""

    def __init__(self, env: dict[str, str]):
        super().__init__(env, cwd=str(REPO))
        self.environment = env
        self.children_cpu = 0.0   # reported by it for its ended children (it reaped them)
        self.children: list[ForkedProcess] = []
        self.last_used = time.monotonic()

    def _on_child_exit(self, cpu_seconds: float) -> None:
        _count_cpu(cpu_seconds, self)

    def stop(self) -> None:
        super().stop()
        # Reaping it added its reaped children's CPU to this process's RUSAGE_CHILDREN, which
        # `reaped_cpu_seconds()` already counted: once only.
        _count_cpu(-self.children_cpu)
        self.children_cpu = 0.0


_preloaded: dict[tuple, _Preloaded] = {}
_lock = threading.RLock()   # re-entered: stopping one under it counts CPU under it
_reaped_cpu = [0.0]
_stopped: list = []   # preloaded processes stopped to make room, kept for the summary


def _count_cpu(seconds: float, owner: _Preloaded | None = None) -> None:
    with _lock:
        _reaped_cpu[0] += seconds
        if owner is not None:
            owner.children_cpu += seconds


def _stop_idle_beyond(count: int) -> None:
    """Stops the least recently used preloaded processes with no running child until at most
    `count` run (each holds its imports' memory, 0.3-0.8 GB here). Called under `_lock`."""
    running = [item for item in _preloaded.items() if item[1].alive()]
    running.sort(key=lambda item: item[1].last_used)
    for key, preloaded in running[:max(0, len(running) - count)]:
        if not any(child.poll() is None for child in preloaded.children):
            preloaded.stop()
            del _preloaded[key]
            _stopped.append(preloaded)


def reaped_cpu_seconds() -> float:
    """CPU seconds of the forked children that ended so far (reaped by their preloaded process,
    so not in this process's `RUSAGE_CHILDREN`): `tests/suite_budget.py` adds them."""
    return _reaped_cpu[0]


def summary() -> str:
    """One line for the suite's time table: how many workers were forked, from how many
    preloaded processes, and how many fell back to a fresh start."""
    every = [*_preloaded.values(), *_stopped]
    ready = [preloaded for preloaded in every if preloaded.ready]
    forked = sum(preloaded.forked for preloaded in ready)
    refused = len(every) - len(ready)
    return (f"{forked} workers forked from {len(ready)} preloaded processes (start-up paid once each)"
            + (f"; {refused} environment(s) could not preload and started fresh" if refused else ""))


def details() -> list[dict]:
    """Per preloaded process: its import-time variables, whether it forked, how many children."""
    return [{"environment": dict(preloaded.key), "ready": preloaded.ready, "forked": preloaded.forked,
             "running": preloaded.process.poll() is None, "refused": preloaded.not_ready_reason}
            for preloaded in [*_preloaded.values(), *_stopped]]


@atexit.register
def _stop_all() -> None:
    for preloaded in _preloaded.values():
        preloaded.stop()


def _preloaded_for(env: dict[str, str]) -> _Preloaded | None:
    key = import_time_key(env)
    with _lock:
        if key not in _preloaded:
            _stop_idle_beyond(MAX_RUNNING - 1)
            _preloaded[key] = _Preloaded(env)
        preloaded = _preloaded[key]
    if preloaded.wait_ready() and preloaded.process.poll() is not None:   # it died: start another
        with _lock:
            if _preloaded.get(key) is preloaded:
                del _preloaded[key]
        return _preloaded_for(env)
    return preloaded if preloaded.ready else None


def popen(argv, env: dict[str, str], cwd=None, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, start_new_session: bool = True, preexec_fn=None, nice: int = 0):
    """`subprocess.Popen(argv, env=env, cwd=cwd, stdin, stdout=PIPE, stderr=STDOUT,
    start_new_session=True)` (under `nice -n nice` where `nice` is given), forked from a
    preloaded process where that is the same (see the module docstring); stdout is a pipe the
    caller reads, stderr goes with it."""
    argv = [str(part) for part in argv]
    fresh = (os.environ.get(FRESH_ENV) == "1" or stdout is not subprocess.PIPE
             or stderr is not subprocess.STDOUT or stdin is not subprocess.DEVNULL or not start_new_session)
    preloaded = None if fresh else _preloaded_for(env)
    process = None if preloaded is None else preloaded.start(argv, env, str(cwd or os.getcwd()), nice=nice)
    if process is None:
        return subprocess.Popen(["nice", "-n", str(nice), *argv] if nice else argv, env=env, cwd=cwd,
                                stdin=stdin, stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session, preexec_fn=preexec_fn)
    with _lock:   # the same lock `_stop_idle_beyond` reads `children` under: no running child missed
        preloaded.children = [child for child in preloaded.children if child.poll() is None] + [process]
        preloaded.last_used = time.monotonic()
    return process
