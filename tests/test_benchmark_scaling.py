"""`keras_mwms.benchmark.scaling`: the sweep's analysis, tables and plot over a synthetic run (pure, fast).

The synthetic run is generated from a known α-β model, so the analysis must find that model
again and predict the measured points exactly; the real sweep is `--workers 2,3,4` (see
docs/performance.md), too long for CI.
"""

from __future__ import annotations

import json
import math

import pytest

from keras_mwms.benchmark import command, cost_model, scaling
from keras_mwms.benchmark.config import quick_config
from keras_mwms.benchmark.models import parameter_count

ALPHA, BETA, COMPUTE, CORES, THREADS = 150e-6, 1.2e-9, 0.020, 2, 1
LOOPBACK = 4e9


def _gang(backend, workers, role, sizes):
    rows = [{"label": label, "bytes": size, "iterations": 5, "correct": True,
             "seconds": cost_model.ring_allreduce_seconds(size, workers, ALPHA, BETA)} for label, size in sizes]
    return {"ok": True, "backend": backend, "workers": workers, "role": role,
            "results": [{"worker_index": index, "allreduce": rows} for index in range(workers)]}


@pytest.fixture
def sweep():
    config = quick_config(backends=("jax", "torch"), models=("mlp", "conv"), workers=2, scaling_workers=(3, 4))
    batch = scaling.per_worker_batch(config)
    sizes = [("latency", 4)] + [("sweep", size) for size in config.sizes] + [
        (f"gradients:{model}", 4 * parameter_count(config, model)) for model in config.models]
    gangs = [_gang(backend, n, "keras_mwms" if n == 2 else scaling.ROLE, sizes)
             for backend in config.backends for n in (2, 3, 4)]
    fits = []
    for backend in config.backends:
        for model in config.models:
            gradient_bytes = 4 * parameter_count(config, model)
            messages = scaling.messages_per_step(backend, gradient_bytes)
            fits.append({"backend": backend, "model": model, "workers": 1, "variant": "keras_mwms",
                         "global_batch": batch, "steps_per_second": 1 / COMPUTE})
            for n in (2, 3, 4):
                step = cost_model.step_seconds(
                    COMPUTE * cost_model.oversubscription(n, THREADS, CORES),
                    cost_model.ring_allreduce_seconds(gradient_bytes, n, ALPHA, BETA, messages),
                    overlapped=backend in scaling.OVERLAPPED)
                fits.append({"backend": backend, "model": model, "workers": n, "variant": "keras_mwms",
                             "global_batch": n * batch, "steps_per_second": 1 / step})
    machine = {"cores": CORES, "loopback_tcp_bytes_per_second": LOOPBACK}
    return config, scaling.analyse(gangs, fits, config, machine, THREADS)


def test_the_fit_finds_the_generating_model_from_the_counts_that_fit_the_cores(sweep):
    _, section = sweep
    for engine in section["engines"].values():
        assert engine["fitted_from"] == [2]            # 3 and 4 processes oversubscribe 2 cores
        assert engine["alpha_us"] == pytest.approx(ALPHA * 1e6, rel=1e-6)
        assert engine["beta_ns"] == pytest.approx(BETA * 1e9, rel=1e-6)
        assert all(abs(check["error_percent"]) < 1e-3 for check in engine["checks"])  # time_us is rounded to ns
    assert [entry["factor"] for entry in section["oversubscription"]] == [1.0, 1.5, 2.0]


def test_the_one_element_latency_row_stays_out_of_the_fit_when_sizes_suffice():
    def row(label, size, seconds):
        return {"label": label, "bytes": size, "time_us": seconds * 1e6}

    ring = [row("sweep", size, cost_model.ring_allreduce_seconds(size, 2, ALPHA, BETA)) for size in (4096, 1 << 20)]
    fast_latency = row("latency", 4, ALPHA / 2)          # engines shortcut a one-element message
    engine = scaling.fit_engines({"torch": {2: [fast_latency, *ring]}}, THREADS, CORES)["torch"]
    assert engine["alpha_us"] == pytest.approx(ALPHA * 1e6) and engine["samples"] == 2
    assert engine["checks"][0]["error_percent"] == pytest.approx(300.0, rel=1e-3)  # still checked: 4x its time
    alone = scaling.fit_engines({"torch": {2: [fast_latency, ring[1]]}}, THREADS, CORES)["torch"]
    assert alone["samples"] == 2 and alone["alpha_us"] < ALPHA * 1e6   # too few sizes: it joins the fit


def test_measured_points_carry_the_model_error_and_efficiency(sweep):
    _, section = sweep
    rows = section["measured"]
    assert len(rows) == 2 * 2 * 3                       # backends x models x counts
    for row in rows:
        assert row["form"] == ("overlapped" if row["backend"] == "torch" else "serial")
        assert abs(row["error_percent"]) < 1e-3
        assert 0 < row["measured_efficiency"] <= 1 and row["compute_ms"] == pytest.approx(20.0)
    four = [row for row in rows if row["workers"] == 4 and row["backend"] == "jax"]
    assert all(row["measured_efficiency"] < 0.5 for row in four)   # 2x oversubscribed compute


def test_projection_covers_8_to_256_workers_at_three_link_speeds(sweep):
    _, section = sweep
    rows = section["projection"]
    assert {row["workers"] for row in rows} == set(cost_model.PROJECTED_WORKERS)
    assert {row["link_gbits"] for row in rows} == set(cost_model.LINK_GBITS)
    assert len(rows) == (1 + 2) * 2 * 3 * 6            # (jax serial, torch overlapped + serial) x models x ...
    assert {(row["backend"], row["form"]) for row in rows if row["primary"]} == {
        ("jax", "serial"), ("torch", "overlapped")}
    for overlapped, serial in zip(*([row for row in rows if row["backend"] == "torch" and row["form"] == form]
                                    for form in ("overlapped", "serial"))):
        assert overlapped["step_ms"] <= serial["step_ms"]
    assert all(0 < row["efficiency"] <= 1 for row in rows)
    json.dumps(section)                                  # the report's JSON holds it as is
    assert all(math.isfinite(row["step_ms"]) for row in rows)


def test_tables_say_which_counts_are_oversubscribed(sweep):
    _, section = sweep
    printed = scaling.text(section)
    assert "n=2: 2 processes x 1 thread(s) = 2 on 2 cores," in printed
    assert "n=3: 3 processes x 1 thread(s) = 3 on 2 cores (OVERSUBSCRIBED 1.5x)" in printed
    assert "n=4: 4 processes x 1 thread(s) = 4 on 2 cores (OVERSUBSCRIBED 2x)" in printed
    for title in ("alpha-beta fit", "measured vs the model", "projected step ms", "n=256", "100 Gbit/s"):
        assert title in printed


def test_the_plot_is_written(sweep, tmp_path):
    _, section = sweep
    path = scaling.write_plot(section, "test machine", tmp_path)
    assert path == tmp_path / "scaling.png" and path.read_bytes().startswith(b"\x89PNG")


def test_workers_option_takes_a_sweep():
    parser = command.build_parser()
    swept = command.config_from_arguments(parser.parse_args(["fit", "--workers", "4,2,3,2"]), parser)
    assert (swept.workers, swept.scaling_workers, swept.sections) == (2, (3, 4), ("fit",))
    assert scaling.worker_counts(swept) == (2, 3, 4)
    single = command.config_from_arguments(parser.parse_args(["--workers", "2"]), parser)
    assert (single.workers, single.scaling_workers) == (2, ())


@pytest.mark.parametrize("text, message", [("2,x", "comma-separated counts"), ("1,2", "at least 2")])
def test_workers_option_errors_say_what_to_fix(text, message, capsys):
    parser = command.build_parser()
    with pytest.raises(SystemExit):
        command.config_from_arguments(parser.parse_args(["--workers", text]), parser)
    assert message in capsys.readouterr().err


def test_an_all_reduce_only_run_fits_but_projects_nothing(tmp_path):
    config = quick_config(backends=("jax", "torch"), sections=("allreduce",), scaling_workers=(3,))
    gangs = [_gang("jax", 2, "keras_mwms", [("sweep", 4096), ("sweep", 1 << 20)]),
             _gang("torch", 2, "keras_mwms", [("latency", 4)])]          # one size: alpha and beta unknowable
    section = scaling.analyse(gangs, [], config, {"cores": CORES, "loopback_tcp_bytes_per_second": LOOPBACK},
                              THREADS)
    assert section["engines"]["jax"]["alpha_us"] == pytest.approx(ALPHA * 1e6, rel=1e-4)
    assert "at least 2 all-reduce rows" in section["engines"]["torch"]["error"]
    assert section["measured"] == [] and section["projection"] == []
    printed = scaling.text(section)
    assert "no fit: fit_alpha_beta needs" in printed and "projected step ms" not in printed
    assert scaling.write_plot(section, "test machine", tmp_path) is None
