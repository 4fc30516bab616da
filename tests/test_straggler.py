"""Straggler attribution (issue 21, item 3): the rule, then one real gang per backend.

Each gang (`tests/workers/hang_scenario.py --fault none`) runs a warm-up fit, a fit of 2
epochs as it is, then a fit of 2 epochs where worker 1's PyDataset sleeps 50 ms per batch.
The chief's epoch reports must name nobody in the plain fit and worker 1 in every epoch of the
delayed one; `keras_mwms.callbacks.TensorBoard` on the chief writes the per-worker times; with
`--report` the chief prints every epoch's table (also "straggler: none") and the launcher its
end-of-run table (without it, a healthy run prints neither: `tests/test_quiet_runs.py`). Nothing here imports keras or a backend in the pytest
process.
"""

from __future__ import annotations

import glob
import os
import sys
import uuid

import pytest

from keras_mwms.diagnostics.straggler import (
    PRINT_MIN_SECONDS,
    REPORT_ENV,
    format_report,
    stragglers,
    worth_printing,
)
from tests.multiworker import REPO, WORKERS_DIR, concurrently, run_launcher, selected_params, worker_env

sys.path.insert(0, str(REPO / "tests" / "workers"))
import common  # noqa: E402

BACKENDS = ("tensorflow", "jax", "torch")
DELAY = 0.05
EPOCHS = 2
BATCHES = 16


def test_the_straggler_is_the_worker_whose_own_work_exceeds_the_median():
    even = {worker: {"data": 0.01, "compute": 0.30, "collective": 0.2, "steps": 16} for worker in range(4)}
    assert stragglers(even) == []
    slow = {**even, 2: {"data": 0.9, "compute": 0.30, "collective": 0.01, "steps": 16}}
    assert stragglers(slow) == [2]
    # 30 % slower but only 1 ms per step: noise, not a straggler.
    tiny = {0: {"data": 0.0, "compute": 0.050, "collective": 0, "steps": 16},
            1: {"data": 0.0, "compute": 0.066, "collective": 0, "steps": 16}}
    assert stragglers(tiny) == []
    assert stragglers({0: even[0]}) == []
    text = format_report(1, slow, [2], missing=[5])
    assert "straggler: worker 2" in text and "worker 5: no times arrived" in text
    assert text.startswith("keras_mwms epoch 2:")   # numbered as Keras' "Epoch 2/N"


def test_a_table_is_printed_when_it_names_someone_or_on_request(monkeypatch):
    monkeypatch.delenv(REPORT_ENV, raising=False)
    assert worth_printing([1], []) and worth_printing([], [1])
    assert not worth_printing([], [])
    slow = {0: {"data": 0.0, "compute": 0.30}, 1: {"data": 0.9, "compute": 0.30}}
    jitter = {0: {"data": 0.0, "compute": 0.030}, 1: {"data": 0.0, "compute": 0.080}}
    assert worth_printing([1], [], slow) and not worth_printing([1], [], jitter)
    monkeypatch.setenv(REPORT_ENV, "1")
    assert worth_printing([], [])


def _run(backend: str, out: str):
    marker = f"kmwms-straggler-{uuid.uuid4().hex[:12]}"
    return run_launcher(["--workers", "2", "--grace-period", "3", "--report"],
                        [str(WORKERS_DIR / "hang_scenario.py"), out, "--fault", "none", "--delay", str(DELAY),
                         "--epochs", str(EPOCHS), "--batches", str(BATCHES), "--tensorboard",
                         os.path.join(out, "tb"), "--marker", marker],
                        timeout=240, env=worker_env(backend, lean=True))


@pytest.fixture(scope="module")
def straggler_runs(request, tmp_path_factory):
    """The selected backends' runs, all at once."""
    backends = selected_params(request, "backend")
    outs = {backend: str(tmp_path_factory.mktemp(f"straggler_{backend}")) for backend in backends}
    runs = concurrently(lambda backend: _run(backend, outs[backend]), backends)
    return {backend: (run, outs[backend]) for backend, run in runs.items()}


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_chief_names_the_slow_worker_every_epoch_and_nobody_without_a_delay(straggler_runs, backend):
    result, out = straggler_runs[backend]
    log = f"--- launcher\n{result.launcher_log[-3000:]}\n--- workers\n{result.output[-6000:]}"
    assert result.returncode == 0, log
    reports = common.load_result(out, 0)["epoch_reports"]
    plain = [report for report in reports if report["fit"] == "plain"]
    delayed = [report for report in reports if report["fit"] == "delayed"]
    assert [report["epoch"] for report in plain] == [0, 1], log
    assert [report["epoch"] for report in delayed] == [0, 1], log
    # Without a delay nobody is named, or only by jitter below what a user is ever shown
    # (`PRINT_MIN_SECONDS`): three gangs share 2 cores here, so a worker descheduled for 0.14 s
    # of an epoch once crossed the 20 %-and-5-ms-per-step naming rule (CI, torch, stop 41).
    for report in plain:
        own = {int(worker): times["data"] + times["compute"] for worker, times in report["times"].items()}
        assert all(own[worker] - min(own.values()) < PRINT_MIN_SECONDS for worker in report["stragglers"]), plain
    assert all(report["stragglers"] == [1] for report in delayed), delayed
    for report in delayed:   # worker 1 waited for its data; worker 0 waited for worker 1
        slow, fast = report["times"]["1"], report["times"]["0"]
        assert slow["data"] >= 0.8 * DELAY * BATCHES, report
        if backend != "tensorflow":
            # On TensorFlow the step is one in-graph entry that also waits for the prefetched
            # batch, so its "collective" seconds hold worker 1's own data wait as well.
            assert fast["collective"] > slow["collective"], report
    assert "straggler: worker 1" in result.output
    if any(report["stragglers"] == [] for report in plain):   # `--report`: every epoch's table prints
        assert "straggler: none" in result.output
    # The chief's TensorBoard has the per-worker times; nobody else wrote any.
    events = glob.glob(os.path.join(out, "tb", "**", "events.out.tfevents.*"), recursive=True)
    written = b"".join(open(path, "rb").read() for path in events)
    assert b"keras_mwms/worker_1/data_seconds" in written and b"keras_mwms/worker_0/straggler" in written
    # The launcher's end-of-run table: worker 1's data wait is the job's.
    table = [line for line in result.launcher_log.splitlines() if line.startswith("[launcher]   worker ")]
    assert len(table) == 2, result.launcher_log
    data_seconds = {int(line.split()[2]): float(line.split()[4]) for line in table}
    assert data_seconds[1] >= 0.8 * DELAY * BATCHES * EPOCHS > data_seconds[0], result.launcher_log
