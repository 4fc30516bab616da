"""Leaves out Keras' optional integrations in a test worker: start-up without their imports.

Keras imports matplotlib (its image gallery), scikit-learn (its wrappers), pandas (its array
slicing) and orbax (its checkpoint callback) at `import keras` whenever they are installed, and
`make install` installs them (the demo, the guides and the benchmark use them). They cost a
worker about 1.3 of its 3.5–4.7 CPU seconds of start-up here, and the fault, restart and
launcher tests start hundreds of workers that never touch them. A test puts this folder on a
worker's PYTHONPATH (`tests.multiworker.worker_env(..., lean=True)`), and Python imports this
module at start-up: those packages then look absent, as on a machine without them, and Keras
goes on without them (it imports each inside `try/except ImportError`). Tests of what a user
sees or imports (the guides, the README, first-run output, the shared equivalence gangs, Ray,
the version smoke) keep the full environment.
"""

import importlib.abc
import importlib.machinery
import os
import sys

LEFT_OUT = ("matplotlib", "sklearn", "pandas", "orbax")
# Keras imports JAX on every backend (its Orbax callback checks a JAX attribute at import):
# another 0.5 CPU s of a TensorFlow or torch worker's start-up.
if os.environ.get("KERAS_BACKEND", "tensorflow") != "jax":
    LEFT_OUT += ("jax", "jaxlib")


class _Absent(importlib.abc.Loader):
    """Fails the import as a missing package does; `importlib.util.find_spec` still answers."""

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (left out of this test worker: "
                                  "tests/lean_imports/sitecustomize.py)", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("create_module always raises")


class _LeaveOut(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in LEFT_OUT:
            return importlib.machinery.ModuleSpec(name, _Absent())
        return None


sys.meta_path.insert(0, _LeaveOut())
