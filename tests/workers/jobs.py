"""One warm process serving many test modules' scenarios: start-up paid once per gang.

Runs in every worker of a shared gang (`tests/shared_gangs.py`) and as the shared
single-process references: it creates the strategy once (or, with `--plain`, imports no
keras_mwms at all: plain Keras), then runs the plan's jobs one after another in this process.
A job is a scenario script of `tests/workers/` and its command line, run through the script's
`run_job(strategy, argv)`, so the script's own `python script.py ...` form and the shared form
train the same way:

    KERAS_BACKEND=torch python tests/workers/jobs.py PLAN.json [--plain] [--log-level ERROR]

PLAN.json is a list of `{"name", "script", "argv"}`. What a job prints (stdout and stderr) lies
between the lines `=== job NAME begins` and `=== job NAME ends`; how it ended goes to
`<plan folder>/<name>.w<index>.status` (`done in S s`, or the traceback). A job that raises ends
this process with status 1 (the gang's collectives cannot be trusted after one worker left a
job half-way), and `JOB FAILED NAME` names it. After every job the
strategy's `CommunicationOptions` are put back as they were before it, and between jobs
TorchDynamo forgets what it compiled (`torch._dynamo.reset()`), as a fresh process would: its
`recompile_limit` counts compiled models per process (`keras_mwms.backends.torch.recompile_limit`).
`--log-level ERROR` sets the keras_mwms logger's level before keras_mwms is imported, as a user
silencing it does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import resource
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def _forget_compiled_functions() -> None:
    if "torch" in sys.modules:
        import torch

        torch._dynamo.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", help="the plan: a JSON list of {name, script, argv}")
    parser.add_argument("--plain", action="store_true", help="plain Keras: no strategy, keras_mwms not imported")
    parser.add_argument("--log-level", help="the keras_mwms logger's level, set before keras_mwms is imported")
    arguments = parser.parse_args()
    if arguments.log_level:
        logging.getLogger("keras_mwms").setLevel(arguments.log_level)
    with open(arguments.plan) as handle:
        plan = json.load(handle)
    folder = os.path.dirname(os.path.abspath(arguments.plan))
    strategy = None
    if not arguments.plain:
        common.KERAS_BEFORE_THE_STRATEGY = common.keras_internals()   # user_scripts' lifecycle check
        import keras_mwms

        # Before any TensorFlow operation: TF configures its collectives only before the first.
        strategy = keras_mwms.MultiWorkerMirroredStrategy()
    index = 0 if strategy is None else strategy.worker_index
    for job in plan:
        status = os.path.join(folder, f"{job['name']}.w{index}.status")
        print(f"=== job {job['name']} begins: {job['script']} {' '.join(job['argv'])}", flush=True)
        _forget_compiled_functions()
        started = time.monotonic()
        options = None if strategy is None else strategy.backend.options
        try:
            importlib.import_module(job["script"]).run_job(strategy, job["argv"])
        except BaseException as error:   # SystemExit of a script's argument error included
            with open(status, "w") as handle:
                handle.write(f"failed after {time.monotonic() - started:.1f} s: {error!r}\n{traceback.format_exc()}")
            common.log(f"JOB FAILED {job['name']}: {error!r}\n{traceback.format_exc()}")
            sys.exit(1)
        finally:
            if options is not None:   # a job's CommunicationOptions (compression, ...) end with it
                strategy.backend.options = options
            sys.stdout.flush()
            sys.stderr.flush()
        with open(status, "w") as handle:
            handle.write(f"done in {time.monotonic() - started:.1f} s\n")
        print(f"=== job {job['name']} ends", flush=True)
    if strategy is not None:
        strategy.close()
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    with open(os.path.join(folder, f"cpu.w{index}"), "w") as handle:   # for the suite's time table
        handle.write(f"{sum(usage.ru_utime + usage.ru_stime for usage in used):.2f}\n")


if __name__ == "__main__":
    main()
