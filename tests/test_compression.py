"""Gradient compression (`CommunicationOptions(compression=...)`) with real 2-worker gangs.

Per backend the suite's shared warm gang of 2 (`tests/shared_gangs.py`) runs the scenarios of
`tests/workers/fit_scenario.py` one after another (uncompressed, bf16, fp16, and the backend's
own paths), and the shared process without TF_CONFIG runs the uncompressed one (the
reference), which also records each weight's
path length `S = Σ_k |w_k+1 - w_k|` over the steps. The tests assert:

* workers are bit-identical under bf16 and under fp16 (every worker sums the same 16-bit values
  in the same order);
* compressed training stays within the rounding bound of one uncompressed process, and
  outside float32 noise (so the compression really happened);
* the bytes each worker hands its engine per step halve (`keras_mwms.backends.compression.WIRE`).

The tolerance, from `keras_mwms.backends.compression`: plain SGD (no momentum) moves a weight by
`lr · g` per step, so `S = lr · Σ_k |g_k|`. A compressed global gradient is each worker's part
rounded to 16 bits (relative error ≤ u) and their sum rounded again (≤ u): error ≤ 2u · the
parts' magnitudes. So `max |w_compressed - w_reference| ≤ C · 2u · max S` with u = 2^-8 (bf16),
2^-11 (fp16), and C = 4: a factor 2 because a worker's half-batch gradient can exceed the global
one where the two workers' parts cancel, a factor 2 for later steps carrying an early error on
(16 small SGD steps). Measured margins are in the assertion messages.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import numpy as np
import pytest

from keras_mwms.backends.compression import WireBytes, relative_rounding, wire_dtype
from keras_mwms.benchmark import compression as benchmark
from keras_mwms.communication import COMPRESSION_ENV, CommunicationOptions
from tests.shared_gangs import SHARED, SINGLE, Runner, gang
from tests.workers.common import max_weight_difference
from tests.workers.fit_scenario import load_dump

RUN_TIMEOUT = 300          # gang + reference of one backend; ~15-25 s alone on 2 cores
SAFETY = 4                 # C in the module docstring
FLOAT32_NOISE = 1e-5       # an uncompressed gang's distance from one process (tests/test_backend_*)
BASE = ["--verbose", "0", "--seed", "100", "--momentum", "0", "--evaluate-on", "training"]
SCENARIOS = {"plain": [], "bf16": ["--compression", "bf16"], "fp16": ["--compression", "fp16"],
             # torch's other gradient path: all-reduced after backward (also jit_compile, custom steps)
             "bf16_after_backward": ["--compression", "bf16", "--no-torch-overlap"],
             # torch's compiled step: the bf16 all-reduce in its graph (`gradients.averaged_in_graph`);
             # fit only: its test and predict steps would compile too
             "bf16_jit": ["--compression", "bf16", "--jit-compile", "--evaluate-on", "none"],
             # JAX's DataParallel path (a custom train_step): the step in shard_map, bf16 all-gathered
             "bf16_dataparallel": ["--compression", "bf16", "--custom-train-step"]}
COMPRESSED = {"tensorflow": ("bf16", "fp16"), "jax": ("bf16", "fp16", "bf16_dataparallel"),
              "torch": ("bf16", "fp16", "bf16_after_backward", "bf16_jit")}
WIRE_TYPE = {"bf16": "bf16", "fp16": "fp16", "bf16_after_backward": "bf16", "bf16_dataparallel": "bf16",
             "bf16_jit": "bf16"}
BACKENDS = [pytest.param("tensorflow", marks=pytest.mark.tensorflow),
            pytest.param("jax", marks=pytest.mark.jax),
            pytest.param("torch", marks=pytest.mark.torch)]


def _argv(names) -> list[str]:
    scenarios = [part for name in names for part in ("--scenario", f"{name}: {shlex.join(SCENARIOS[name])}")]
    return ["{out}", *BASE, *scenarios]


# The backend's shared warm gang of 2 runs every scenario; its shared process without TF_CONFIG
# the uncompressed one, recording path lengths (`tests/shared_gangs.py`).
for _backend, _names in COMPRESSED.items():
    SHARED.add(__name__, gang(_backend, 2), "scenarios", "fit_scenario", _argv(("plain", *_names)),
               seconds=RUN_TIMEOUT)
    SHARED.add(__name__, Runner(_backend, SINGLE), "reference", "fit_scenario", [*_argv(["plain"]), "--record-path"],
               seconds=RUN_TIMEOUT)


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, shared_runs):
    """The backend, and its folders {"gang": ..., "reference": ...} with a folder per scenario."""
    backend = request.param
    return backend, {"gang": shared_runs.folder(gang(backend, 2), __name__, "scenarios"),
                     "reference": shared_runs.folder(Runner(backend, SINGLE), __name__, "reference")}


def _dump(folders, run: str, name: str, index: int) -> dict:
    return load_dump(os.path.join(folders[run], name), index)


@pytest.mark.slow
def test_compressed_workers_are_bit_identical(runs):
    backend, root = runs
    for name in COMPRESSED[backend]:
        first, second = _dump(root, "gang", name, 0), _dump(root, "gang", name, 1)
        assert max_weight_difference(first["final"], second["final"]) == 0.0, (backend, name)
        assert first["history"] == second["history"], (backend, name)


@pytest.mark.slow
def test_compressed_training_stays_within_the_16_bit_rounding_bound(runs):
    backend, root = runs
    reference = _dump(root, "reference", "plain", 0)
    with np.load(os.path.join(root["reference"], "plain", "w0.path.npz")) as lengths:
        path = max(float(lengths[name].max()) for name in lengths.files)
    plain = max_weight_difference(_dump(root, "gang", "plain", 0)["final"], reference["final"])
    assert plain <= FLOAT32_NOISE, (backend, plain)
    for name in COMPRESSED[backend]:
        bound = SAFETY * 2 * relative_rounding(WIRE_TYPE[name]) * path
        compressed = max_weight_difference(_dump(root, "gang", name, 0)["final"], reference["final"])
        detail = (f"{backend} {name}: max |Δw| {compressed:.3g} vs one process, bound {bound:.3g} "
                  f"(max path length {path:.3g}); uncompressed gang {plain:.3g}")
        print(detail)
        assert FLOAT32_NOISE < compressed <= bound, detail


@pytest.mark.slow
def test_bf16_rounds_coarser_than_fp16(runs):
    backend, root = runs
    reference = _dump(root, "reference", "plain", 0)["final"]
    errors = {name: max_weight_difference(_dump(root, "gang", name, 0)["final"], reference)
              for name in ("bf16", "fp16")}
    assert errors["bf16"] > errors["fp16"], (backend, errors)


@pytest.mark.slow
def test_bytes_per_step_halve(runs):
    backend, root = runs
    plain = _dump(root, "gang", "plain", 0)["wire_bytes_per_step"]
    for name in COMPRESSED[backend]:
        compressed = _dump(root, "gang", name, 0)["wire_bytes_per_step"]
        # The gradients halve exactly; the exact scalars (row counts, metric states: under
        # 40 bytes here, and torch's after-backward path carries its metric states apart)
        # stay float32, on a model of ~500 gradients (~2000 bytes in float32).
        assert abs(compressed - 0.5 * plain) <= 40, (backend, name, plain, compressed)


# -- pure rules (no backend, no processes) ---------------------------------------------------
def test_options_validate_compression_and_the_environment_fills_it(monkeypatch):
    monkeypatch.delenv(COMPRESSION_ENV, raising=False)
    assert CommunicationOptions().compression is None
    assert CommunicationOptions(compression="BF16").compression == "bf16"
    with pytest.raises(ValueError, match="compression='int8' is not a gradient compression.*bf16"):
        CommunicationOptions(compression="int8")
    monkeypatch.setenv(COMPRESSION_ENV, "fp16")
    assert CommunicationOptions().compression == "fp16"
    monkeypatch.setenv(COMPRESSION_ENV, "none")
    assert CommunicationOptions().compression is None
    assert CommunicationOptions(compression="bf16").compression == "bf16"   # the argument wins
    monkeypatch.setenv(COMPRESSION_ENV, "half")
    with pytest.raises(ValueError, match=f"{COMPRESSION_ENV}='half'"):
        CommunicationOptions()


def test_only_wide_float_gradients_are_compressed():
    assert [wire_dtype("bf16", dtype) for dtype in ("float32", "float64", "float16", "bfloat16", "int32")] == [
        "bfloat16", "bfloat16", None, None, None]
    assert wire_dtype(None, "float32") is None


def test_wire_bytes_counts_issued_and_traced_collectives():
    counter = WireBytes()
    for _ in range(4):
        counter.add(1000)
    counter.trace("rows", 4)
    counter.trace("rows", 4)        # a retrace replaces, it does not add
    assert counter.per_step(steps=4) == 1004
    counter.reset()
    assert counter.per_step(steps=1) == 0


def test_benchmark_skips_without_root_and_rejects_bad_rates(monkeypatch, capsys):
    monkeypatch.setattr(benchmark.os, "geteuid", lambda: 1000)
    assert benchmark.main(["--link", "1gbit"]) == 0
    assert "skipped: network namespaces and tc need root" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark.main(["--link", "fast"])


@pytest.mark.slow
@pytest.mark.torch
def test_benchmark_halves_the_bytes_on_a_shaped_link_and_cleans_up(tmp_path):
    """The netns + tc benchmark end to end, small: torch, 1 Gbit/s, a 0.4 M-parameter MLP.

    The veth transmit counter (all bytes on the wire, headers included) halves under bf16 and
    fp16, and no namespace of the run is left behind.
    """
    reason = benchmark.not_runnable_reason()
    if reason:
        pytest.skip(reason)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    code = benchmark.main(["--link", "1gbit", "--backends", "torch", "--steps", "3", "--warmup", "1",
                           "--width", "512", "--depth", "2", "--timeout", "240", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "compression.json").read_text())
    assert code == 0, report["failures"]
    wire = {row[2]: row[5] for row in report["rows"]}
    assert set(wire) == {"none", "bf16", "fp16"}, report
    for compression in ("bf16", "fp16"):
        assert 0.45 <= wire[compression] / wire["none"] <= 0.55, (compression, wire)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert {line.split()[0] for line in after.splitlines() if line.startswith("kmc")} <= \
        {line.split()[0] for line in before.splitlines() if line.startswith("kmc")}
