"""The one fixture every multi-process test uses: start N real processes, bounded, cleaned up.

* `run_gang`: workers through the real launcher's `Gang` (free ports chosen at run time, own
  process groups, `[worker i]`-prefixed output), all stopped at the first failure, as the
  launcher does;
* `watch_gang`: the same gang, but each worker exits on its own (fault tests: do survivors end?);
* `run_processes`: processes whose command line, environment (TF_CONFIG included) or argv
  prefix (`ip netns exec NS`) the test chooses itself;
* `run_one_process`: one process without TF_CONFIG, e.g. the single-process reference;
* `start_processes`: `run_processes` in the background (a reference beside the gangs), joined later;
* `run_launcher`: the `python -m keras_mwms.launch` command line itself;
* `concurrently`: independent runs (gangs, launcher runs, lone processes) a few at a time, for
  runs that leave a core idle (restarts, sleeps, a lone process), with `selected_params` to run
  only the cases the session selected.

Each puts a deadline on the whole run and kills every process group at the end, also on an
exception; what the processes printed is returned, or attached to the failure.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from keras_mwms import settings
from keras_mwms.launch import Gang, find_free_ports
from keras_mwms.startup.preload import die_with_parent
from tests import preloaded

# How many independent runs `concurrently` starts at once by default: on 2 cores, three runs that
# each leave a core idle part of the time (a restart, a sleep, a lone reference) keep both busy.
AT_ONCE = 3

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


LEAN_IMPORTS = Path(__file__).resolve().parent / "lean_imports"


def worker_env(backend: str | None = None, lean: bool = False, **extra: str) -> dict[str, str]:
    """Environment for test workers: one thread each, the repo importable, a backend chosen.

    `lean`: without Keras' optional integrations (matplotlib, scikit-learn, pandas, orbax; about a
    third of a worker's start-up CPU), for workers of fault, restart and launcher tests that
    never use them (`tests/lean_imports/sitecustomize.py`)."""
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [*([str(LEAN_IMPORTS)] if lean else []), str(REPO),
                                                    os.environ.get("PYTHONPATH")])),
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
                worker_env=per_worker_env, start_process=preloaded.popen)
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
class WatchedGang:
    """How each worker of a `watch_gang` run ended; times are wall-clock (`time.time()`).

    `codes[i]` is None for a worker that had not exited on its own when the watch ended (it was
    then stopped); `orphans` lists (`pgrep -af`) processes still carrying the run's marker.
    """

    codes: dict[int, int | None]
    exit_times: dict[int, float]
    output: str
    addresses: list[str]
    started: float
    orphans: str

    def lines(self, worker: int) -> str:
        prefix = f"[worker {worker}] "
        return "\n".join(line[len(prefix):] for line in self.output.splitlines() if line.startswith(prefix))


def watch_gang(command: Sequence[str], workers: int, deadline: float, env: dict[str, str] | None = None,
               wait_for: set[int] | None = None, per_worker_env: dict[int, dict[str, str]] | None = None,
               marker: str | None = None, grace_period: float = 3.0) -> WatchedGang:
    """Runs a gang and lets every worker in `wait_for` (default: all) exit *on its own*.

    Unlike `run_gang` and the launcher, a first failure does not stop the others: the point is
    to see whether survivors end by themselves. Then, or at `deadline` seconds, the rest are
    stopped as the launcher would (SIGTERM, SIGKILL after `grace_period`). `marker`, a string
    unique to this run's command line, finds processes left behind afterwards.
    """
    capture = _Capture()
    # A marker is looked for in command lines afterwards: a fresh process carries its own, a
    # forked one its preloaded process's (tests/preloaded.py).
    gang = Gang(list(command), workers, grace_period=grace_period, extra_env=env or {},
                worker_env=per_worker_env, start_process=subprocess.Popen if marker else preloaded.popen)
    wait_for = set(range(workers)) if wait_for is None else wait_for
    exit_times: dict[int, float] = {}
    started = time.time()
    try:
        gang.start(capture)
        end = time.monotonic() + deadline
        while time.monotonic() < end and not wait_for <= set(exit_times):
            for worker in gang.running:
                if worker.index not in exit_times and worker.process.poll() is not None:
                    exit_times[worker.index] = time.time()
            time.sleep(0.1)
    finally:
        gang.stop()
    codes = {worker.index: worker.process.returncode if worker.index in exit_times else None
             for worker in gang.running}
    orphans = ""
    if marker:
        orphans = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.strip()
    return WatchedGang(codes, exit_times, capture.getvalue(), gang.addresses, started, orphans)


@dataclass
class LaunchResult:
    """How a `python -m keras_mwms.launch` run ended."""

    returncode: int
    output: str
    launcher_log: str


def run_launcher(launcher_args: Sequence[str], worker_command: Sequence[str], timeout: float,
                 env: dict[str, str] | None = None, preload: bool = True) -> LaunchResult:
    """Runs the real launcher CLI in its own process group, bounded by `timeout`.

    With `preload` (unless `KERAS_MWMS_TEST_FRESH_PROCESSES=1`) it runs with
    `KERAS_MWMS_PRELOAD=1`: its workers and restarts are forked from one process that imported
    Keras once (`keras_mwms.startup.preload`); `preload=False` where a fresh worker is the point."""
    command = [sys.executable, "-m", "keras_mwms.launch", *launcher_args, *worker_command]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **launcher_preload_env(preload), **(env or {})},
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


def launcher_preload_env(preload: bool = True) -> dict[str, str]:
    """`{"KERAS_MWMS_PRELOAD": "1"}` for a process that runs the launcher, so that the launcher
    forks its workers (`--preload`), or `"0"` (`preload=False`, or a run with
    `KERAS_MWMS_TEST_FRESH_PROCESSES=1`)."""
    on = preload and os.environ.get(preloaded.FRESH_ENV) != "1"
    return {settings.PRELOAD.name: "1" if on else "0"}


def python_worker(script: str, *args: str) -> list[str]:
    """Command line running `tests/workers/<script>` with this interpreter."""
    return [sys.executable, "-u", str(WORKERS_DIR / script), *args]


@dataclass
class Spawn:
    """One process for `run_processes`.

    `argv` is the command line; `env` is added to this process's environment (which never
    inherits a TF_CONFIG: give one here); `prefix` goes in front of `argv` and must exec it,
    e.g. `("ip", "netns", "exec", "ns0")`, so that the process we hold is the command.
    """

    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    prefix: Sequence[str] = ()


@dataclass
class ProcessesResult:
    """How each process of a `run_processes` call ended, in the order given.

    `codes[i]` is None when the process was still running `grace_after_failure` seconds after
    another one failed, and was killed; `seconds[i]` counts from the start to its exit (or kill).
    """

    codes: list[int | None]
    seconds: list[float]
    outputs: list[str]

    def log(self, tail: int = 6000) -> str:
        """Every process's exit code and the tail of its output, for failure messages."""
        return "\n".join(f"--- process {index}: exit code {code} after {seconds:.1f} s\n{output[-tail:]}"
                         for index, (code, seconds, output)
                         in enumerate(zip(self.codes, self.seconds, self.outputs)))


def gang_spawns(argv: Sequence[str], workers: int, env: dict[str, str]) -> list[Spawn]:
    """One `Spawn` per worker of a localhost gang on free ports: `argv` with `env` and the
    worker's TF_CONFIG (for `run_processes`, beside other processes such as a reference)."""
    addresses = [f"localhost:{port}" for port in find_free_ports(workers)]
    return [Spawn(argv, {**env, "TF_CONFIG": json.dumps(
        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}})})
            for index in range(workers)]


def run_processes(spawns: Sequence[Spawn], timeout: float, grace_after_failure: float | None = None,
                  cwd: Path = REPO, stop: threading.Event | None = None) -> ProcessesResult:
    """Runs every spawn at once, each in its own process group, and waits for all to exit.

    Each process's stdout and stderr are captured together. With `grace_after_failure`, once one
    process exits non-zero the others get that many seconds more, then are killed (code None).
    If `timeout` seconds pass with a process still running, every process group is killed and
    `AssertionError` carries everyone's output. Once `stop` is set, those still running are
    killed (code None). Whatever happens, no process group outlives the call (a group may hold
    grandchildren after its leader exited).
    """
    base = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    processes: list[subprocess.Popen] = []
    chunks: list[list[bytes]] = [[] for _ in spawns]
    pumps: list[threading.Thread] = []
    exited: dict[int, float] = {}
    started = time.monotonic()

    def result() -> ProcessesResult:
        now = time.monotonic()
        return ProcessesResult(
            codes=[process.returncode if index in exited else None for index, process in enumerate(processes)],
            seconds=[exited.get(index, now) - started for index in range(len(processes))],
            outputs=[b"".join(chunk).decode(errors="replace") for chunk in chunks])

    try:
        for spawn, sink in zip(spawns, chunks):
            process = preloaded.popen([*spawn.prefix, *spawn.argv], cwd=cwd, env={**base, **spawn.env},
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent)
            processes.append(process)
            pumps.append(threading.Thread(target=_pump, args=(process.stdout, sink), daemon=True))
            pumps[-1].start()
        hard_deadline = deadline = started + timeout
        while True:
            for index, process in enumerate(processes):
                if index not in exited and process.poll() is not None:
                    exited[index] = time.monotonic()
                    if process.returncode != 0 and grace_after_failure is not None:
                        deadline = min(deadline, exited[index] + grace_after_failure)
            if len(exited) == len(processes) or time.monotonic() >= deadline or (stop and stop.is_set()):
                break
            time.sleep(0.05)
        if len(exited) < len(processes) and deadline == hard_deadline and not (stop and stop.is_set()):
            _kill_groups(processes, pumps)
            raise AssertionError(f"{len(processes) - len(exited)} of {len(processes)} processes still "
                                 f"running after {timeout} s; output:\n{result().log()}")
    finally:
        _kill_groups(processes, pumps)
    return result()


class Started:
    """`run_processes` running in a background thread (see `start_processes`).

    `result()` joins it; leaving the `with` block kills whatever still runs, e.g. after a gang
    beside it failed.
    """

    def __init__(self, spawns: Sequence[Spawn], timeout: float, grace_after_failure: float | None) -> None:
        self._timeout = timeout
        self._stop = threading.Event()
        self._outcome: list = []
        self._thread = threading.Thread(target=self._run, args=(spawns, timeout, grace_after_failure), daemon=True)
        self._thread.start()

    def _run(self, spawns, timeout, grace_after_failure) -> None:
        try:
            self._outcome.append(run_processes(spawns, timeout, grace_after_failure, stop=self._stop))
        except BaseException as error:  # handed to the caller of result()
            self._outcome.append(error)

    def result(self) -> ProcessesResult:
        """The processes' `ProcessesResult`; raises what `run_processes` raised (e.g. its timeout)."""
        # run_processes is bounded by its own timeout, then kills and reaps (at most ~35 s more).
        self._thread.join(self._timeout + 60)
        if not self._outcome:
            raise AssertionError(f"background processes: no result {self._timeout + 60} s into the wait for them")
        if isinstance(self._outcome[0], BaseException):
            raise self._outcome[0]
        return self._outcome[0]

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(60)


def start_processes(spawns: Sequence[Spawn], timeout: float, grace_after_failure: float | None = None) -> Started:
    """Starts `run_processes(spawns, ...)` in a background thread and returns at once.

    For a single-process reference that runs beside the gangs it is compared with: on 2 cores a
    lone process leaves one idle. Same bounds and clean-up as `run_processes`; the processes die
    with this one, and at the end of the `with` block at the latest.

        with start_processes([Spawn(command, worker_env("jax"))], timeout=300) as reference:
            ...                              # the gangs
            assert reference.result().codes == [0]
    """
    return Started(spawns, timeout, grace_after_failure)


def _pump(stream, sink: list[bytes]) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        sink.append(chunk)
    stream.close()


def _kill_groups(processes: Sequence[subprocess.Popen], pumps: Sequence[threading.Thread]) -> None:
    """SIGKILLs every process group, reaps each leader, and drains the output pipes."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    for pump in pumps:
        pump.join(timeout=5)


def run_one_process(command: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Runs `command` as one process without TF_CONFIG (the single-process reference).

    Returns what it printed; raises `AssertionError` with its output if it exits non-zero or
    outlives `timeout`.
    """
    result = run_processes([Spawn(command, env or {})], timeout)
    assert result.codes[0] == 0, result.log()
    return result.outputs[0]


def concurrently(function: Callable, jobs: Iterable[Hashable], at_once: int = AT_ONCE) -> dict:
    """Runs `function(job)` for every job in threads, `at_once` at a time; returns {job: result}.

    For independent runs that each wait part of the time (a restart, a sleep, a hang threshold,
    a lone reference process): overlapping them keeps the cores busy. Each run stays bounded by
    its own timeouts; every job runs to its end, then the first failed job's exception (in the
    jobs' order) is raised. Create `tmp_path_factory` folders before: it is not thread-safe.

        runs = concurrently(lambda backend: run_gang(command, 2, 300, env=worker_env(backend)),
                            ["tensorflow", "jax", "torch"])
    """
    jobs = list(jobs)
    with ThreadPoolExecutor(max_workers=max(1, at_once)) as pool:
        futures = {job: pool.submit(function, job) for job in jobs}
        for future in futures.values():   # all end (bounded) before the first error is raised
            future.exception()
    return {job: future.result() for job, future in futures.items()}


def selected_params(request, *names: str) -> list:
    """The values of the parameters `names` among the selected tests of the requesting fixture's
    module, in collection order, once each (one name: its values; several: tuples). A module
    fixture that runs every case at once (`concurrently`) runs only those `-k`/`-m` left.

        backends = selected_params(request, "backend")                 # ["jax", "torch"]
        cases = selected_params(request, "guide", "backend")           # [("a.py", "jax"), ...]
    """
    values = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and all(name in params for name in names):
            value = params[names[0]] if len(names) == 1 else tuple(params[name] for name in names)
            if value not in values:
                values.append(value)
    return values
