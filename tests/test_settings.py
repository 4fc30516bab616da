"""`keras_mwms.settings`: every KERAS_MWMS_* variable typed, with Keras' precedence, and documented.

Pure rules: no backend, no processes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from keras_mwms import settings
from keras_mwms.communication import FILLED_FROM_ENVIRONMENT, CommunicationOptions
from keras_mwms.errors import ClusterEnvironmentError, EnvironmentVariableError

MESSAGES_PAGE = Path(__file__).resolve().parent.parent / "docs" / "messages.md"

# (field, an explicit argument, what the environment says, what it reads as, the default)
PRECEDENCE = [
    ("jax_path", "dataparallel", "flat", "flat", "auto"),
    ("torch_overlap", True, "0", False, True),
    ("torch_fused_adam", False, "1", True, False),
    ("hang_report_seconds", 30.0, "5", 5.0, 60.0),
    ("compression", "bf16", "fp16", "fp16", None),
    ("batch_norm_statistics", "global", "per_worker", "per_worker", "global"),
    ("rendezvous_timeout_seconds", 40.0, "300", 300.0, 120.0),
]


@pytest.mark.parametrize("field, argument, text, from_environment, default", PRECEDENCE,
                         ids=[case[0] for case in PRECEDENCE])
def test_an_argument_wins_the_environment_fills_none_then_the_default(monkeypatch, field, argument, text,
                                                                       from_environment, default):
    variable = FILLED_FROM_ENVIRONMENT[field].name
    monkeypatch.delenv(variable, raising=False)
    assert getattr(CommunicationOptions(), field) == default
    monkeypatch.setenv(variable, text)
    assert getattr(CommunicationOptions(), field) == from_environment
    assert getattr(CommunicationOptions(**{field: argument}), field) == argument


def test_every_filled_field_is_covered_and_names_its_variable():
    assert {case[0] for case in PRECEDENCE} == set(FILLED_FROM_ENVIRONMENT)
    for field, setting in FILLED_FROM_ENVIRONMENT.items():
        assert setting.fills == f"CommunicationOptions({field}=)"


def test_zero_turns_hang_reports_off_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.setenv(settings.HANG_REPORT_SECONDS.name, "0")
    assert CommunicationOptions().hang_report_seconds == 0
    monkeypatch.delenv(settings.HANG_REPORT_SECONDS.name)
    assert CommunicationOptions(hang_report_seconds=0).hang_report_seconds == 0
    with pytest.raises(ValueError, match="hang_report_seconds must be a positive number of seconds or 0"):
        CommunicationOptions(hang_report_seconds=-1)


@pytest.mark.parametrize("setting, text, problem", [
    (settings.TORCH_OVERLAP, "maybe", "is not a switch"),
    (settings.ATTEMPT, "first", "is not an integer"),
    (settings.ATTEMPT, "-1", "is below 0"),
    (settings.LAUNCH_PORT_BASE, "70000", "is outside 1..65535"),
    (settings.HANG_REPORT_SECONDS, "soon", "is not a number of seconds"),
    (settings.RENDEZVOUS_TIMEOUT, "0", "is not a positive number of seconds"),
    (settings.JAX_PATH, "fast", "is not one of 'auto', 'flat', 'dataparallel'"),
], ids=lambda case: case.name if isinstance(case, settings.Setting) else None)
def test_a_value_that_cannot_be_read_names_the_variable_the_value_and_the_fix(setting, text, problem):
    with pytest.raises(EnvironmentVariableError) as caught:
        setting.read({setting.name: text})
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert message.startswith(f"{setting.name}={text!r} {problem}: "), message
    assert len(message.partition(": ")[2]) > 10, message


def test_cluster_variables_raise_the_cluster_environment_error():
    for setting in (settings.CLUSTER_SOURCE, settings.PORT_BASE):
        with pytest.raises(ClusterEnvironmentError):
            setting.read({setting.name: "x"})


def test_unset_or_blank_reads_the_default_and_switches_read_every_spelling():
    assert settings.LEDGER.read({}) is True and settings.LEDGER.read({"KERAS_MWMS_LEDGER": " "}) is True
    assert [settings.REPORT.read({"KERAS_MWMS_REPORT": text}) for text in ("1", "On", "yes", "0", "FALSE", "no")] == [
        True, True, True, False, False, False]
    assert settings.BATCH_NORM_STATISTICS.read({"KERAS_MWMS_BATCH_NORM_STATISTICS": "Per-Worker"}) == "per_worker"


def test_every_setting_is_a_keras_mwms_variable_registered_once():
    assert len(settings.SETTINGS) >= 20
    for name, setting in settings.SETTINGS.items():
        assert name == setting.name and re.fullmatch(r"KERAS_MWMS_[A-Z0-9_]+", name), name
        assert setting.meaning.endswith("."), name
    with pytest.raises(ValueError, match="registered twice"):
        settings.register(settings.Setting("KERAS_MWMS_LEDGER", settings.SWITCH, True, "again."))


def test_the_docs_table_is_generated_from_the_registry():
    """docs/messages.md holds no copy of the table of variables, only the marker the site's
    build fills with `markdown_table()` (docs/hooks.py; tests/test_docs_site.py checks the built
    page lists every variable), so the table cannot drift from the registry."""
    text = MESSAGES_PAGE.read_text()
    assert text.count("<!-- settings-table -->") == 1, "docs/messages.md must hold the table's marker once"
    assert "| `KERAS_MWMS_" not in text, "docs/messages.md pastes the table: keep only its marker"
