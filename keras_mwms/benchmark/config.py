"""What one benchmark run measures: sizes, model, steps, workers, threads — quick or full.

The configuration is a plain dataclass, written to JSON for the worker processes, so the driver
and every worker agree on the same sizes, iterations and model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

BACKENDS = ("tensorflow", "jax", "torch")
KIB, MIB = 1024, 1024 * 1024
FULL_SIZES = tuple(4 * KIB * 4**power for power in range(8))       # 4 KiB, 16 KiB, ..., 64 MiB
QUICK_SIZES = (4 * KIB, 256 * KIB, 16 * MIB)
LATENCY_BYTES = 4                                                  # one float32: pure latency


@dataclass(frozen=True)
class BenchmarkConfig:
    """Everything a run measures; `quick_config()` and `full_config()` are the two presets.

    Example:

    >>> config = quick_config(workers=2)
    >>> config.workers, config.sizes, config.models
    (2, (4096, 262144, 16777216), ('mlp',))
    >>> BenchmarkConfig.from_json(config.to_json()) == config
    True

    Args:
        backends: Keras backends to measure, each in its own processes.
        workers: N, the workers of every multi-worker gang (compared with one process).
        sections: `"allreduce"` and/or `"fit"`.
        sizes: all-reduce message sizes in bytes (float32 elements, so multiples of 4).
        allreduce_bytes_per_size: traffic per size that sets the iteration count (bounded by
            `min_iterations`, `max_iterations`), the same on every worker.
        models: the model family members to fit: `"mlp"` (width × depth) and/or `"conv"`.
        width, depth: the MLP's hidden width and number of hidden layers.
        features, classes: MLP input features and output classes.
        image_size: the conv net's square input (channels last, 3 channels).
        global_batch: examples per step across all workers.
        steps: training steps per timed fit (one epoch).
        warmup_steps: first steps left out of steps/s (tracing, allocation).
        repeats: fits per variant, interleaved with the native peer; the best counts.
        share_peers: with one process, also fit the native peers (not only keras_mwms) on one
            worker's share of the global batch (their sync-overhead baseline); quick: the
            first peer only.
        gang_timeout: seconds one gang of workers may run before it is killed.
        ledger_comparison: with N workers, also fit keras_mwms with the collective ledger and
            its timers off (`keras_mwms.diagnostics`; variant `"keras_mwms no-ledger"`), in
            the same gang, interleaved repeat by repeat (`--no-ledger`).
        scaling_workers: further worker counts of a scaling sweep (`--workers 2,3,4` gives
            `workers=2, scaling_workers=(3, 4)`): keras_mwms alone at each, on the same per-worker
            batch (global batch ÷ `workers`: weak scaling), with the all-reduce; the cost model
            (`keras_mwms.benchmark.scaling`) is fitted to them.
    """

    backends: tuple[str, ...] = BACKENDS
    workers: int = 2
    sections: tuple[str, ...] = ("allreduce", "fit")
    sizes: tuple[int, ...] = FULL_SIZES
    allreduce_bytes_per_size: int = 256 * MIB
    min_iterations: int = 3
    max_iterations: int = 50
    models: tuple[str, ...] = ("mlp", "conv")
    width: int = 512
    depth: int = 3
    features: int = 64
    classes: int = 10
    image_size: int = 16
    global_batch: int = 256
    steps: int = 200
    warmup_steps: int = 20
    repeats: int = 2
    share_peers: int = 2
    gang_timeout: float = 900.0
    ledger_comparison: bool = False
    scaling_workers: tuple[int, ...] = ()
    quick: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchmarkConfig:
        values = json.loads(text)
        for name in ("backends", "sections", "sizes", "models", "scaling_workers"):
            values[name] = tuple(values.get(name, ()))
        return cls(**values)

    def iterations_for(self, nbytes: int) -> int:
        """All-reduce repetitions at `nbytes`: about `allreduce_bytes_per_size` of traffic.

        Example:

        >>> quick_config().iterations_for(4096), quick_config().iterations_for(16 * MIB)
        (20, 4)
        """
        wanted = self.allreduce_bytes_per_size // max(1, nbytes)
        return int(min(self.max_iterations, max(self.min_iterations, wanted)))


def full_config(**overrides) -> BenchmarkConfig:
    """The full run: 8 sizes 4 KiB…64 MiB, MLP 512×3 and a small conv net, 200 steps, 2 repeats."""
    return replace(BenchmarkConfig(), **overrides)


def quick_config(**overrides) -> BenchmarkConfig:
    """The CI run (`make bench-quick`): 3 sizes, the MLP 256×2 only, 40 steps, one repeat."""
    quick = BenchmarkConfig(sizes=QUICK_SIZES, allreduce_bytes_per_size=64 * MIB, max_iterations=20,
                            models=("mlp",), width=256, depth=2, steps=40, warmup_steps=8, repeats=1,
                            share_peers=1, gang_timeout=300.0, quick=True)
    return replace(quick, **overrides)
