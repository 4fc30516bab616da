"""Suite-wide pytest set-up: the per-file time table (`tests/suite_budget.py`) and the warm
gangs the modules share (`tests/shared_gangs.py`)."""

import pytest

from tests.shared_gangs import SHARED, SharedRuns
from tests.suite_budget import SuiteBudget


def pytest_configure(config):
    if not (config.pluginmanager.has_plugin("suite_budget") or config.pluginmanager.is_blocked("suite_budget")):
        config.pluginmanager.register(SuiteBudget(), "suite_budget")


@pytest.fixture(scope="session")
def shared_runs(request, tmp_path_factory) -> SharedRuns:
    """The registry of shared jobs (`tests.shared_gangs.SHARED`), bound to this session."""
    return SHARED.bind(request.session, tmp_path_factory)
