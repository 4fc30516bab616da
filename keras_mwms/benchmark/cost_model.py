"""An α-β (Hockney) cost model of a data-parallel step, fitted to the benchmark's measurements.

All-reduce. A ring all-reduce of S bytes over n workers takes 2(n−1) steps, each sending
S/n bytes from every worker to its neighbour: 2(n−1) message latencies and 2(n−1)/n · S bytes
through each worker's link (the ring bound of `keras_mwms.benchmark.bandwidth`). With α the
latency of one step and β the seconds per byte sent,

    A(n, S) = m · 2(n−1) · α + 2(n−1)/n · S · β

where m is the number of collectives a step issues (JAX's flat path: one vector; TensorFlow:
the gradients with the row count, then the metric states; torch: its buckets, see `torch_buckets`). α and β are fitted by
least squares on the all-reduce section's (n, S, seconds) rows — relative residuals, because
the sizes span five decades and plain least squares would ignore every row but the largest —
with both kept non-negative (`fit_alpha_beta`).

Step. One worker's compute C is the step time of one process on one worker's batch (measured).
The gradients are all-reduced after the backward pass (TensorFlow, JAX's flat path):
`step = C + A`. torch starts each bucket's all-reduce during `backward()`, so at best the
communication hides behind the compute: `step = max(C, A)` — the optimistic bound of perfect
overlap (`step_seconds`). Data on the same machine with more threads than cores also slows the
compute: at a measured point with n processes × t threads on c cores, C is scaled by
max(1, n·t/c) (`oversubscription`); a projected worker has its own cores (factor 1).

Projection. Weak scaling: every worker keeps the measured per-worker batch (the global batch
grows with n), so the ideal step time stays C and the scaling efficiency is C / step (≤ 1).
To move the fitted β from this machine's loopback to a network link of L bit/s, the per-byte
cost splits into the wire (1/loopback bandwidth here, 8/L there) and the engine's own CPU work
per byte (copies, reduction, serialization: β − 1/loopback), which stays:
β(L) = max(0, β − 1/loopback) + 8/L (`link_beta`). α is kept as fitted (it is software latency,
well above a LAN hop's 5–50 µs).

Example: fit a noise-free ring, then project it.

>>> samples = [(2, size, ring_allreduce_seconds(size, 2, alpha=100e-6, beta=1e-9))
...            for size in (4, 4096, 1 << 20, 16 << 20)]
>>> fitted = fit_alpha_beta(samples)
>>> round(fitted.alpha * 1e6, 3), round(fitted.beta * 1e9, 3)
(100.0, 1.0)
>>> beta = link_beta(fitted.beta, loopback_bytes_per_second=4e9, link_bits_per_second=10e9)
>>> round(beta * 1e9, 3)  # 0.75 ns/B of engine work + 0.8 ns/B of 10 Gbit/s wire
1.55
>>> step = step_seconds(0.020, ring_allreduce_seconds(2 << 20, 8, fitted.alpha, beta))
>>> round(step * 1e3, 2), round(scaling_efficiency(0.020, step), 3)
(27.09, 0.738)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from keras_mwms.benchmark.bandwidth import ring_factor

PROJECTED_WORKERS = (8, 16, 32, 64, 128, 256)
LINK_GBITS = (10, 25, 100)
TORCH_FIRST_BUCKET_BYTES = 1 << 20          # keras_mwms.backends.torch.overlap.FIRST_BUCKET_BYTES
TORCH_BUCKET_BYTES = 25 * (1 << 20)         # keras_mwms.backends.torch.engine.DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted all-reduce cost: `alpha` seconds per ring step, `beta` seconds per byte sent.

    Example:

    >>> model = AlphaBeta(alpha=50e-6, beta=2e-9, samples=3, relative_rms=0.0)
    >>> round(model.seconds(1 << 20, workers=4) * 1e3, 4)  # 6 × 50 µs + 1.5 × 1 MiB × 2 ns
    3.4457

    Args:
        alpha: latency of one of the ring's 2(n−1) steps, in seconds.
        beta: seconds per byte each worker sends (1 / effective bandwidth).
        samples: how many measured rows the fit used.
        relative_rms: root mean square of (predicted − measured) / measured over those rows.
    """

    alpha: float
    beta: float
    samples: int
    relative_rms: float

    def seconds(self, nbytes: float, workers: int, messages: int = 1) -> float:
        """`ring_allreduce_seconds` with this model's α and β."""
        return ring_allreduce_seconds(nbytes, workers, self.alpha, self.beta, messages)


def ring_allreduce_seconds(nbytes: float, workers: int, alpha: float, beta: float, messages: int = 1) -> float:
    """m · 2(n−1) · α + 2(n−1)/n · S · β: a ring all-reduce of `nbytes` in `messages` parts.

    Example:

    >>> round(ring_allreduce_seconds(1e6, 2, alpha=1e-4, beta=1e-9), 9)  # 2 steps × 100 µs + 1 MB at 1 GB/s
    0.0012
    >>> ring_allreduce_seconds(1e6, 1, alpha=1e-4, beta=1e-9)  # one worker: nothing to send
    0.0
    """
    if workers < 2:
        return 0.0
    return messages * 2 * (workers - 1) * alpha + ring_factor(workers) * nbytes * beta


def fit_alpha_beta(samples: Sequence[tuple[int, float, float]]) -> AlphaBeta:
    """Least-squares α, β ≥ 0 from `(workers, nbytes, seconds)` rows of single all-reduces.

    Minimizes the squared *relative* residuals (each row weighted by 1 / its time). When the
    unconstrained optimum has a negative coefficient, that coefficient is fixed at 0 and the
    other refitted (the non-negative least-squares solution for two unknowns).

    Example:

    >>> fitted = fit_alpha_beta([(2, 4, 2e-4), (2, 1e6, 1.2e-3), (4, 1e6, 2.1e-3)])
    >>> round(fitted.alpha * 1e6, 1), round(fitted.beta * 1e9, 3), fitted.samples
    (100.0, 1.0, 3)
    >>> fit_alpha_beta([(2, 4, 1e-3)])
    Traceback (most recent call last):
    ...
    ValueError: fit_alpha_beta needs at least 2 all-reduce rows of different sizes or worker counts with positive times; got 1 usable of 1. Run the benchmark's all-reduce section (or fit, which times the latency and gradient sizes) with --workers >= 2.
    """
    usable = [(workers, nbytes, seconds) for workers, nbytes, seconds in samples
              if workers >= 2 and seconds > 0 and math.isfinite(seconds)]
    design = np.array([[2.0 * (workers - 1), ring_factor(workers) * nbytes] for workers, nbytes, _ in usable])
    if len(usable) < 2 or np.linalg.matrix_rank(design) < 2:
        raise ValueError(
            f"fit_alpha_beta needs at least 2 all-reduce rows of different sizes or worker counts with "
            f"positive times; got {len(usable)} usable of {len(samples)}. Run the benchmark's all-reduce "
            "section (or fit, which times the latency and gradient sizes) with --workers >= 2.")
    times = np.array([seconds for _, _, seconds in usable])
    weighted, target = design / times[:, None], np.ones(len(usable))
    coefficients = np.linalg.lstsq(weighted, target, rcond=None)[0]
    if coefficients.min() < 0:
        keep = int(np.argmax(coefficients))
        column = weighted[:, keep]
        coefficients = np.zeros(2)
        coefficients[keep] = float(column @ target / (column @ column))
    relative = design @ coefficients / times - 1.0
    return AlphaBeta(alpha=float(coefficients[0]), beta=float(coefficients[1]), samples=len(usable),
                     relative_rms=float(np.sqrt(np.mean(relative**2))))


def link_beta(fitted_beta: float, loopback_bytes_per_second: float, link_bits_per_second: float) -> float:
    """β on a link of `link_bits_per_second`: the engine's per-byte work here plus that link's wire.

    Example:

    >>> round(link_beta(1.25e-9, 4e9, 100e9) * 1e9, 3)  # 1.0 ns/B engine + 0.08 ns/B wire
    1.08
    """
    engine = max(0.0, fitted_beta - 1.0 / loopback_bytes_per_second)
    return engine + 8.0 / link_bits_per_second


def step_seconds(compute: float, communication: float, overlapped: bool = False) -> float:
    """One step: compute then communication, or with perfect overlap the larger of the two.

    Example:

    >>> step_seconds(0.02, 0.005), step_seconds(0.02, 0.005, overlapped=True)
    (0.025, 0.02)
    """
    return max(compute, communication) if overlapped else compute + communication


def scaling_efficiency(compute: float, step: float) -> float:
    """Weak-scaling efficiency: one worker's compute ÷ the step time (1.0 = linear speed-up).

    Example:

    >>> round(scaling_efficiency(0.02, 0.025), 9)
    0.8
    """
    return compute / step


def oversubscription(workers: int, threads: int, cores: int) -> float:
    """How many compute threads share each core: max(1, workers × threads ÷ cores).

    Example:

    >>> oversubscription(2, 1, cores=2), oversubscription(3, 1, cores=2), oversubscription(4, 1, cores=2)
    (1.0, 1.5, 2.0)
    """
    return max(1.0, workers * threads / cores)


def torch_buckets(gradient_bytes: int) -> int:
    """All-reduces per step of keras_mwms' torch overlap (a 1 MiB first bucket, then 25 MiB ones).

    An estimate from the total: the real plan cuts at parameter boundaries (`plan_buckets`).

    Example:

    >>> torch_buckets(21_704), torch_buckets(2_254_888), torch_buckets(60 << 20)
    (1, 2, 4)
    """
    rest = max(0, gradient_bytes - TORCH_FIRST_BUCKET_BYTES)
    return 1 + math.ceil(rest / TORCH_BUCKET_BYTES)


def project(compute: float, gradient_bytes: int, model: AlphaBeta, loopback_bytes_per_second: float,
            link_gbits: Sequence[float] = LINK_GBITS, workers: Sequence[int] = PROJECTED_WORKERS,
            overlapped: bool = False, messages: int = 1) -> list[dict]:
    """Step time and weak-scaling efficiency at each link speed and worker count.

    Example:

    >>> model = AlphaBeta(alpha=100e-6, beta=1e-9, samples=4, relative_rms=0.0)
    >>> rows = project(0.02, 2 << 20, model, 4e9, link_gbits=(10,), workers=(8, 256))
    >>> [(row["workers"], round(row["step_ms"], 2), round(row["efficiency"], 3)) for row in rows]
    [(8, 27.09, 0.738), (256, 77.48, 0.258)]
    """
    rows = []
    for gbits in link_gbits:
        beta = link_beta(model.beta, loopback_bytes_per_second, gbits * 1e9)
        for count in workers:
            communication = ring_allreduce_seconds(gradient_bytes, count, model.alpha, beta, messages)
            step = step_seconds(compute, communication, overlapped)
            rows.append({"link_gbits": gbits, "workers": count, "step_ms": step * 1e3,
                         "allreduce_ms": communication * 1e3, "efficiency": scaling_efficiency(compute, step),
                         "beta_ns_per_byte": beta * 1e9})
    return rows
