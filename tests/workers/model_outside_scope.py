"""A model created outside `strategy.scope()`, or before the strategy exists, then `fit` (issue 31, item 7).

    python model_outside_scope.py OUT_DIR outside|before [MARKER]

`outside`: the strategy, then a model built and compiled without `strategy.scope()`;
the chief then runs `evaluate` and `predict` of it alone (they must enter no collective, and
warn); `before`: the model first, then the strategy (TensorFlow and JAX refuse the strategy itself
there: their engines cannot start once a layer ran). Either way each worker writes
`OUT/w<index>.json` with the error it got (`type`, `message`, `seconds` from the start of
`fit`, or from creating the strategy), then re-raises it: every worker must stop by itself.
MARKER only tags the command line (orphan checks).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings


def record(out: str, error: BaseException, stage: str, started: float, alone: list | None = None) -> None:
    with open(os.path.join(out, f"w{worker_index()}.json"), "w") as handle:
        json.dump({"stage": stage, "type": type(error).__name__, "message": str(error),
                   "seconds": time.monotonic() - started, "alone": alone or []}, handle)


def worker_index() -> int:
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    index = worker_index()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    def build():
        model = common.mlp()
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = build() if mode == "before" else None
    import keras_mwms

    started = time.monotonic()
    try:
        keras_mwms.MultiWorkerMirroredStrategy()
    except RuntimeError as error:
        record(out, error, "strategy", started)
        raise
    if mode == "outside":
        model = build()
    x, y = common.regression_data(64)
    alone = []
    if mode == "outside" and index == 0:
        # evaluate/predict of such a model run on the chief alone, entering no collective.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.evaluate(x, y, batch_size=16, verbose=0)
            model.predict(x, batch_size=16, verbose=0)
        alone = [str(warning.message) for warning in caught if "runs on this worker alone" in str(warning.message)]
    started = time.monotonic()
    try:
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    except ValueError as error:
        record(out, error, "fit", started, alone)
        raise


if __name__ == "__main__":
    main()
