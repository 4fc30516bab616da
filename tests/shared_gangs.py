"""Warm gangs shared by the test modules: per backend, each gang size and reference starts once.

Many modules check that N workers train like one process: each used to start its own gangs and
references, paying Python, Keras and the backend's import, the rendezvous and the strategy's
start-up again for every module and backend. Here a module *registers* its scenario jobs when it
is imported, against a `Runner`: a backend and a process kind (a gang of `workers`, `SINGLE` —
one keras_mwms process without TF_CONFIG — or `PLAIN` — one process of plain Keras), plus the
environment and `tests/workers/jobs.py` flags the processes need. The first test that asks for
a job's results runs every selected module's jobs of that backend: each runner once, as one
process or gang of `jobs.py` running its jobs one after another, all runners of the backend at
once (a lone reference leaves a core idle beside a gang). Later tests of any module read their
dumps; nothing is started again.

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

import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.multiworker import Spawn, concurrently, python_worker, run_gang, run_processes, worker_env

PLAIN = 0     # one process of plain Keras, no keras_mwms imported (`jobs.py --plain`)
SINGLE = 1    # one keras_mwms process without TF_CONFIG (the single-process reference)
LATE, LAST = 1, 2   # `Job.order`: after the ordinary jobs; the very last
START_SECONDS = 240        # a runner's start-up and exit, beyond its jobs' budgets (load 8: imports ~60 s)


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
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"


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
    """The registry of jobs, and the runs of each backend's runners (once per session)."""

    def __init__(self) -> None:
        self.jobs: dict[Runner, list[Job]] = {}
        self.runs: dict[Runner, RunnerRun] = {}
        self.backend_seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._session = None
        self._tmp_path_factory = None

    def bind(self, session, tmp_path_factory) -> SharedRuns:
        """The pytest session whose selected modules' jobs run, and where they write."""
        self._session, self._tmp_path_factory = session, tmp_path_factory
        return self

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

    def folder(self, runner: Runner, module: str, name: str) -> str:
        """The output folder of `module`'s job `name` on `runner`, every worker's run of it done;
        runs the backend's runners first if this session has not yet. Raises `AssertionError`
        with the job's logs if a worker did not finish it."""
        with self._lock:
            if runner.backend not in self.backend_seconds:
                self._run_backend(runner.backend)
        run = self.runs.get(runner)
        key = Job(module, name, "", (), 0).key
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
        run = self.runs[runner]
        if name is None:
            return JobOutput(run.outputs)
        key = Job(module, name, "", (), 0).key
        pieces = []
        for text in run.outputs:
            begin = text.find(f"=== job {key} begins")
            end = text.find(f"=== job {key} ends", begin)
            pieces.append("" if begin < 0 else text[begin:len(text) if end < 0 else end])
        return JobOutput(pieces)

    def _run_backend(self, backend: str) -> None:
        from tests import suite_budget

        if self._session is None:
            raise RuntimeError("SHARED is not bound to a session: use the shared_runs fixture (tests/conftest.py)")
        selected = {getattr(item.module, "__name__", None) for item in self._session.items
                    if getattr(item, "module", None) is not None}
        planned = {}
        for runner, jobs in self.jobs.items():
            chosen = [job for job in jobs if job.module in selected]
            if runner.backend == backend and chosen:
                planned[runner] = sorted(chosen, key=lambda job: job.order)
        root = self._tmp_path_factory.mktemp(f"shared-{backend}")
        started = time.monotonic()
        with suite_budget.charged_to(f"shared gangs: {backend}"):
            runs = concurrently(lambda runner: self._run(runner, planned[runner], root / runner.slug()),
                                planned, at_once=len(planned) or 1)
        self.runs.update(runs)
        self.backend_seconds[backend] = time.monotonic() - started

    @staticmethod
    def _run(runner: Runner, jobs: list[Job], folder: Path) -> RunnerRun:
        folder.mkdir(parents=True)
        plan = [{"name": job.key, "script": job.script,
                 "argv": [part.replace("{out}", str(folder / job.key)) for part in job.argv]} for job in jobs]
        (folder / "plan.json").write_text(json.dumps(plan, indent=1))
        command = python_worker("jobs.py", str(folder / "plan.json"), *(["--plain"] if runner.workers == PLAIN else []),
                                *runner.flags)
        env = worker_env(runner.backend, **dict(runner.env))
        timeout = START_SECONDS + sum(job.seconds for job in jobs)
        started = time.monotonic()
        try:
            if runner.workers > SINGLE:   # through the launcher's `Gang`, as `run_gang`: its environment
                gang = run_gang(command, runner.workers, timeout, env=env)
                outputs = ["\n".join(gang.lines(index)) for index in range(runner.workers)]
                return RunnerRun(folder, [gang.returncode], outputs, time.monotonic() - started, jobs)
            ran = run_processes([Spawn(command, env)], timeout=timeout)
            return RunnerRun(folder, ran.codes, ran.outputs, time.monotonic() - started, jobs)
        except AssertionError as error:   # the deadline: every job's test fails with this message
            return RunnerRun(folder, [None], [str(error)] * runner.processes, time.monotonic() - started, jobs)


SHARED = SharedRuns()
"""The session's registry: modules add their jobs at import, tests read them through the
`shared_runs` fixture (`tests/conftest.py`)."""
