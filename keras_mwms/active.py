"""What a strategy changes in this process, in one place: the active strategy and its backend,
the patches and services it started, and keras_mwms' process-wide state.

A strategy's life is one `Session`. The facade begins it when it is created (`begin`), makes
every change through it — each patch table installed (`Session.install`), each service
started (`Session.start`), in one order — and `close()` ends it (`end`): every change undone
in reverse order, then every piece of process-wide state reset to what it was at import. A
strategy created while another is still open ends that one's session first, so two strategies
never patch Keras twice.

State that must live at module level (read on every step, or by code that runs without a
strategy) registers here when its module is imported (`register`): how to reset it and how
to read what it holds, so the reset is whole and a test can see that it was
(`changed_state`). Backend adapters and callbacks ask here who is active instead of importing
the facade, so nothing below the facade imports it back.

Example:

>>> strategy, backend = object(), object()
>>> session = begin(strategy, backend)
>>> active_strategy() is strategy, active_backend() is backend, session is current_session()
(True, True, True)
>>> end(object()); active_strategy() is strategy      # only the active one ends
True
>>> end(strategy); active_strategy(), active_backend(), changed_state()
(None, None, [])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class _Registered(NamedTuple):
    reset: Callable[[], None]
    state: Callable[[], Any]
    pristine: Any


_REGISTRY: dict[str, _Registered] = {}


def register(module: str, name: str, reset: Callable[[], None], state: Callable[[], Any]) -> None:
    """Registers the process-wide state `module.name`, reset whole by every strategy's `close()`.

    `reset()` puts it back as it was at import; `state()` returns what it holds now as plain,
    comparable data (its value at registration is the pristine one). Call it at import, next
    to the state: `tests/test_architecture.py` fails on module-level state that neither
    registers here nor says why it lives as long as the process.

    Example:

    >>> counts = {}
    >>> register(__name__, "counts", counts.clear, lambda: dict(counts))
    >>> counts["steps"] = 3; changed_state()
    ['keras_mwms.active.counts']
    >>> reset_state(); changed_state()
    []
    >>> del _REGISTRY["keras_mwms.active.counts"]
    """
    _REGISTRY[f"{module}.{name}"] = _Registered(reset, state, state())


def reset_state() -> None:
    """Resets every registered piece of state (in registration order)."""
    for registered in _REGISTRY.values():
        registered.reset()


def changed_state() -> list[str]:
    """The registered state that is not as it was at import (`module.name`), sorted."""
    return sorted(name for name, registered in _REGISTRY.items()
                  if registered.state() != registered.pristine)


def registered_state() -> list[str]:
    """Every registered piece of state, `module.name`, sorted."""
    return sorted(_REGISTRY)


class Session:
    """One strategy's life in this process: what it made active, installed and started.

    Example:

    >>> import types
    >>> holder = types.SimpleNamespace(log=[])
    >>> session = Session(strategy=None, backend=None)
    >>> session.start(lambda: holder.log.append("start"), lambda: holder.log.append("stop"))
    >>> session.start(lambda: holder.log.append("up"), lambda: holder.log.append("down"))
    >>> session.undo(); holder.log
    ['start', 'up', 'down', 'stop']
    """

    def __init__(self, strategy: Any, backend: Any):
        self.strategy = strategy
        self.backend = backend
        self.tables: list[Any] = []
        self._undo: list[Callable[[], Any]] = []

    def install(self, table: Any) -> None:
        """Installs a `keras_mwms.backends.patches.PatchTable` now; the session's end uninstalls it."""
        table.install()
        self.tables.append(table)
        self._undo.append(table.uninstall)

    def start(self, begin: Callable[[], Any], stop: Callable[[], Any]) -> None:
        """Runs `begin()` now; the session's end runs `stop()`."""
        begin()
        self._undo.append(stop)

    def undo(self) -> None:
        """Undoes every change, the last made first; each is undone even if an earlier one fails."""
        failures = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as error:   # the rest must still be undone
                failures.append(error)
        self.tables.clear()
        if failures:
            raise failures[0]


_session: Session | None = None


def begin(strategy: Any, backend: Any, setup: Callable[[Session], None] = lambda session: None) -> Session:
    """Ends any open session, makes `strategy` and `backend` the active ones and runs `setup(session)`.

    If `setup` raises, what it installed or started is undone, the state reset and nothing is
    left active: a strategy that failed to start leaves the process as it found it.
    """
    global _session
    if _session is not None:
        end(_session.strategy)
    _session = Session(strategy, backend)
    try:
        setup(_session)
    except BaseException:
        end(strategy)
        raise
    return _session


def end(strategy: Any) -> None:
    """Ends `strategy`'s session if it is the active one (a newer strategy's stays): forgets
    it, undoes its changes in reverse and resets every registered piece of state."""
    global _session
    session = _session
    if session is None or session.strategy is not strategy:
        return
    _session = None
    try:
        session.undo()
    finally:
        reset_state()


def current_session() -> Session | None:
    """The open session, or None."""
    return _session


def active_strategy() -> Any:
    """The most recently created, not yet closed `MultiWorkerMirroredStrategy`, or None."""
    return _session.strategy if _session is not None else None


def active_backend() -> Any:
    """The backend adapter of the active strategy, or None."""
    return _session.backend if _session is not None else None
