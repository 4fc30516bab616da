"""Side-by-side throughput: keras_mwms `model.fit` vs a hand-written torch DDP loop.

    python -m keras_mwms.launch --workers 2 tests/workers/torch_bench.py [--steps 300] [--jit]
        [--repeats 2] [--variants]

Both run in the same worker processes on the same process group (the strategy's), with the
same MLP (64 → 512 → 512 → 512 → 10), global batch, data and threads, interleaved
(DDP, Keras, DDP, Keras, ...) so machine load hits both alike. The chief prints steady-state
steps/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402,F401  (puts the repository on sys.path)

FEATURES, CLASSES, WIDTH, DEPTH = 64, 10, 512, 3
WARMUP = 10


def data(steps: int, global_batch: int):
    import numpy as np

    rng = np.random.default_rng(123)
    x = rng.standard_normal((steps * global_batch, FEATURES)).astype("float32")
    y = (x @ rng.standard_normal((FEATURES, CLASSES)).astype("float32")).argmax(1)
    return x, y.astype("int64")


def ddp_steps_per_second(strategy, x, y, global_batch: int) -> float:
    import torch
    import torch.nn as nn

    workers, rank = strategy.num_workers, strategy.worker_index
    local = global_batch // workers
    steps = len(x) // global_batch
    xs = torch.from_numpy(x.reshape(steps, workers, local, FEATURES)[:, rank].copy())
    ys = torch.from_numpy(y.reshape(steps, workers, local)[:, rank].copy())
    torch.manual_seed(0)
    layers, width = [], FEATURES
    for _ in range(DEPTH):
        layers += [nn.Linear(width, WIDTH), nn.ReLU()]
        width = WIDTH
    model = nn.Sequential(*layers, nn.Linear(width, CLASSES))
    net = nn.parallel.DistributedDataParallel(model) if workers > 1 else model
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(net(xs[step]), ys[step]).backward()
        optimizer.step()
        times.append(time.perf_counter())
    strategy.barrier("ddp done")
    return (len(times) - 1 - WARMUP) / (times[-1] - times[WARMUP])


def keras_steps_per_second(strategy, x, y, global_batch: int, jit: bool) -> float:
    import keras

    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter())

    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((FEATURES,))]
            + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(DEPTH)]
            + [keras.layers.Dense(CLASSES)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit)
    model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[Clock()])
    strategy.barrier("keras done")
    return (len(times) - 1 - WARMUP) / (times[-1] - times[WARMUP])


# Variants of keras_mwms measured in the same gang: name -> CommunicationOptions fields they run with.
VARIANTS = {
    "keras_mwms fit": {},
    "  without fused Adam": {"torch_fused_adam": False},
    "  without overlap": {"torch_overlap": False},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--variants", action="store_true",
                        help="also time keras_mwms with fused Adam off and with overlap off")
    arguments = parser.parse_args()

    import torch

    import keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()
    x, y = data(arguments.steps, arguments.global_batch)
    names = list(VARIANTS) if arguments.variants else ["keras_mwms fit"]
    ddp: list[float] = []
    rates: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(arguments.repeats):
        # Interleaved, so that machine load hits every variant alike; ratios are taken per repeat.
        ddp.append(ddp_steps_per_second(strategy, x, y, arguments.global_batch))
        for name in names:
            saved = strategy.backend.options
            strategy.backend.options = dataclasses.replace(saved, **VARIANTS[name])
            try:
                rates[name].append(keras_steps_per_second(strategy, x, y, arguments.global_batch,
                                                          arguments.jit))
            finally:
                strategy.backend.options = saved
    if strategy.is_chief:
        print(f"workers={strategy.num_workers} threads={torch.get_num_threads()} "
              f"global_batch={arguments.global_batch} steps={arguments.steps} jit={arguments.jit}",
              flush=True)
        print(f"  {'torch DDP loop':<24} steps/s: {' '.join(f'{v:6.1f}' for v in ddp)}  "
              f"(median {statistics.median(ddp):.1f})", flush=True)
        for name in names:
            ratios = [fit / base for fit, base in zip(rates[name], ddp)]
            print(f"  {name:<24} steps/s: {' '.join(f'{v:6.1f}' for v in rates[name])}  "
                  f"(median {statistics.median(rates[name]):.1f}); ratio to DDP per repeat "
                  f"{' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
