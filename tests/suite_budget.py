"""Where the suite's time goes: one table per run, per test file, printed at the end of `make test`.

For each test file: its wall seconds (setup, call and teardown of its cases, module fixtures
included), the processes its cases started (every descendant of the pytest process seen alive,
sampled every `SAMPLE_SECONDS`: gangs, launchers and the workers those start), the CPU seconds
those processes used (`RUSAGE_CHILDREN`, counted when they were reaped), and its share of the
suite's wall time. The table is printed in pytest's summary and written to
`build/suite-budget.txt` (and `.json`), which `make test` prints again last, after the version
smoke and the benchmark, so every CI log ends with the budget. Work beside the files (the
shared warm gangs, `tests/shared_gangs.py`) is listed below the table: its wall seconds,
processes and CPU seconds, not charged to the file that ran meanwhile.

The plugin is registered by `tests/conftest.py`; `-p no:suite_budget` turns it off.

    python -m pytest tests/test_log.py        # ... then the table: file | wall s | share | ...
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from tests import preloaded

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "build" / "suite-budget"
SAMPLE_SECONDS = 0.5
SLOWEST_SHOWN = 8   # the slowest jobs of each kind of work beside the files, in the table


def _children_cpu_seconds() -> float:
    """CPU of every process this one started and reaped, and of the workers forked for it
    by preloaded processes (`tests.preloaded`, which reap them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime + preloaded.reaped_cpu_seconds()


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, all cores, from /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + fields[4]   # idle, iowait
    return sum(fields) - idle, sum(fields)


def _busy(busy: int, total: int) -> float:
    return busy / total if total else 0.0


class _Descendants(threading.Thread):
    """Samples /proc for processes descending from this one; counts each (pid, start) once,
    under the label of a registered background root it descends from (`background`), else in
    `seen`."""

    def __init__(self) -> None:
        super().__init__(name="suite-budget-sampler", daemon=True)
        self.root = os.getpid()
        self.seen: set[tuple[int, str]] = set()
        self.roots: dict[int, str] = {}
        self.labelled: dict[str, set[tuple[int, str]]] = defaultdict(set)
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def count(self) -> int:
        with self.lock:
            return len(self.seen)

    def background(self, label: str, pids) -> None:
        """Counts the processes `pids` and their descendants under `label` from now on."""
        with self.lock:
            self.roots.update((pid, label) for pid in pids)

    def run(self) -> None:
        while not self.stopping.wait(SAMPLE_SECONDS):
            parents: dict[int, int] = {}
            starts: dict[int, str] = {}
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry.name}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                pid = int(entry.name)
                parents[pid], starts[pid] = int(fields[1]), fields[19]
            with self.lock:
                roots = dict(self.roots)
            found, labelled = [], []
            for pid in parents:
                label = roots.get(pid)
                ancestor, hops = parents[pid], 0
                while ancestor not in (self.root, 0, 1) and ancestor in parents and hops < 64:
                    label = label or roots.get(ancestor)
                    ancestor, hops = parents[ancestor], hops + 1
                if ancestor == self.root:
                    (labelled.append((label, (pid, starts[pid]))) if label else found.append((pid, starts[pid])))
            with self.lock:
                self.seen.update(found)
                for label, key in labelled:
                    self.labelled[label].add(key)


class SuiteBudget:
    """The pytest plugin: per-file wall seconds, processes and child CPU seconds."""

    current: SuiteBudget | None = None   # the plugin of this session, for `charged_to`

    def __init__(self) -> None:
        SuiteBudget.current = self
        self.wall: dict[str, float] = defaultdict(float)
        self.moved: dict[str, float] = defaultdict(float)
        self.processes: dict[str, int] = defaultdict(int)
        self.cpu: dict[str, float] = defaultdict(float)
        self.cases: dict[str, int] = defaultdict(int)
        self.own_cpu: dict[str, float] = defaultdict(float)
        self.jiffies: dict[str, list[int]] = defaultdict(lambda: [0, 0])   # file -> [busy, total]
        self.slowest_jobs: dict[str, list[tuple[str, float]]] = {}
        # Work beside the files (`tests.shared_gangs`): label -> [wall s, child CPU s].
        self.beside: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.sampler = _Descendants() if os.path.isdir("/proc") else None
        self._file: str | None = None
        self._marks = (0, 0.0, 0.0, (0, 0))
        self._marks_lock = threading.Lock()   # `ended_beside` runs in another thread
        self.started = time.monotonic()
        self.started_jiffies = _machine_jiffies()

    def _marks_now(self) -> tuple[int, float, float, tuple[int, int]]:
        return (self.sampler.count() if self.sampler else 0, _children_cpu_seconds(), _own_cpu_seconds(),
                _machine_jiffies())

    def _close_file(self) -> None:
        with self._marks_lock:
            if self._file is not None:
                processes, cpu, own, jiffies = self._marks_now()
                self.processes[self._file] += processes - self._marks[0]
                self.cpu[self._file] += cpu - self._marks[1]
                self.own_cpu[self._file] += own - self._marks[2]
                for at, now in enumerate(jiffies):
                    self.jiffies[self._file][at] += now - self._marks[3][at]
            self._file = None

    def pytest_sessionstart(self, session) -> None:
        if self.sampler:
            self.sampler.start()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        file = nodeid.split("::", 1)[0]
        if file != self._file:
            self._close_file()
            with self._marks_lock:
                self._file, self._marks = file, self._marks_now()

    def pytest_runtest_logreport(self, report) -> None:
        file = report.nodeid.split("::", 1)[0]
        self.wall[file] += report.duration
        if report.when == "call":
            self.cases[file] += 1

    def charge(self, label: str, seconds: float) -> None:
        """Moves wall seconds spent during the current file's case to `label` (waiting for work
        beside the files, which counts its own processes and CPU)."""
        with self._marks_lock:
            if self._file is not None:
                self.moved[self._file] += seconds
        self.wall[label] += seconds

    def background(self, label: str, pids) -> None:
        """Counts the processes `pids` (and theirs) under `label`, work beside the files."""
        if self.sampler:
            self.sampler.background(label, pids)

    def ended_beside(self, label: str, wall: float, cpu: float) -> None:
        """Work beside the files ended: its wall seconds, and the CPU seconds its processes used,
        which the file running now was charged when they were reaped."""
        with self._marks_lock:
            if self._file is not None:
                self._marks = (self._marks[0], self._marks[1] + cpu, *self._marks[2:])
        self.beside[label][0] += wall
        self.beside[label][1] += cpu

    def slowest(self, label: str, jobs: list[tuple[str, float]]) -> None:
        """Records the seconds of work beside the files by job (`tests.shared_gangs`)."""
        with self._marks_lock:
            summed = dict(self.slowest_jobs.get(label, []))
            for name, seconds in jobs:
                summed[name] = summed.get(name, 0.0) + seconds
            self.slowest_jobs[label] = sorted(summed.items(), key=lambda job: -job[1])

    def rows(self) -> list[dict]:
        wall = {file: seconds - self.moved[file] for file, seconds in self.wall.items()}
        total = sum(wall.values()) or 1.0
        return [{"file": file, "wall_s": round(seconds, 1), "share": round(seconds / total, 4),
                 "cases": self.cases[file], "processes": self.processes[file],
                 "child_cpu_s": round(self.cpu[file], 1), "pytest_cpu_s": round(self.own_cpu[file], 1),
                 "busy": round(_busy(*self.jiffies[file]), 3) if file in self.jiffies else None}
                for file, seconds in sorted(wall.items(), key=lambda item: -item[1])]

    def table(self) -> str:
        rows = self.rows()
        lines = ["suite budget (per test file; procs = descendants of pytest seen alive; child CPU = their "
                 "user+system seconds; pytest CPU = the pytest process's own; busy = share of the machine's "
                 "cores in use meanwhile, anyone's):",
                 f"{'file':<40} {'wall s':>7} {'share':>6} {'cases':>5} {'procs':>5} {'child CPU s':>11} "
                 f"{'pytest CPU s':>12} {'busy':>5}"]
        for row in rows:
            busy = "" if row["busy"] is None else f"{row['busy']:.0%}"
            lines.append(f"{row['file'].removeprefix('tests/'):<40} {row['wall_s']:>7.1f} {row['share']:>6.1%} "
                         f"{row['cases']:>5} {row['processes']:>5} {row['child_cpu_s']:>11.1f} "
                         f"{row['pytest_cpu_s']:>12.1f} {busy:>5}")
        session_busy = [now - then for now, then in zip(_machine_jiffies(), self.started_jiffies)]
        lines.append(f"{'total':<40} {sum(r['wall_s'] for r in rows):>7.1f} {'100%':>6} "
                     f"{sum(r['cases'] for r in rows):>5} {sum(r['processes'] for r in rows):>5} "
                     f"{sum(r['child_cpu_s'] for r in rows):>11.1f} {sum(r['pytest_cpu_s'] for r in rows):>12.1f} "
                     f"{_busy(*session_busy):>5.0%}")
        for label, (wall, cpu) in sorted(self.beside.items()):
            processes = len(self.sampler.labelled.get(label, ())) if self.sampler else 0
            lines.append(f"beside the files: {label}: {wall:.0f} s wall, {processes} processes, {cpu:.0f} CPU s")
            jobs = self.slowest_jobs.get(label, [])
            if jobs:
                lines.append("  slowest jobs (s, summed over runners): "
                             + ", ".join(f"{name} {seconds:.0f}" for name, seconds in jobs[:SLOWEST_SHOWN]))
        lines.append(f"test workers: {preloaded.summary()}")
        lines.append(f"pytest wall from session start: {time.monotonic() - self.started:.0f} s")
        return "\n".join(lines)

    def pytest_sessionfinish(self, session) -> None:
        self._close_file()
        if self.sampler:
            self.sampler.stopping.set()
        if not self.wall:
            return
        OUTPUT.parent.mkdir(exist_ok=True)
        OUTPUT.with_suffix(".txt").write_text(self.table() + "\n")
        OUTPUT.with_suffix(".json").write_text(json.dumps(self.rows(), indent=1) + "\n")
        # Which import-time environments the test workers were forked from (tests/preloaded.py).
        OUTPUT.with_name("suite-preloaded.json").write_text(json.dumps(preloaded.details(), indent=1) + "\n")

    def pytest_unconfigure(self, config) -> None:
        if SuiteBudget.current is self:
            SuiteBudget.current = None

    def pytest_terminal_summary(self, terminalreporter) -> None:
        self._close_file()
        if self.wall:
            terminalreporter.write_sep("=", "suite budget")
            terminalreporter.write_line(self.table())


@contextlib.contextmanager
def charged_to(label: str) -> Iterator[None]:
    """Counts the block's wall seconds under `label` instead of the test file running it (a test
    waiting for work beside the files: `tests.shared_gangs`)."""
    started = time.monotonic()
    try:
        yield
    finally:
        if SuiteBudget.current is not None:
            SuiteBudget.current.charge(label, time.monotonic() - started)
