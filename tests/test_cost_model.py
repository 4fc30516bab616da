"""`keras_mwms.benchmark.cost_model`: the α-β fit and the projection, on synthetic data (pure, fast)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from keras_mwms.benchmark import cost_model
from keras_mwms.benchmark.cost_model import AlphaBeta

SIZES = [4] + [4096 * 4**power for power in range(8)]


def synthetic(alpha, beta, counts=(2,), noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [(n, size, cost_model.ring_allreduce_seconds(size, n, alpha, beta) * (1 + noise * rng.standard_normal()))
            for n, size in itertools.product(counts, SIZES)]


@pytest.mark.parametrize("alpha, beta, counts", [
    (150e-6, 1.2e-9, (2,)),          # torch over gloo here: ~150 us, ~0.84 GB/s
    (850e-6, 4.3e-9, (2, 3, 4)),     # TensorFlow's gRPC ring here
    (5e-6, 0.08e-9, (4, 8, 16)),     # a fast network
])
def test_fit_recovers_alpha_and_beta_from_noise_free_rows(alpha, beta, counts):
    fitted = cost_model.fit_alpha_beta(synthetic(alpha, beta, counts))
    assert fitted.alpha == pytest.approx(alpha, rel=1e-9)
    assert fitted.beta == pytest.approx(beta, rel=1e-9)
    assert fitted.samples == len(SIZES) * len(counts) and fitted.relative_rms < 1e-9


def test_fit_is_close_under_five_percent_noise_and_reports_it():
    fitted = cost_model.fit_alpha_beta(synthetic(200e-6, 1e-9, (2, 3, 4), noise=0.05, seed=3))
    assert fitted.alpha == pytest.approx(200e-6, rel=0.05)
    assert fitted.beta == pytest.approx(1e-9, rel=0.05)
    assert 0.02 < fitted.relative_rms < 0.08


def test_fit_keeps_both_coefficients_non_negative():
    # Times that fall with size would need a negative beta: the fit pins beta at 0 instead.
    fitted = cost_model.fit_alpha_beta([(2, 4, 3e-3), (2, 1 << 20, 2e-3), (2, 16 << 20, 1e-3)])
    assert fitted.beta == 0.0 and fitted.alpha > 0
    # Pure bandwidth rows (no latency at all) give alpha = 0, never below.
    fitted = cost_model.fit_alpha_beta([(2, 1 << 20, 1e-3), (2, 1 << 24, 16e-3 * 1.01), (2, 1 << 10, 0.5e-6)])
    assert fitted.alpha >= 0.0 and fitted.beta > 0


def test_fit_refuses_rows_that_cannot_separate_alpha_from_beta():
    with pytest.raises(ValueError, match="at least 2 all-reduce rows"):
        cost_model.fit_alpha_beta([(2, 4096, 1e-3), (2, 4096, 1.1e-3)])
    with pytest.raises(ValueError, match="--workers >= 2"):
        cost_model.fit_alpha_beta([(1, 4096, 1e-3), (1, 8192, 2e-3)])


def test_projection_is_monotonic_and_efficiency_at_most_one():
    model = AlphaBeta(alpha=150e-6, beta=1.2e-9, samples=9, relative_rms=0.0)
    workers = (2, 4, 8, 16, 32, 64, 128, 256)
    for overlapped, messages, gradient_bytes in itertools.product((False, True), (1, 2), (21_704, 2_254_888)):
        rows = cost_model.project(0.018, gradient_bytes, model, 3.9e9, workers=workers, overlapped=overlapped,
                                  messages=messages)
        for gbits in cost_model.LINK_GBITS:
            line = [row for row in rows if row["link_gbits"] == gbits]
            steps = [row["step_ms"] for row in line]
            efficiencies = [row["efficiency"] for row in line]
            assert steps == sorted(steps) and efficiencies == sorted(efficiencies, reverse=True)
            assert all(0 < efficiency <= 1.0 for efficiency in efficiencies)
            assert all(row["step_ms"] >= 18.0 - 1e-9 for row in line)
        # A faster link never makes a step slower.
        by_link = {gbits: [row["step_ms"] for row in rows if row["link_gbits"] == gbits]
                   for gbits in cost_model.LINK_GBITS}
        assert all(slow >= fast for slow, fast in zip(by_link[10], by_link[100]))


def test_overlap_hides_communication_up_to_the_compute_time():
    assert cost_model.step_seconds(0.02, 0.015, overlapped=True) == 0.02
    assert cost_model.step_seconds(0.02, 0.025, overlapped=True) == 0.025
    assert cost_model.step_seconds(0.02, 0.015) == pytest.approx(0.035)


def test_link_beta_keeps_the_engine_cost_and_swaps_the_wire():
    loopback = 4e9
    fitted = 1 / 0.8e9                       # the engine reaches 0.8 GB/s on a 4 GB/s loopback
    engine = fitted - 1 / loopback
    assert cost_model.link_beta(fitted, loopback, 10e9) == pytest.approx(engine + 0.8e-9)
    assert cost_model.link_beta(fitted, loopback, 100e9) == pytest.approx(engine + 0.08e-9)
    # An engine measured faster than the loopback probe cannot have a negative cost of its own.
    assert cost_model.link_beta(0.1e-9, loopback, 10e9) == pytest.approx(0.8e-9)


def test_ring_cost_grows_with_workers_towards_twice_the_message():
    costs = [cost_model.ring_allreduce_seconds(1e6, n, 0.0, 1e-9) for n in (2, 4, 256)]
    assert costs == pytest.approx([1e-3, 1.5e-3, 2 * 255 / 256 * 1e-3])
    assert cost_model.ring_allreduce_seconds(4, 256, 1e-4, 0.0, messages=2) == pytest.approx(2 * 510 * 1e-4)
