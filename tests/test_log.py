"""keras_mwms' messages (keras_mwms/log.py): shown by default, silenced and redirected as any library's.

In-process, with the root logger's handlers (pytest's own) set aside where a test needs "the user
configured nothing". A real gang silenced by the level: tests/test_user_scripts.py
(`test_a_user_silences_keras_mwms_with_the_logging_level`).
"""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import pytest

from keras_mwms import log

TWO_WORKERS = SimpleNamespace(worker_index=1, num_workers=2)


def set_root_handlers(monkeypatch, handlers: list) -> None:
    """Called in the test itself: pytest adds its own handlers to the root logger after fixtures."""
    monkeypatch.setattr(logging.getLogger(), "handlers", handlers)


@pytest.fixture
def unconfigured():
    """The "keras_mwms" logger at its default level, restored after the test."""
    package = logging.getLogger(log.LOGGER_NAME)
    level = package.level
    package.setLevel(logging.INFO)
    yield package
    package.setLevel(level)


def test_messages_show_on_stderr_labelled_by_worker_by_default(unconfigured, monkeypatch, capsys):
    set_root_handlers(monkeypatch, [])
    log.get_logger("keras_mwms.test_log").info("keras_mwms: hello", worker=TWO_WORKERS)
    log.get_logger("keras_mwms.test_log").info("keras_mwms: one worker")   # no active strategy: no label
    assert capsys.readouterr().err == "[worker 1] keras_mwms: hello\nkeras_mwms: one worker\n"


def test_the_level_silences_them(unconfigured, monkeypatch, capsys):
    set_root_handlers(monkeypatch, [])
    unconfigured.setLevel(logging.ERROR)
    logger = log.get_logger("keras_mwms.test_log")
    logger.info("an info")
    logger.warning("a warning")
    logger.error("an error")
    assert capsys.readouterr().err == "an error\n"


def test_a_handler_of_the_users_redirects_them_and_stderr_stays_quiet(unconfigured, monkeypatch, capsys):
    set_root_handlers(monkeypatch, [])
    redirected = io.StringIO()
    handler = logging.StreamHandler(redirected)
    unconfigured.addHandler(handler)
    try:
        log.get_logger("keras_mwms.test_log").info("keras_mwms: redirected", worker=TWO_WORKERS)
    finally:
        unconfigured.removeHandler(handler)
    assert redirected.getvalue() == "[worker 1] keras_mwms: redirected\n"
    assert capsys.readouterr().err == ""


def test_configured_logging_shows_them_once_in_the_users_format(unconfigured, monkeypatch, capsys):
    shown = io.StringIO()
    handler = logging.StreamHandler(shown)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    set_root_handlers(monkeypatch, [handler])   # as logging.basicConfig() does
    log.get_logger("keras_mwms.test_log").info("keras_mwms: configured")
    assert shown.getvalue() == "INFO keras_mwms.test_log: keras_mwms: configured\n"
    assert capsys.readouterr().err == ""


def test_a_level_set_before_importing_keras_mwms_wins(unconfigured):
    unconfigured.setLevel(logging.ERROR)
    handlers = list(unconfigured.handlers)
    log._install_defaults()   # what importing keras_mwms does
    assert unconfigured.level == logging.ERROR and unconfigured.handlers == handlers
