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


TORCH_MODULES = ["keras_mwms.backends.torch_overlap", "keras_mwms.backends.torch_fused_adam"]


@pytest.mark.parametrize("name", TORCH_MODULES)
def test_torch_docstring_examples(name):
    """Modules that need Keras on torch run in their own process (KERAS_BACKEND is read once)."""
    import os
    import subprocess
    import sys

    code = ("import doctest, importlib, sys\n"
            f"result = doctest.testmod(importlib.import_module({name!r}), "
            "optionflags=doctest.ELLIPSIS)\n"
            "sys.exit(1 if result.failed or not result.attempted else 0)\n")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=300, env={**os.environ, "KERAS_BACKEND": "torch"})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
