"""Processes forked by a worker get SIGTERM's default action back, so they can be stopped.

JAX's and TensorFlow's distributed runtimes catch SIGTERM in C++ (to announce a preemption to
the coordination service). A child forked from the worker — the pool of a
`keras.utils.PyDataset(workers=2, use_multiprocessing=True)`, a torch `DataLoader`'s workers, a
user's `multiprocessing.Pool` — inherits that handler but not the runtime's threads, so it
ignores SIGTERM: `Pool.terminate()` then waits for it forever, and the worker never exits after
its script ends (the launcher's SIGTERM does not end the children either; its SIGKILL of the
worker leaves them orphaned). Once a strategy was created in the process, each forked child
whose SIGTERM handler was not installed from Python gets the default action back (Python does
not see a handler installed by C code: `signal.getsignal` still says `SIG_DFL`); a handler the
user installed in Python, or `SIG_IGN`, is left as it is.

Example (a process that never forked a worker has nothing to undo):

>>> install()
>>> install()   # once per process
>>> import signal
>>> signal.getsignal(signal.SIGTERM) is not None
True
"""

from __future__ import annotations

import os
import signal

_installed = False


def install() -> None:
    """Registers the after-fork hook, once per process."""
    global _installed
    if not _installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_default_sigterm_in_child)
        _installed = True


def _default_sigterm_in_child() -> None:
    try:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):   # C code's, if any: JAX's, TF's
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):   # not the main thread (cannot happen right after fork)
        pass
