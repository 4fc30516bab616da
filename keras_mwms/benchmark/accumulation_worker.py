"""One worker of `python -m keras_mwms.benchmark accumulation`: fit K = 1 and K = 4, timed.

Started by `keras_mwms.benchmark.accumulation` with `TF_CONFIG`, `KERAS_BACKEND` and one compute
thread already set:

    python -m keras_mwms.benchmark.accumulation_worker OUT.json SETTINGS.json

For each repeat, for each K in the settings (alternating, so load drifts hit both alike): a
fresh MLP (same seed), `SGD(0.01, gradient_accumulation_steps=K)` (none for K = 1), one fit of
`warmup + steps` micro-steps. A callback stamps every micro-step's end; the collective ledger
(`LEDGER.kinds`) counts the fit's collectives by kind and `WIRE` the bytes handed to the engine.
"""

from __future__ import annotations

import sys
import time

from keras_mwms.benchmark.compression_worker import run_gang_worker


def fit_once(strategy, settings: dict, steps_per_update: int) -> dict:
    """One timed fit with `gradient_accumulation_steps=steps_per_update` (1: none)."""
    import keras
    import numpy as np

    from keras_mwms.backends.compression import WIRE
    from keras_mwms.diagnostics import LEDGER

    keras.utils.set_random_seed(0)
    steps, warmup, batch = settings["steps"], settings["warmup"], settings["global_batch"]
    rows = (steps + warmup) * batch
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, settings["features"])).astype("float32")
    y = rng.integers(0, settings["classes"], rows).astype("int64")
    accumulation = {"gradient_accumulation_steps": steps_per_update} if steps_per_update > 1 else {}
    with strategy.scope():
        model = keras.Sequential([keras.Input((settings["features"],))]
                                 + [keras.layers.Dense(settings["width"], activation="relu")
                                    for _ in range(settings["depth"])]
                                 + [keras.layers.Dense(settings["classes"])])
        model.compile(optimizer=keras.optimizers.SGD(0.01, **accumulation),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stamps: list[float] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            stamps.append(time.perf_counter())

    WIRE.reset()
    before = dict(LEDGER.kinds)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Stamp()])
    kinds = {kind: count - before.get(kind, 0) for kind, count in LEDGER.kinds.items()
             if count > before.get(kind, 0)}
    timed = len(stamps) - warmup
    updates = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    return {"k": steps_per_update, "micro_steps": len(stamps), "optimizer_steps": updates,
            "seconds_per_micro_step": (stamps[-1] - stamps[warmup - 1]) / timed,
            "collectives": kinds, "engine_bytes_per_micro_step": WIRE.per_step(len(stamps)),
            "parameters": model.count_params()}


def main(argv: list[str]) -> int:
    return run_gang_worker(argv, lambda strategy, settings: [
        fit_once(strategy, settings, k) for _ in range(settings["repeats"]) for k in settings["ks"]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
