"""`python -m keras_mwms.benchmark`: pure parts (formulas, tables, plan, CLI) and one tiny real run.

The real run starts actual worker gangs (torch, the fastest backend to import) through the
benchmark driver, in a subprocess, and checks that the table, JSON and PNG come out with sane
(positive, finite) numbers. The pytest process never imports a Keras backend.
"""

from __future__ import annotations

import doctest
import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from keras_mwms import cli
from keras_mwms.benchmark import analysis, bandwidth, command, config, report, runner, torch_variants

REPO = Path(__file__).resolve().parent.parent
PURE_MODULES = ["config", "bandwidth", "models", "timing", "allreduce", "analysis", "report", "runner",
                "peers", "worker", "cost_model", "scaling"]


@pytest.mark.parametrize("name", PURE_MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(f"keras_mwms.benchmark.{name}"),
                             optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0


def test_ring_bound_matches_nccl_tests_convention():
    # 4 workers: each sends and receives 2(n-1)/n = 1.5 times the message.
    assert bandwidth.ring_lower_bound_seconds(64 * 2**20, 4, 1e9) == pytest.approx(1.5 * 64 * 2**20 / 1e9)
    assert bandwidth.bus_bandwidth(1e9, 8) == pytest.approx(1.75e9)


def test_loopback_probe_measures_a_plausible_bandwidth():
    measured = bandwidth.loopback_tcp_bandwidth(16 * 2**20)
    assert 1e6 < measured < 1e12


def test_iterations_are_bounded_and_identical_for_every_worker():
    quick = config.quick_config()
    counts = [quick.iterations_for(size) for size in config.FULL_SIZES]
    assert counts == sorted(counts, reverse=True)
    assert min(counts) == quick.min_iterations and max(counts) == quick.max_iterations


def test_command_line_presets_and_overrides():
    parser = command.build_parser()
    quick = command.config_from_arguments(parser.parse_args(["--quick", "--backends", "torch,jax"]), parser)
    assert quick.quick and quick.backends == ("torch", "jax") and quick.sizes == config.QUICK_SIZES
    full = command.config_from_arguments(parser.parse_args(["allreduce", "--sizes", "4096,8192"]), parser)
    assert full.sections == ("allreduce",) and full.sizes == (4096, 8192) and full.models == ("mlp", "conv")
    assert not full.ledger_comparison
    ledger = command.config_from_arguments(parser.parse_args(["fit", "--no-ledger"]), parser)
    assert ledger.ledger_comparison and config.BenchmarkConfig.from_json(ledger.to_json()) == ledger


@pytest.mark.parametrize("arguments, message", [
    (["--workers", "1"], "--workers must be at least 2"),
    (["--workers", "3", "--global-batch", "256"], "must divide evenly"),
    (["--backends", "mxnet"], "unknown backend"),
    (["--sizes", "2"], "byte counts >= 4"),
])
def test_command_line_errors_say_what_to_fix(arguments, message, capsys):
    parser = command.build_parser()
    with pytest.raises(SystemExit):
        command.config_from_arguments(parser.parse_args(arguments), parser)
    assert message in capsys.readouterr().err


def test_keras_mwms_command_lists_benchmark(capsys):
    assert cli.main(["--help"]) == 0
    assert "benchmark" in capsys.readouterr().out


def test_plan_runs_tensorflow_peers_in_their_own_gang():
    names = [gang.name for gang in runner.plan(config.full_config(workers=3))]
    assert names == ["tensorflow-1w-keras_mwms", "tensorflow-3w-keras_mwms", "tensorflow-3w-tensorflow_native",
                     "jax-1w-keras_mwms", "jax-3w-keras_mwms", "torch-1w-keras_mwms", "torch-3w-keras_mwms"] + (
                         ["torch-3w-keras_nightly"] if torch_variants.nightly_overlay() else [])


def test_failed_gangs_are_left_out_of_the_figures():
    failed = {"ok": False, "backend": "torch", "workers": 2, "role": "keras_mwms", "results": []}
    assert analysis.fit_rows([failed]) == [] and analysis.allreduce_tables([failed], 1e9) == {}


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    arguments = ["--quick", "--backends", "torch", "--workers", "2", "--width", "64", "--depth", "1",
                 "--global-batch", "64", "--steps", "25", "--warmup-steps", "5", "--sizes", "4096,65536",
                 "--timeout", "240", "--out", str(out)]
    completed = subprocess.run([sys.executable, "-m", "keras_mwms.benchmark", *arguments], cwd=REPO,
                               capture_output=True, text=True, timeout=540)
    assert completed.returncode == 0, f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
    return out, completed.stdout, json.loads((out / "benchmark.json").read_text())


@pytest.mark.torch
@pytest.mark.slow
def test_tiny_run_prints_the_tables(tiny_run):
    _, stdout, _ = tiny_run
    for title in ("all-reduce, torch, 2 workers", "fit (batch", "per-step sync overhead",
                  "ratio keras_mwms / native", "alpha-beta fit", "projected step ms"):
        assert title in stdout
    assert "torch DDP loop" in stdout


@pytest.mark.torch
@pytest.mark.slow
def test_tiny_run_writes_sane_json(tiny_run):
    _, _, result = tiny_run
    assert all(gang["ok"] for gang in result["gangs"])
    assert result["machine"]["loopback_tcp_bytes_per_second"] > 0
    rows = result["allreduce"]["torch"]
    assert [row["label"] for row in rows] == ["latency", "sweep", "sweep", "gradients:mlp"]
    assert all(row["correct"] and row["time_us"] > 0 and row["busbw_gbps"] > 0 for row in rows)
    assert {(row["workers"], row["variant"]) for row in result["fits"]} == {
        (1, "keras_mwms"), (1, "torch DDP loop"), (1, "plain Keras"), (2, "keras_mwms"), (2, "torch DDP loop")}
    assert all(row["steps_per_second"] > 0 for row in result["fits"])
    assert {row["workers"] for row in result["ratios"]} == {1, 2}
    assert all(row["ratio"] > 0 for row in result["ratios"])
    assert all(row["sync_overhead_ms"] is not None and row["graph_breaks"] is None   # eager only in --quick
               for row in result["ratios"] if row["workers"] == 2 and row["ours"] == "keras_mwms")
    assert [row["variant"] for row in result["overhead"]] == ["keras_mwms", "torch DDP loop"]
    assert all(row["allreduce_ms"] > 0 for row in result["overhead"])
    assert all(math.isfinite(number) for number in _numbers(result))
    assert result["threads_per_process"] >= 1
    scaling = result["scaling"]                      # the alpha-beta model from the 2-worker gang
    engine = scaling["engines"]["torch"]
    # Non-negative and not degenerate. With these tiny, latency-bound sizes (4 KiB, 64 KiB and a
    # small MLP's gradients) noise can make β fit to 0; tests/test_cost_model.py checks the fit itself.
    assert engine["fitted_from"] == [2] and engine["alpha_us"] >= 0 and engine["beta_ns"] >= 0
    assert engine["alpha_us"] + engine["beta_ns"] > 0
    assert [row["workers"] for row in scaling["measured"]] == [2] and "error_percent" in scaling["measured"][0]
    assert scaling["projection"] and all(0 < row["efficiency"] <= 1 for row in scaling["projection"])


@pytest.mark.torch
@pytest.mark.slow
def test_tiny_run_writes_a_png(tiny_run):
    out, _, _ = tiny_run
    for name in ("benchmark.png", "scaling.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_tables_render_missing_values_as_dashes():
    text = report.format_table(["a", "b"], [["x", None], ["y", float("nan")]])
    assert text.splitlines()[2].endswith("-") and "nan" in text


def test_torch_jit_variant_gets_its_own_ratio_rows_and_the_nightly_gang_is_planned_or_named():
    def fit(variant, workers, speed, batch=256):
        return {"backend": "torch", "model": "mlp", "workers": workers, "variant": variant, "global_batch": batch,
                "steps_per_second": speed, "startup_seconds": None, "first_step_seconds": 1.0}

    fits = [fit("keras_mwms", 2, 40.0), fit(torch_variants.OURS_JIT, 2, 50.0), fit("torch DDP loop", 2, 50.0),
            fit(torch_variants.TORCH_DDP_COMPILED, 2, 40.0), fit(torch_variants.KERAS_NIGHTLY, 2, 25.0),
            fit("keras_mwms", 1, 60.0), fit(torch_variants.OURS_JIT, 1, 70.0), fit(torch_variants.PLAIN_KERAS, 1, 60.0)]
    ratios = {(row["ours"], row["peer"], row["workers"]): row["ratio"] for row in analysis.ratio_rows(fits)}
    assert ratios == {("keras_mwms", "torch DDP loop", 2): 0.8, ("keras_mwms", torch_variants.TORCH_DDP_COMPILED, 2): 1.0,
                      ("keras_mwms", torch_variants.KERAS_NIGHTLY, 2): 1.6,
                      (torch_variants.OURS_JIT, "torch DDP loop", 2): 1.0,
                      (torch_variants.OURS_JIT, torch_variants.TORCH_DDP_COMPILED, 2): 1.25,
                      (torch_variants.OURS_JIT, torch_variants.KERAS_NIGHTLY, 2): 2.0,
                      ("keras_mwms", torch_variants.PLAIN_KERAS, 1): 1.0}   # item 5: one process vs plain Keras
    assert "[ours: keras_mwms jit_compile]" in report.ratios_text(analysis.ratio_rows(fits))
    # Issue 36 item 4: graph breaks of the compiled fit and the sync overhead ride in every ratio row.
    fits[1]["graph_breaks"], fits[1]["recompile_limit_hits"] = 5, 0
    overhead = [{"backend": "torch", "model": "mlp", "workers": 2, "variant": torch_variants.OURS_JIT,
                 "global_batch": 256, "sync_overhead_ms": 7.0, "overhead_vs_allreduce": 3.5}]
    row = next(row for row in analysis.ratio_rows(fits, overhead) if row["ours"] == torch_variants.OURS_JIT)
    assert (row["graph_breaks"], row["sync_overhead_ms"], row["overhead_vs_allreduce"]) == (5, 7.0, 3.5)
    assert row["recompile_limit_hits"] == 0   # every compiled fit compiled its own step
    assert "graph breaks" in report.ratios_text([row]) and "3.50x" in report.ratios_text([row])
    full, quick = config.full_config(backends=("torch",)), config.quick_config(backends=("torch",))
    assert torch_variants.nightly_gang_wanted(full, "torch") == (torch_variants.nightly_overlay() is not None)
    assert not torch_variants.nightly_gang_wanted(quick, "torch")   # bench-quick keeps its budget
    assert "make keras-nightly" in torch_variants.NIGHTLY_MISSING


def test_one_process_ratio_is_reported_for_every_backend():
    fits = [{"backend": backend, "model": "mlp", "workers": 1, "variant": variant, "global_batch": 128,
             "steps_per_second": speed, "startup_seconds": None, "first_step_seconds": 0.1}
            for backend, plain in analysis.PLAIN_KERAS_ONE_PROCESS.items()
            for variant, speed in (("keras_mwms", 40.0), (plain, 50.0))]
    rows = analysis.one_process_rows(fits)
    assert [(row["backend"], row["ratio"]) for row in rows] == [("jax", 0.8), ("tensorflow", 0.8), ("torch", 0.8)]
    text = report.one_process_text(rows)
    assert text.startswith("one worker of keras_mwms / plain Keras, one process")
    assert text.count("0.80x") == 3
