"""Every runnable example in the package's docstrings stays true, on the backend it needs.

Modules are found by walking the package, so a new module's examples run without editing this
file. A backend subpackage's modules run in a process of that backend (`KERAS_BACKEND` is read
once per process); every other module runs in one process of its own. Scripts that act at
import (`__main__`, the demo) are left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def report_for(group: str) -> dict:
    """Runs one process per group, once per test session."""
    if group not in _reports:
        modules = [module for module in MODULES if group_of(module) == group]
        backend = group if group != "neutral" else "jax"
        completed = subprocess.run([sys.executable, str(RUNNER), *modules], cwd=REPO, capture_output=True,
                                   text=True, timeout=600,
                                   env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3",
                                        "PYTHONPATH": str(REPO)})
        line = next((line for line in completed.stdout.splitlines() if line.startswith("DOCTESTS ")), None)
        assert line is not None, completed.stdout[-3000:] + completed.stderr[-3000:]
        _reports[group] = json.loads(line[len("DOCTESTS "):])
    return _reports[group]


def test_every_module_is_found():
    assert "keras_mwms.startup.cluster" in MODULES and "keras_mwms.backends.policy" in MODULES
    assert {group_of(module) for module in MODULES} == {"neutral", *BACKENDS}


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    result = report_for(group_of(module))[module]
    assert result["failed"] == 0, result["output"]
