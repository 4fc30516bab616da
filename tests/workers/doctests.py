"""Runs the docstring examples of the given modules in this process; prints one JSON report.

Usage: `KERAS_BACKEND=jax python tests/workers/doctests.py [--keras-api-accessors] keras_mwms.startup.cluster ...`.
Each module's result is `{"failed": n, "attempted": n, "output": "..."}`; an import error counts
as one failure with its traceback as the output. With `--keras-api-accessors` the same process
then checks the Keras firewall's accessors (`keras_api_accessors.py`, one more report line).
"""

import contextlib
import doctest
import importlib
import io
import json
import sys
import traceback


def run(name: str) -> dict:
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            module = importlib.import_module(name)
            result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    except Exception:  # noqa: BLE001 - reported to the test
        return {"failed": 1, "attempted": 0, "output": output.getvalue() + traceback.format_exc()}
    return {"failed": result.failed, "attempted": result.attempted, "output": output.getvalue()[-4000:]}


if __name__ == "__main__":
    modules = [argument for argument in sys.argv[1:] if argument != "--keras-api-accessors"]
    print("DOCTESTS " + json.dumps({name: run(name) for name in modules}), flush=True)
    if "--keras-api-accessors" in sys.argv:
        import keras_api_accessors

        keras_api_accessors.main()
