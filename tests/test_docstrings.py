"""Every runnable example in the package's docstrings stays true, on the backend it needs.

Modules are found by walking the package, so a new module's examples run without editing this
file. A backend subpackage's modules run in a process of that backend (`KERAS_BACKEND` is read
once per process); every other module runs in one process of its own
(`tests/backend_processes.py`, whose processes also serve `tests/test_keras_api.py`). Scripts
that act at import (`__main__`, the demo) are left out.
"""

from __future__ import annotations

import pytest

from tests.backend_processes import BACKENDS, MODULES, group_of, report_for


def test_every_module_is_found():
    assert "keras_mwms.startup.cluster" in MODULES and "keras_mwms.backends.policy" in MODULES
    assert {group_of(module) for module in MODULES} == {"neutral", *BACKENDS}


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    result = report_for(group_of(module))["doctests"][module]
    assert result["failed"] == 0, result["output"]
