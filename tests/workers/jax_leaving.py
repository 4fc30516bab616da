"""The chief keeps working after the workers' last collective; the job must still end cleanly.

    python jax_leaving.py OUT SECONDS [EXIT_CODE]     (a JAX gang, TF_CONFIG set)

Every worker creates the strategy and trains one tiny `fit`; then the chief alone works on for
SECONDS (as when it saves a large model) while the others' scripts end at once. JAX's shutdown
barrier gives the workers `SHUTDOWN_TIMEOUT_SECONDS` to arrive; before `JaxFaults.leave_together`
a longer chief was aborted mid-work (SIGABRT). Writes `OUT/w<index>.json` with `completed`
once the script's work is done (the chief: after its extra work).

With EXIT_CODE, every worker first fits on a PyDataset with a process pool (whose children must
let the worker exit: `common.fit_on_a_process_pool`); then its last call is a `fit` that raises (targets of another length), which
the script catches before it ends with `sys.exit(EXIT_CODE)`: the job's status must be the
script's own (before: 1, "exits without JAX's shutdown barrier").
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(out: str, seconds: float, exit_code: int | None = None) -> None:
    import keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    import keras
    import numpy as np

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=8, epochs=1, verbose=0)
    index = strategy.cluster_resolver.task_id
    if strategy.is_chief:
        print(f"chief: working alone for {seconds} s after the last collective", flush=True)
        time.sleep(seconds)
    if exit_code is not None:
        common.fit_on_a_process_pool(strategy)
        try:
            model.fit(np.ones((32, 4)), np.ones((31, 1)), batch_size=8, epochs=1, verbose=0)
        except ValueError as error:
            common.save_result(out, index, completed=True, caught=str(error)[:300])
            sys.exit(exit_code)
    common.save_result(out, index, completed=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
