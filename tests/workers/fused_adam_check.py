"""Keras' torch Adam/AdamW vs keras_mwms' fused update on identical gradients (one process).

    KERAS_BACKEND=torch python tests/workers/fused_adam_check.py

Prints one JSON line: per optimizer, the max |Δw| between Keras' update and the fused one after
20 steps, how far the weights moved, and whether the fused kernel was used.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (puts the repository on sys.path)


def run(make_optimizer, fused: bool):
    import keras
    import numpy as np

    from keras_mwms.backends.torch import fused_adam
    from keras_mwms.communication import CommunicationOptions

    kernel = CommunicationOptions().torch_fused_adam   # KERAS_MWMS_TORCH_FUSED_ADAM=1: torch's kernel

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    weights = model.trainable_variables
    start = [variable.numpy().copy() for variable in weights]
    optimizer = make_optimizer()
    optimizer.build(weights)
    used = False
    if fused:
        base = type(optimizer)
        if not fused_adam.applies_to(base):
            raise SystemExit(f"{base} is not Keras' torch Adam")

        def _parallel_update_step(self, grads, variables, learning_rate):
            nonlocal used
            if fused_adam.eligible(self, grads, variables, kernel):
                used = True
                return fused_adam.update(self, grads, variables, learning_rate, kernel)
            return base._parallel_update_step(self, grads, variables, learning_rate)

        optimizer.__class__ = type(base.__name__, (base,),
                                   {"_parallel_update_step": _parallel_update_step})
    rng = np.random.default_rng(7)
    import torch

    for _ in range(20):
        grads = [torch.tensor(rng.standard_normal(w.shape).astype("float32")) for w in start]
        optimizer.apply(grads, weights)
    final = [variable.numpy().copy() for variable in weights]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(final, start))
    return final, moved, used


def main() -> None:
    import keras
    import numpy as np

    cases = {
        "adam": lambda: keras.optimizers.Adam(1e-2),
        "adam_schedule": lambda: keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(1e-2, 5, 0.5), beta_1=0.8, epsilon=1e-4),
        "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
        "adam_amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
    }
    report = {}
    for name, make in cases.items():
        keras_final, moved, _ = run(make, fused=False)
        fused_final, _, used = run(make, fused=True)
        delta = max(float(np.abs(a - b).max()) for a, b in zip(keras_final, fused_final))
        report[name] = {"delta": delta, "moved": moved, "fused": used}
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
