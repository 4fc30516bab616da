"""Lists the patch rows the installed Keras breaks, for one backend (`KERAS_BACKEND`).

`scripts/version_smoke.py` runs it when a release fails: one line `ROW <problem>` per row
whose target is gone or lacks a parameter the replacement relies on (`PatchTable.check()`),
then `ROWS <count>`. Nothing is installed, so the override is not needed.
"""

import importlib
import os
import types

import common  # noqa: F401  (puts the repository first on sys.path)
import keras  # noqa: E402

from keras_mwms.backends import resume  # noqa: E402

backend = os.environ["KERAS_BACKEND"]
stand_in = types.SimpleNamespace(strategy=object(), row_weighting=None)   # the table's backend
if backend == "tensorflow":
    from keras_mwms.backends.tensorflow.step import RowWeighting

    stand_in.row_weighting = RowWeighting(None)
table = importlib.import_module(f"keras_mwms.backends.{backend}.patches").patch_table(stand_in)

problems = [problem for each in (table, resume.PATCHES) for problem in each.check()
            if "instance." not in problem]   # (the stand-in strategy of the TensorFlow table)
for problem in problems:
    print("ROW", problem)
print("ROWS", len(problems), "on Keras", keras.__version__, flush=True)
