"""The one registry of this process's active strategy and its backend.

The facade registers itself when it is created and unregisters at `close()`; backend adapters
and callbacks ask here instead of importing the facade, so nothing below the facade imports
it back.

Example:

>>> strategy, backend = object(), object()
>>> activate(strategy, backend)
>>> active_strategy() is strategy, active_backend() is backend
(True, True)
>>> deactivate(object()); active_strategy() is strategy      # only the active one is forgotten
True
>>> deactivate(strategy); active_strategy(), active_backend()
(None, None)
"""

from __future__ import annotations

from typing import Any

_strategy: Any = None
_backend: Any = None


def activate(strategy: Any, backend: Any) -> None:
    """Makes `strategy` (and its `backend`) the active ones of this process."""
    global _strategy, _backend
    _strategy, _backend = strategy, backend


def deactivate(strategy: Any) -> None:
    """Forgets `strategy` if it is the active one (a newer strategy stays active)."""
    global _strategy, _backend
    if _strategy is strategy:
        _strategy = _backend = None


def active_strategy() -> Any:
    """The most recently created, not yet closed `MultiWorkerMirroredStrategy`, or None."""
    return _strategy


def active_backend() -> Any:
    """The backend adapter of the active strategy, or None."""
    return _backend
