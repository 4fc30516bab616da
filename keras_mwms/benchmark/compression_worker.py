"""One worker of `python -m keras_mwms.benchmark compression`: fit each compression, timed.

Started by `keras_mwms.benchmark.compression` inside a network namespace with `TF_CONFIG`,
`KERAS_BACKEND` and one compute thread already set:

    python -m keras_mwms.benchmark.compression_worker OUT.json SETTINGS.json

For each compression (None, bf16, fp16) in the same strategy: a fresh ~10 M-parameter MLP
(same seed), SGD, one fit of `warmup + steps` global batches; a callback stamps every step's
end with the clock and this namespace's veth transmit counter (`/sys/class/net/DEVICE`,
DEVICE from the settings), so seconds and bytes on the wire per step are measured over the
steps after the warm-up. `WIRE` adds the bytes handed to the engine per step.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time


def transmitted_bytes(device: str) -> int:
    """Bytes this namespace's `device` has sent so far (0 when it has no such device)."""
    try:
        with open(f"/sys/class/net/{device}/statistics/tx_bytes") as counter:
            return int(counter.read())
    except OSError:
        return 0


def mlp_parameters(features: int, width: int, depth: int, classes: int) -> int:
    """Trainable parameters of the benchmark MLP.

    Example (the default: ~10 M):

    >>> mlp_parameters(256, 2176, 3, 10)
    10055306
    """
    widths = [features] + [width] * depth + [classes]
    return sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))


def fit_once(strategy, settings: dict, compression: str | None) -> dict:
    import keras
    import numpy as np

    from keras_mwms.backends.compression import WIRE

    strategy.backend.options = dataclasses.replace(strategy.backend.options, compression=compression)
    keras.utils.set_random_seed(0)
    steps, warmup, batch = settings["steps"], settings["warmup"], settings["global_batch"]
    rows = (steps + warmup) * batch
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, settings["features"])).astype("float32")
    y = rng.integers(0, settings["classes"], rows).astype("int64")
    with strategy.scope():
        model = keras.Sequential([keras.Input((settings["features"],))]
                                 + [keras.layers.Dense(settings["width"], activation="relu")
                                    for _ in range(settings["depth"])]
                                 + [keras.layers.Dense(settings["classes"])])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stamps: list[tuple[float, int]] = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            stamps.append((time.perf_counter(), transmitted_bytes(settings["device"])))

    WIRE.reset()
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Stamp()])
    (start, sent_before), (end, sent_after) = stamps[warmup - 1], stamps[-1]
    timed = len(stamps) - warmup
    return {"compression": compression or "none", "steps": timed,
            "seconds_per_step": (end - start) / timed,
            "wire_bytes_per_step": (sent_after - sent_before) / timed,
            "engine_bytes_per_step": WIRE.per_step(len(stamps)),
            "loss": float(history.history["loss"][-1]),
            "parameters": model.count_params()}


def run_gang_worker(argv: list[str], fit_rows) -> int:
    """A benchmark gang worker's whole run: `argv` is `OUT.json SETTINGS.json`; writes
    `{"worker": index, "rows": fit_rows(strategy, settings)}` to OUT.json, `{worker}` in it
    replaced by the worker's index. torch gets one thread unless the settings say
    `"threads": "as started"` (the thread split keras_mwms makes is what is measured)."""
    out, settings_path = argv
    with open(settings_path) as file:
        settings = json.load(file)
    import keras

    import keras_mwms

    if keras.backend.backend() == "torch" and settings.get("threads") != "as started":
        import torch

        torch.set_num_threads(1)
    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    rows = fit_rows(strategy, settings)
    threads = None
    if keras.backend.backend() == "torch":
        import torch

        threads = torch.get_num_threads()
    with open(out.replace("{worker}", str(strategy.worker_index)), "w") as file:
        json.dump({"worker": strategy.worker_index, "rows": rows, "threads": threads}, file)
    return 0


def main(argv: list[str]) -> int:
    return run_gang_worker(argv, lambda strategy, settings: [
        fit_once(strategy, settings, compression) for compression in settings["compressions"]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
