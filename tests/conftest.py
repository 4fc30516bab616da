"""Suite-wide pytest set-up: the per-file time table (`tests/suite_budget.py`)."""

from tests.suite_budget import SuiteBudget


def pytest_configure(config):
    if not (config.pluginmanager.has_plugin("suite_budget") or config.pluginmanager.is_blocked("suite_budget")):
        config.pluginmanager.register(SuiteBudget(), "suite_budget")
