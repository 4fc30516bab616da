"""Suite-wide pytest set-up: the per-file time table (`tests/suite_budget.py`) and the warm
gangs the modules share (`tests/shared_gangs.py`): started in the background at the session's
first test, their modules' tests moved to the end of the session so the results are ready."""

import pytest

from tests.shared_gangs import SHARED, SharedRuns
from tests.suite_budget import SuiteBudget


def pytest_configure(config):
    if not (config.pluginmanager.has_plugin("suite_budget") or config.pluginmanager.is_blocked("suite_budget")):
        config.pluginmanager.register(SuiteBudget(), "suite_budget")


def pytest_collection_modifyitems(session, config, items):
    """The modules with shared jobs last, each in its own order: their gangs run meanwhile."""
    shared = SHARED.modules()

    def has_jobs(item) -> bool:
        return getattr(getattr(item, "module", None), "__name__", None) in shared

    items[:] = [item for item in items if not has_jobs(item)] + [item for item in items if has_jobs(item)]


@pytest.fixture(scope="session", autouse=True)
def shared_runs(request, tmp_path_factory) -> SharedRuns:
    """The registry of shared jobs (`tests.shared_gangs.SHARED`), its runners started in the
    background for this session's selected modules; stopped (whatever still runs, killed) at
    the session's end."""
    SHARED.start(request.session, tmp_path_factory)
    yield SHARED
    SHARED.stop()
