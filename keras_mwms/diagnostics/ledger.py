"""The collective ledger: what this worker is doing, counted, in a small ring buffer.

Every worker keeps one `Ledger` (`LEDGER`). The backends tell it, at the Python level, when a
train step starts and ends (`train_step`), when a collective is entered and left
(`collective`: the port's all-reduces and broadcasts, torch's gradient buckets, JAX's flat
gradient all-reduce), and the data hook tells it when the input pipeline is making a batch
(`data`). Each collective gets the next **sequence number**; the last `capacity` entries
are kept as `Entry` tuples (sequence number, kind, bytes, train step, phase, start, seconds).
Because every worker issues the same collectives in the same order, equal sequence numbers
are the same collective on every worker: a worker behind shows a smaller number, a worker
that issued something extra (one more `train_on_batch`) a larger one — the hang report
(`keras_mwms.diagnostics.verdict`) reads exactly that.

Granularity: a collective that runs inside a compiled graph (TensorFlow's `tf.function`,
JAX's DataParallel jit) cannot be seen one op at a time from Python, so there the whole step
call is one entry of kind `"train step (in-graph collectives)"`; it still counts one per
step on every worker, so sequence numbers stay comparable.

Time accounting for the straggler table: `totals` holds seconds spent waiting for data
(`data`: making batches, on whichever thread), inside collectives (`collective`) and in the
rest of the step (`compute`: the step's wall time minus its collective and main-thread data
time; a step whose collectives run inside one compiled graph is all `collective`, and
counted in `in_graph_steps`). The cost per step is a few `time.monotonic()` calls and one tuple appended to a deque
(see `python -m keras_mwms.benchmark --no-ledger`); `KERAS_MWMS_LEDGER=0` turns it all off.

Example:

>>> ledger = Ledger(capacity=4)
>>> with ledger.train_step():
...     with ledger.collective("gradient all-reduce", 1024):
...         pass
>>> entry = ledger.last_entries()[-1]
>>> entry.sequence, entry.kind, entry.nbytes, entry.step, entry.phase
(1, 'gradient all-reduce', 1024, 1, 'all-reduce')
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import NamedTuple

from keras_mwms import active, settings

LEDGER_ENV = settings.LEDGER.name
PHASES = ("idle", "data", "forward-backward", "all-reduce", "apply", "callback")


class Entry(NamedTuple):
    """One collective (or in-graph step) as the ledger saw it; `seconds` is None while inside it."""

    sequence: int
    kind: str
    nbytes: int
    step: int
    phase: str
    started: float
    seconds: float | None


def enabled_by_environment() -> bool:
    """False when `KERAS_MWMS_LEDGER` is 0/false/off (the benchmark's `--no-ledger`).

    Example:

    >>> enabled_by_environment() in (True, False)
    True
    """
    return settings.LEDGER.read()


class _Collective:
    """Context manager of one collective (a class, not a generator: cheaper per step)."""

    __slots__ = ("ledger", "kind", "nbytes", "started", "outermost")

    def __init__(self, ledger: Ledger, kind: str, nbytes: int):
        self.ledger, self.kind, self.nbytes = ledger, kind, nbytes

    def __enter__(self):
        ledger = self.ledger
        self.outermost = ledger.enabled and ledger._depth == 0
        ledger._depth += 1
        if self.outermost:
            self.started = time.monotonic()
            ledger.sequence += 1
            phase = "all-reduce" if ledger.in_step else ledger.phase
            ledger.current = Entry(ledger.sequence, self.kind, int(self.nbytes), ledger.step, phase,
                                   self.started, None)
        return self

    def __exit__(self, *exc):
        ledger = self.ledger
        ledger._depth -= 1
        if self.outermost:
            seconds = time.monotonic() - self.started
            ledger.entries.append(ledger.current._replace(seconds=seconds))
            ledger.kinds[self.kind] += 1
            ledger.current = None
            ledger.totals["collective"] += seconds
            if ledger.in_step:
                ledger._step_excluded += seconds
                ledger.phase = "apply"
        return False


class _Step:
    """Context manager of one train step (the train function's call)."""

    __slots__ = ("ledger", "in_graph", "caller", "started", "collective")

    def __init__(self, ledger: Ledger, in_graph: bool, caller: int):
        self.ledger, self.in_graph, self.caller = ledger, in_graph, caller

    def __enter__(self):
        ledger = self.ledger
        if not ledger.enabled:
            return self
        ledger.step += 1
        ledger.call = sys._getframe(self.caller).f_code.co_name
        ledger.in_step = True
        ledger._step_excluded = 0.0
        ledger.phase = "forward-backward"
        self.started = time.monotonic()
        self.collective = None
        if self.in_graph:
            self.collective = _Collective(ledger, "train step (in-graph collectives)", 0)
            self.collective.__enter__()
        return self

    def __exit__(self, *exc):
        ledger = self.ledger
        if not ledger.enabled:
            return False
        if self.collective is not None:
            self.collective.__exit__(*exc)
        seconds = time.monotonic() - self.started
        ledger.totals["compute"] += max(0.0, seconds - ledger._step_excluded)
        ledger.totals["steps"] += 1
        ledger.totals["in_graph_steps"] += self.in_graph
        ledger.in_step = False
        ledger.phase = "callback"
        return False


class _Data:
    """Context manager of making one batch (any thread)."""

    __slots__ = ("ledger", "batch", "started", "main")

    def __init__(self, ledger: Ledger, batch: int):
        self.ledger, self.batch = ledger, batch

    def __enter__(self):
        ledger = self.ledger
        if ledger.enabled:
            self.started = time.monotonic()
            self.main = threading.get_ident() == ledger.main_thread
            ledger.data_batch, ledger.data_since, ledger.data_thread = self.batch, self.started, threading.get_ident()
            if self.main and not ledger.in_step:
                ledger.phase = "data"
        return self

    def __exit__(self, *exc):
        ledger = self.ledger
        if ledger.enabled:
            seconds = time.monotonic() - self.started
            ledger.totals["data"] += seconds
            ledger.data_since = None
            if self.main and ledger.in_step:
                ledger._step_excluded += seconds
        return False


class Ledger:
    """This worker's collective ledger (see the module docstring).

    Args:
        capacity: how many recent collectives are kept.
        enabled: False makes every hook a no-op (default: `KERAS_MWMS_LEDGER`, else on).
    """

    def __init__(self, capacity: int = 64, enabled: bool | None = None):
        self.enabled = enabled_by_environment() if enabled is None else enabled
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        """Forgets every count, entry and time (`enabled` stays): a new strategy starts at 0.

        Example:

        >>> ledger = Ledger()
        >>> with ledger.collective("barrier"):
        ...     pass
        >>> ledger.reset(); ledger.state() == Ledger().state()
        True
        """
        self.entries: collections.deque[Entry] = collections.deque(maxlen=self.capacity)
        self.sequence = 0
        self.step = 0
        self.phase = "idle"
        self.in_step = False
        self.current: Entry | None = None
        self.call = ""   # the Keras method running the current train step (fit, train_on_batch)
        self.open_calls = 0   # fit/evaluate loops begun and not ended (`diagnostics.open_calls`)
        self.data_batch: int | None = None
        self.data_since: float | None = None
        self.data_thread: int | None = None
        self.main_thread = threading.main_thread().ident
        self.totals = {"data": 0.0, "compute": 0.0, "collective": 0.0, "steps": 0, "in_graph_steps": 0}
        self.kinds: collections.Counter[str] = collections.Counter()   # collectives left, by kind
        self._depth = 0
        self._step_excluded = 0.0

    def state(self) -> tuple:
        """The counters, phase and entries as plain data (equal for two fresh ledgers)."""
        return (self.sequence, self.step, self.phase, self.in_step, self.current, self.call,
                self.open_calls, self.data_batch, self.data_since, self.data_thread,
                tuple(self.entries), dict(self.totals), dict(self.kinds), self._depth, self._step_excluded)

    def collective(self, kind: str, nbytes: int = 0) -> _Collective:
        """`with ledger.collective(kind, nbytes):` around one collective; nested ones count once."""
        return _Collective(self, kind, nbytes)

    def train_step(self, in_graph: bool = False, caller: int = 2) -> _Step:
        """`with ledger.train_step():` around one train-function call.

        `in_graph=True` where the step's collectives run inside a compiled graph: the call is
        then itself one ledger entry. `caller`: how many frames above the `with` statement's
        function the Keras method (`fit`, `train_on_batch`) runs; its name is recorded as `call`.
        """
        return _Step(self, in_graph, caller)

    def data(self, batch: int) -> _Data:
        """`with ledger.data(batch):` around making batch `batch` of the input pipeline."""
        return _Data(self, batch)

    def last_entries(self, count: int | None = None) -> list[Entry]:
        """The most recent entries, oldest first (the one in progress last), safe from any thread."""
        for _ in range(10):
            try:
                entries = list(self.entries)
                break
            except RuntimeError:   # appended to while copied (another thread)
                continue
        else:
            entries = []
        current = self.current
        if current is not None:
            entries.append(current)
        return entries[-count:] if count else entries

    def snapshot(self, now: float | None = None) -> dict:
        """What the hang report sends: counters, phase, the entry in progress, data in progress.

        Example:

        >>> Ledger().snapshot()["sequence"]
        0
        """
        now = time.monotonic() if now is None else now
        current, data_since = self.current, self.data_since
        return {
            "sequence": self.sequence, "step": self.step, "phase": self.phase, "call": self.call,
            "in_collective": None if current is None else
            {"sequence": current.sequence, "kind": current.kind, "nbytes": current.nbytes,
             "step": current.step, "seconds": round(now - current.started, 2)},
            "data": None if data_since is None else
            {"batch": self.data_batch, "seconds": round(now - data_since, 2),
             "main_thread": self.data_thread == self.main_thread},
            "entries": [[e.sequence, e.kind, e.nbytes, e.step, e.phase,
                         None if e.seconds is None else round(e.seconds, 4)]
                        for e in self.last_entries(12)],
            "totals": {key: round(value, 4) for key, value in self.totals.items()},
            "enabled": self.enabled,
        }


LEDGER = Ledger()
active.register(__name__, "LEDGER", reset=LEDGER.reset, state=LEDGER.state)


class _Counted:
    """A compiled train step counted as one in-graph ledger entry per call."""

    __slots__ = ("function", "ledger")

    def __init__(self, function, ledger: Ledger):
        self.function, self.ledger = function, ledger

    def __call__(self, *args, **kwargs):
        with self.ledger.train_step(in_graph=True):
            return self.function(*args, **kwargs)


def counted_in_graph(function, ledger: Ledger | None = None):
    """`function` (a compiled train step) counted as one in-graph ledger entry per call; idempotent.

    Example:

    >>> ledger = Ledger()
    >>> step = counted_in_graph(lambda: "logs", ledger)
    >>> step(), counted_in_graph(step, ledger) is step, ledger.last_entries()[0].kind
    ('logs', True, 'train step (in-graph collectives)')
    """
    if function is None or isinstance(function, _Counted):
        return function
    return _Counted(function, LEDGER if ledger is None else ledger)
