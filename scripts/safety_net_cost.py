"""What the workers-agree check costs: its seconds per call against a training step's.

Run on a gang (`python -m keras_mwms.launch --workers 2 scripts/safety_net_cost.py [mlp|conv]`):
each worker fits the benchmark model (`keras_mwms.benchmark`'s full preset) for `STEPS` steps
with the check off, then times `REPEATS` checks alone; the chief prints one line per model:
step seconds, check seconds, and the check as a share of one step and of the whole fit.
"""

from __future__ import annotations

import os
import sys
import time

os.environ["KERAS_MWMS_CHECK_WORKERS_AGREE"] = "0"   # the fits below time training alone

import keras_mwms  # noqa: E402

strategy = keras_mwms.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

from keras_mwms.backends import consistency  # noqa: E402
from keras_mwms.benchmark import models  # noqa: E402
from keras_mwms.benchmark.config import full_config  # noqa: E402

STEPS, REPEATS = 200, 20

for name in sys.argv[1:] or ["mlp", "conv"]:
    config = full_config(workers=strategy.num_workers, steps=STEPS)
    x, y = models.synthetic_data(config, name)
    with strategy.scope():
        model = models.build_keras_model(keras, config, name)
    model.fit(x[:config.global_batch * 10], y[:config.global_batch * 10], batch_size=config.global_batch,
              epochs=1, verbose=0, shuffle=False)   # warm-up: compile, build the optimizer
    started = time.perf_counter()
    model.fit(x, y, batch_size=config.global_batch, epochs=1, verbose=0, shuffle=False)
    step = (time.perf_counter() - started) / STEPS
    os.environ["KERAS_MWMS_CHECK_WORKERS_AGREE"] = "1"
    strategy.backend.check_workers_agree(model, "warm-up")
    started = time.perf_counter()
    for _ in range(REPEATS):
        strategy.backend.check_workers_agree(model, "timing")
    check = (time.perf_counter() - started) / REPEATS
    os.environ["KERAS_MWMS_CHECK_WORKERS_AGREE"] = "0"
    variables = len(consistency.model_state(model))
    if strategy.is_chief:
        print(f"{keras.backend.backend()} {name}: {variables} variables, step {step * 1e3:.2f} ms, "
              f"check {check * 1e3:.2f} ms = {check / step:.1%} of one step, "
              f"{check / (step * STEPS):.3%} of a {STEPS}-step fit", flush=True)
