"""A backend thread that calls `std::terminate` gets a hang report before the process aborts.

gloo checks that the peers' collectives match only when their bytes arrive, on its own
thread, and a mismatch (one worker ran one collective more: a desync) throws there, which
ends in `std::terminate` and SIGABRT within milliseconds ("Is there a distributed collective
mismatch in your code?"): the peers would report that worker as lost. `install` puts a
terminate handler in front of libstdc++'s: it asks the watchdog for a report round (this
worker's ledger still says which collective it is in), waits for the verdict, which ends the
process, and only if none comes calls the previous handler (the usual message and abort).

Example:

>>> install(lambda: None) in (True, False)   # False where libstdc++ is not loaded
True
>>> uninstall()
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

from keras_mwms import active

_HANDLER = ctypes.CFUNCTYPE(None)
_SET_TERMINATE = "_ZSt13set_terminatePFvvE"   # std::set_terminate(void (*)())
_installed: dict = {}


def _set_terminate():
    try:
        library = ctypes.CDLL("libstdc++.so.6")
        function = getattr(library, _SET_TERMINATE)
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_void_p]
    return function


def install(on_terminate: Callable[[], None]) -> bool:
    """Runs `on_terminate()` (then the previous handler) when any thread calls std::terminate."""
    set_terminate = _set_terminate()
    if set_terminate is None:
        return False
    uninstall()

    def handler():
        try:
            on_terminate()
        finally:
            previous = _installed.get("previous")
            if previous:
                _HANDLER(previous)()
            os.abort()

    callback = _HANDLER(handler)
    _installed.update(callback=callback, previous=set_terminate(ctypes.cast(callback, ctypes.c_void_p)))
    return True


def uninstall() -> None:
    """Puts the previous terminate handler back."""
    if "callback" in _installed:
        set_terminate = _set_terminate()
        if set_terminate is not None:
            set_terminate(_installed.get("previous"))
        _installed.clear()


active.register(__name__, "_installed", reset=uninstall, state=lambda: "callback" in _installed)
