"""The Keras firewall (`keras_mwms/backends/keras_api/`) holds on the installed Keras, per backend.

Every accessor of `attributes` and `optimizer_attributes` is called on small real Keras objects
(a model fitted two steps with gradient accumulation, optimizers, data adapters, callbacks) in
a process of each backend that uses it, and every private name the backend needs resolves
(`usability.missing_names`). The processes are the docstring examples' (`tests/backend_processes.py`),
so these tests start none of their own in a full run. Run them on another Keras by putting its
overlay first on `PYTHONPATH`.
"""

from __future__ import annotations

import pytest

from tests.backend_processes import BACKENDS, report_for


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_accessor_resolves_on_real_objects(backend):
    report = report_for(backend)["accessors"]
    failed = {name: result for name, result in report["checked"].items() if result != "ok"}
    assert failed == {}, f"Keras {report['keras']} on {backend}:\n" + "\n".join(
        f"{name}: {result}" for name, result in failed.items())
    declared_here = {name for name, backends in report["declared"].items() if backend in backends}
    assert set(report["checked"]) == declared_here


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_private_name_the_backend_needs_exists(backend):
    report = report_for(backend)["accessors"]
    assert report["missing_names"] == [], f"Keras {report['keras']} on {backend}"


def test_every_accessor_is_checked():
    """A new accessor needs a check in `tests/workers/keras_api_accessors.py`."""
    report = report_for("torch")["accessors"]
    assert sorted(report["declared"]) == report["accessors"]
