"""Warm gangs shared by the test modules: per backend, each gang size and reference starts once.

Many modules check that N workers train like one process: each used to start its own gangs and
references, paying Python, Keras and the backend's import, the rendezvous and the strategy's
start-up again for every module and backend. Here a module *registers* its scenario jobs when it
is imported, against a `Runner`: a backend and a process kind (a gang of `workers`, `SINGLE` —
one keras_mwms process without TF_CONFIG — or `PLAIN` — one process of plain Keras), plus the
environment and `tests/workers/jobs.py` flags the processes need. Each runner runs once per
session, as one process or gang of `jobs.py` running its jobs one after another; all runners of
a backend run at once, the backends one after another.

They run in the background from the session's first test, at a lower priority (`nice`): the
modules with fresh processes (faults, restarts, hang thresholds) wait much of the time, and the
shared gangs take that idle CPU. Their readers run last (`tests/conftest.py` moves the modules
with jobs to the end), so the results are usually ready; a test that waits for them gives that
backend's processes normal priority and bounds the wait by the runners' budgets from then on.

    SHARED.add(__name__, Runner("torch", 2), "sgd", "fit_scenario", ["{out}", "--optimizer", "sgd"])
    ...
    folder = shared_runs.folder(Runner("torch", 2), __name__, "sgd")   # in a fixture or test

`{out}` in a job's argv is its own output folder. Only modules with a selected test
(`-k`, `-m`, a file on the command line) have their jobs run. A job that fails fails the tests
that read it, with its log; the runner's later jobs did not run, and the tests reading them say
so. Fresh processes stay where freshness is the point (faults, restarts, resume, the launcher,
resolvers, first-run output): those modules start their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from keras_mwms.launch import Gang
from keras_mwms.startup.preload import die_with_parent
from tests import preloaded
from tests.multiworker import REPO, _Capture, concurrently, python_worker, worker_env

PLAIN = 0     # one process of plain Keras, no keras_mwms imported (`jobs.py --plain`)
SINGLE = 1    # one keras_mwms process without TF_CONFIG (the single-process reference)
LATE, LAST = 1, 2   # `Job.order`: after the ordinary jobs; the very last
START_SECONDS = 240         # a runner's start-up and exit, beyond its jobs' budgets (load 8: imports ~60 s)
BACKGROUND_NICENESS = 10    # the shared runners' `nice` until a test waits for them
BACKGROUND_SECONDS = 3600   # how long a runner may be starved in the background before its own bound


@dataclass(frozen=True)
class Runner:
    """Which processes run a job: a backend, `workers` (a gang's size, `SINGLE` or `PLAIN`), the
    environment they need beyond `worker_env(backend)`, and `jobs.py` flags."""

    backend: str
    workers: int
    env: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()

    @property
    def processes(self) -> int:
        return max(1, self.workers)

    def slug(self) -> str:
        kind = {PLAIN: "plain", SINGLE: "single"}.get(self.workers, f"gang{self.workers}")
        extra = "-".join(f"{key}={value}" for key, value in self.env) + "-".join(self.flags)
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(filter(None, [self.backend, kind, extra])))


def gang(backend: str, workers: int) -> Runner:
    """The shared gang of `workers` of `backend` that a module without special needs joins. The
    gang of 3 runs with the keras_mwms logger at ERROR, set before keras_mwms is imported, as a
    user silencing it does (`tests/test_user_scripts.py` checks that nothing of keras_mwms
    prints there); the gang of 2 at the default level."""
    return Runner(backend, workers, flags=("--log-level", "ERROR") if workers == 3 else ())


def job_key(module: str, name: str) -> str:
    """A job's name in its runner's plan, status files and output markers: `test_x.name`."""
    return f"{module.rsplit('.', 1)[-1]}.{name}"


@dataclass
class Job:
    """One scenario script's run inside a runner: `run_job(strategy, argv)` of `tests/workers/<script>.py`."""

    module: str
    name: str
    script: str
    argv: tuple[str, ...]
    seconds: float
    order: int = 0   # jobs run by order, then as registered: `LAST` closes the strategy

    @property
    def key(self) -> str:
        return job_key(self.module, self.name)


@dataclass
class JobOutput:
    """What each process of a runner printed (the whole run, or one job's part)."""

    outputs: list[str]

    @property
    def output(self) -> str:
        """Every process's lines, `[worker i] `-prefixed when there are several."""
        if len(self.outputs) == 1:
            return self.outputs[0]
        return "\n".join(f"[worker {index}] {line}" for index, text in enumerate(self.outputs)
                         for line in text.splitlines())

    def lines(self, worker: int) -> list[str]:
        return self.outputs[worker].splitlines()


@dataclass
class RunnerRun:
    """How one runner's processes ended, what they printed, and where its jobs wrote."""

    folder: Path
    codes: list[int | None]
    outputs: list[str]
    seconds: float
    jobs: list[Job] = field(default_factory=list)

    def joined(self) -> str:
        return JobOutput(self.outputs).output


class SharedRuns:
    """The registry of jobs, and the background runs of each backend's runners (once per session)."""

    def __init__(self) -> None:
        self.jobs: dict[Runner, list[Job]] = {}
        self.runs: dict[Runner, RunnerRun] = {}
        self.backend_seconds: dict[str, float] = {}
        self._done: dict[str, threading.Event] = {}
        self._needed_at: dict[str, float] = {}
        self._processes: dict[str, list[subprocess.Popen]] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._plan: dict[str, dict[Runner, list[Job]]] = {}
        self._root: Path | None = None

    def add(self, module: str, runner: Runner, name: str, script: str, argv: Sequence[str],
            seconds: float = 120.0, order: int = 0) -> None:
        """Registers `script`'s job `name` of `module` on `runner`; `seconds` is its share of the
        runner's time bound (≥ 3× its time at load 8). Jobs run by `order` (`LATE`: jobs that may
        leave the collectives unusable when they fail; `LAST`: a job that closes the strategy),
        then in the order registered."""
        jobs = self.jobs.setdefault(runner, [])
        job = Job(module, name, script, tuple(argv), seconds, order)
        if any(other.key == job.key for other in jobs):
            raise ValueError(f"job {job.key} is registered twice on {runner}")
        jobs.append(job)

    def modules(self) -> set[str]:
        """The modules that registered jobs."""
        return {job.module for jobs in self.jobs.values() for job in jobs}

    def start(self, session, tmp_path_factory) -> SharedRuns:
        """Starts the selected modules' runners in the background, once per session."""
        with self._lock:
            if self._thread is not None:
                return self
            selected = {getattr(item.module, "__name__", None) for item in session.items
                        if getattr(item, "module", None) is not None}
            for runner, jobs in self.jobs.items():
                chosen = sorted((job for job in jobs if job.module in selected), key=lambda job: job.order)
                if chosen:
                    self._plan.setdefault(runner.backend, {})[runner] = chosen
            for backend in self._plan:
                self._done[backend] = threading.Event()
            self._root = Path(tmp_path_factory.mktemp("shared"))
            self._thread = threading.Thread(target=self._run_all, name="shared-gangs", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the background runs (the session is over): every runner still running is killed."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=120)

    def folder(self, runner: Runner, module: str, name: str) -> str:
        """The output folder of `module`'s job `name` on `runner`, every worker's run of it done;
        waits for the backend's runners if they still run. Raises `AssertionError` with the
        job's logs if a worker did not finish it."""
        self._wait_for(runner.backend)
        run = self.runs.get(runner)
        key = job_key(module, name)
        if run is None or not any(job.key == key for job in run.jobs):
            raise AssertionError(f"no job {key} ran on {runner}: is it registered, and its module selected?")
        statuses = [run.folder / f"{key}.w{index}.status" for index in range(runner.processes)]
        unfinished = [path for path in statuses if not path.exists() or not path.read_text().startswith("done")]
        if unfinished:
            detail = "\n".join(f"--- {path.name}: {path.read_text()[-6000:] if path.exists() else '(did not end)'}"
                               for path in unfinished)
            raise AssertionError(f"job {key} did not finish on {runner.slug()} (exit codes {run.codes}, "
                                 f"{run.seconds:.0f} s):\n{detail}\n--- the runner's output:\n"
                                 f"{run.joined()[-6000:]}")
        return str(run.folder / key)

    def output(self, runner: Runner, module: str | None = None, name: str | None = None) -> JobOutput:
        """What the runner's processes printed: all of it, or only while `module`'s job `name` ran."""
        self._wait_for(runner.backend)
        run = self.runs[runner]
        if name is None:
            return JobOutput(run.outputs)
        key = job_key(module, name)
        pieces = []
        for text in run.outputs:
            begin = text.find(f"=== job {key} begins")
            end = text.find(f"=== job {key} ends", begin)
            pieces.append("" if begin < 0 else text[begin:len(text) if end < 0 else end])
        return JobOutput(pieces)

    def _budget(self, backend: str) -> float:
        return START_SECONDS + max(sum(job.seconds for job in jobs) for jobs in self._plan[backend].values())

    def _wait_for(self, backend: str) -> None:
        from tests import suite_budget

        if self._thread is None:
            raise RuntimeError("the shared runs have not started: use the shared_runs fixture (tests/conftest.py)")
        done = self._done.get(backend)
        if done is None:
            raise AssertionError(f"no selected module registered a {backend} job")
        if done.is_set():
            return
        with self._lock:
            self._needed_at.setdefault(backend, time.monotonic())
            _normal_priority(self._processes.get(backend, []))   # a test waits for them now
        budget = self._budget(backend) + 60   # the runners end themselves by then (`_deadline`)
        with suite_budget.charged_to(f"waiting for the shared {backend} gangs"):
            if not done.wait(timeout=budget):
                raise AssertionError(f"the shared {backend} gangs did not finish within {budget:.0f} s of the "
                                     "first test that needed them")

    def _deadline(self, backend: str, started: float, timeout: float) -> float:
        """A runner's deadline: `timeout` from when a test first needed it, but at most
        `BACKGROUND_SECONDS` + `timeout` from its start (in the background it may be starved)."""
        needed = self._needed_at.get(backend)
        late = started + BACKGROUND_SECONDS + timeout
        return late if needed is None else min(late, max(needed, started) + timeout)

    def _run_all(self) -> None:
        from tests.suite_budget import SuiteBudget

        for backend, planned in self._plan.items():
            started = time.monotonic()
            try:
                if not self._stopping.is_set():
                    self.runs.update(concurrently(partial(self._run, planned=planned), planned, at_once=len(planned)))
            finally:
                self.backend_seconds[backend] = time.monotonic() - started
                if SuiteBudget.current is not None:
                    SuiteBudget.current.ended_beside(f"shared gangs: {backend}", self.backend_seconds[backend], 0.0)
                self._done[backend].set()

    def _run(self, runner: Runner, planned: dict[Runner, list[Job]]) -> RunnerRun:
        from tests.suite_budget import SuiteBudget

        jobs = planned[runner]
        folder = self._root / runner.slug()
        folder.mkdir(parents=True)
        plan = [{"name": job.key, "script": job.script,
                 "argv": [part.replace("{out}", str(folder / job.key)) for part in job.argv]} for job in jobs]
        (folder / "plan.json").write_text(json.dumps(plan, indent=1))
        command = python_worker("jobs.py", str(folder / "plan.json"),
                                *(["--plain"] if runner.workers == PLAIN else []), *runner.flags)
        env = worker_env(runner.backend, **dict(runner.env))
        timeout = START_SECONDS + sum(job.seconds for job in jobs)
        started = time.monotonic()
        processes = _Processes(command, runner.workers, env)
        try:
            processes.start()
            if SuiteBudget.current is not None:
                SuiteBudget.current.background(f"shared gangs: {runner.backend}",
                                               [process.pid for process in processes.popens()])
            with self._lock:
                self._processes.setdefault(runner.backend, []).extend(processes.popens())
                if runner.backend in self._needed_at:   # a test already waits for them
                    _normal_priority(processes.popens())
            code = None
            while code is None and not self._stopping.is_set():
                code = processes.wait(1.0)
                if code is None and time.monotonic() > self._deadline(runner.backend, started, timeout):
                    processes.note(f"[shared gangs] {runner.slug()} still running after "
                                   f"{time.monotonic() - started:.0f} s: stopped")
                    break
        finally:
            processes.stop()
            if SuiteBudget.current is not None:   # its CPU, reaped while some file ran: not that file's
                cpu = sum(float(path.read_text()) for path in folder.glob("cpu.w*"))
                SuiteBudget.current.ended_beside(f"shared gangs: {runner.backend}", 0.0, cpu)
                SuiteBudget.current.slowest(f"shared gangs: {runner.backend}", _job_seconds(folder, jobs))
        return RunnerRun(folder, [code], processes.outputs(), time.monotonic() - started, jobs)


class _Processes:
    """A runner's processes: a gang through the launcher's `Gang` (its environment, as `run_gang`
    starts one), or one process without TF_CONFIG; each in its own process group."""

    def __init__(self, command: list[str], workers: int, env: dict[str, str]) -> None:
        self.command, self.workers, self.env = command, workers, env
        self.capture = _Capture()
        # Forked after the imports where that equals a fresh start (tests/preloaded.py), at `nice`.
        start = partial(preloaded.popen, nice=BACKGROUND_NICENESS)
        self.gang: Gang | None = (Gang(command, workers, grace_period=5.0, extra_env=env, start_process=start)
                                  if workers > SINGLE else None)
        self.single: subprocess.Popen | None = None
        self._pump: threading.Thread | None = None

    def start(self) -> None:
        if self.gang is not None:
            self.gang.start(self.capture)
            return
        environment = {**{key: value for key, value in os.environ.items() if key != "TF_CONFIG"}, **self.env}
        self.single = preloaded.popen(self.command, cwd=REPO, env=environment, preexec_fn=die_with_parent,
                                      nice=BACKGROUND_NICENESS)
        self._pump = threading.Thread(target=self._copy, args=(self.single.stdout,), daemon=True)
        self._pump.start()

    def _copy(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            self.capture.write("[worker 0] " + raw.decode(errors="replace"))
        stream.close()

    def popens(self) -> list[subprocess.Popen]:
        return [worker.process for worker in self.gang.running] if self.gang else [self.single]

    def wait(self, seconds: float) -> int | None:
        """The first failure's code, or 0 once all exited 0; None while they run (after `seconds`)."""
        if self.gang is not None:
            try:
                return self.gang.wait(timeout=seconds)[0]
            except TimeoutError:
                return None
        try:
            return self.single.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def note(self, text: str) -> None:
        self.capture.write(f"\n[worker 0] {text}\n")

    def stop(self) -> None:
        if self.gang is not None:
            self.gang.stop()
            return
        if self.single is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.single.pid, signal.SIGKILL)
            self.single.wait(timeout=30)
            self._pump.join(timeout=5)

    def outputs(self) -> list[str]:
        text = self.capture.getvalue()
        return [_unprefixed(text, index) for index in range(max(1, self.workers))]


def _job_seconds(folder: Path, jobs: list[Job]) -> list[tuple[str, float]]:
    """How long each job took on the runner's first process (its status file), for the time table."""
    seconds = []
    for job in jobs:
        status = folder / f"{job.key}.w0.status"
        found = re.match(r"(?:done in|failed after) ([0-9.]+) s", status.read_text()) if status.exists() else None
        if found:
            seconds.append((job.key, float(found.group(1))))
    return seconds


def _normal_priority(processes: list[subprocess.Popen]) -> None:
    """Gives the processes' groups (each started in its own session) niceness 0 again."""
    for process in processes:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PGRP, process.pid, 0)


def _unprefixed(output: str, worker: int) -> str:
    prefix = f"[worker {worker}] "
    return "\n".join(line[len(prefix):] for line in output.splitlines() if line.startswith(prefix))


SHARED = SharedRuns()
"""The session's registry: modules add their jobs at import, tests read them through the
`shared_runs` fixture (`tests/conftest.py`)."""
