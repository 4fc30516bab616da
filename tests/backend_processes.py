"""One process per Keras backend per test session, shared by the tests that need a backend's own process.

`KERAS_BACKEND` is read once per process, so a test about every backend needs one process of
each. Starting one costs an import of Keras and the backend (seconds, more under load), so one
process per group serves every such test (all four start at once, at the first use): it runs
the docstring examples of the group's modules
(`tests/test_docstrings.py`) and, in a backend's process, resolves every accessor of the Keras
firewall on real objects (`tests/test_keras_api.py`, `tests/workers/keras_api_accessors.py`).
The group "neutral" (modules of no backend) runs on JAX without the accessor checks.

The processes inherit `PYTHONPATH` after the repository, so a Keras overlay put first
(`PYTHONPATH=build/keras-overlays/keras-nightly-… pytest tests/test_keras_api.py`) is the Keras
they run.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "tests" / "workers" / "doctests.py"
BACKENDS = ("tensorflow", "jax", "torch")
NOT_IMPORTABLE_AS_LIBRARY = {"keras_mwms.demo", "keras_mwms.benchmark.__main__"}


def package_modules() -> list[str]:
    """Every module of the package, found on disk (importing would load the backends here)."""
    names = []
    for path in (REPO / "keras_mwms").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(name for name in names if name not in NOT_IMPORTABLE_AS_LIBRARY)


def group_of(module: str) -> str:
    """The backend a module's examples need: its backend subpackage's, else "neutral"."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "backends" and parts[2] in BACKENDS:
        return parts[2]
    return "neutral"


MODULES = package_modules()
GROUPS = ("neutral", *BACKENDS)
TIMEOUT = 600
_reports: dict[str, dict] = {}
_started: dict[str, tuple[subprocess.Popen, tempfile.TemporaryFile]] = {}


def _line(output: str, prefix: str) -> dict | None:
    line = next((line for line in output.splitlines() if line.startswith(prefix)), None)
    return None if line is None else json.loads(line[len(prefix):])


def _start(group: str) -> None:
    modules = [module for module in MODULES if group_of(module) == group]
    backend = group if group != "neutral" else "jax"
    flags = ["--keras-api-accessors"] if group in BACKENDS else []
    inherited = os.environ.get("PYTHONPATH")
    output = tempfile.TemporaryFile()   # a file, not a pipe: the four processes run at once
    process = subprocess.Popen([sys.executable, str(RUNNER), *flags, *modules], cwd=REPO, stdout=output,
                               stderr=subprocess.STDOUT,
                               env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3",
                                    "PYTHONPATH": os.pathsep.join([str(REPO), *([inherited] if inherited else [])])})
    _started[group] = (process, output)


@atexit.register
def _stop_unread() -> None:
    """Processes no selected test read (e.g. only tests/test_keras_api.py ran) die with the session."""
    for process, _ in _started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


def report_for(group: str) -> dict:
    """`{"doctests": {module: result}, "accessors": report or None}` of the group's process.

    The first call starts every group's process at once (each runs one interpreter: on 2 cores two
    finish in the time of one), so each runs once per test session."""
    if group not in _reports:
        if not _started:
            for each in GROUPS:
                _start(each)
        process, output = _started[group]
        try:
            process.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        output.seek(0)
        text = output.read().decode(errors="replace")
        doctests = _line(text, "DOCTESTS ")
        assert doctests is not None, f"exit code {process.returncode}:\n{text[-6000:]}"
        accessors = _line(text, "ACCESSORS ")
        assert accessors is not None or group not in BACKENDS, text[-6000:]
        _reports[group] = {"doctests": doctests, "accessors": accessors}
    return _reports[group]
