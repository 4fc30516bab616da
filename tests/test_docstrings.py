"""The runnable examples in the pure-Python modules' docstrings stay true."""

import doctest
import importlib

import pytest

MODULES = ["keras_mwms.cluster", "keras_mwms.rendezvous", "keras_mwms.data",
           "keras_mwms.communication", "keras_mwms.launch", "keras_mwms.backends",
           "keras_mwms.io", "keras_mwms.backup_files"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
