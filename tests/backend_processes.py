"""One process per Keras backend per test session, shared by the tests that need a backend's own process.

`KERAS_BACKEND` is read once per process, so a test about every backend needs one process of
each. Starting one costs an import of Keras and the backend (seconds, more under load), so one
process per group serves every such test: it runs the docstring examples of the group's modules
(`tests/test_docstrings.py`) and, in a backend's process, resolves every accessor of the Keras
firewall on real objects (`tests/test_keras_api.py`, `tests/workers/keras_api_accessors.py`).
The group "neutral" (modules of no backend) runs on JAX without the accessor checks.

The processes inherit `PYTHONPATH` after the repository, so a Keras overlay put first
(`PYTHONPATH=build/keras-overlays/keras-nightly-… pytest tests/test_keras_api.py`) is the Keras
they run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
_reports: dict[str, dict] = {}


def _line(output: str, prefix: str) -> dict | None:
    line = next((line for line in output.splitlines() if line.startswith(prefix)), None)
    return None if line is None else json.loads(line[len(prefix):])


def report_for(group: str) -> dict:
    """`{"doctests": {module: result}, "accessors": report or None}` of the group's process,
    run once per test session."""
    if group not in _reports:
        modules = [module for module in MODULES if group_of(module) == group]
        backend = group if group != "neutral" else "jax"
        flags = ["--keras-api-accessors"] if group in BACKENDS else []
        inherited = os.environ.get("PYTHONPATH")
        completed = subprocess.run([sys.executable, str(RUNNER), *flags, *modules], cwd=REPO, capture_output=True,
                                   text=True, timeout=600,
                                   env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3",
                                        "PYTHONPATH": os.pathsep.join([str(REPO), *([inherited] if inherited else [])])})
        doctests = _line(completed.stdout, "DOCTESTS ")
        assert doctests is not None, completed.stdout[-3000:] + completed.stderr[-3000:]
        accessors = _line(completed.stdout, "ACCESSORS ")
        assert accessors is not None or not flags, completed.stdout[-3000:] + completed.stderr[-3000:]
        _reports[group] = {"doctests": doctests, "accessors": accessors}
    return _reports[group]
