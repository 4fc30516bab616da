"""The backend × fault matrix: start-up and training faults on every backend.

Each case runs real worker processes of `tests/workers/fault_scenario.py` through
`tests.multiworker.watch_gang` (the launcher's `Gang`: own process groups, `[worker i]` output,
kill on exit), watches every worker exit on its own, and asserts: the expected outcome on every live worker within a stated bound,
a message naming the worker and the cause, and no orphan process (every command line carries a
unique marker; `pgrep -f marker` must find nothing afterwards). Cases whose gangs mostly sleep
or fail fast run their three backends concurrently. The measured exit times go to a JSON table
under pytest's tmp dir and are printed (`pytest -s` shows them).

Nothing here imports keras or a backend in the pytest process.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass

import numpy as np
import pytest

from tests.multiworker import REPO, WatchedGang, concurrently, python_worker, watch_gang, worker_env

sys.path.insert(0, str(REPO / "tests" / "workers"))
import common  # noqa: E402

BACKENDS = ("tensorflow", "jax", "torch")
RENDEZVOUS_TIMEOUT = 60
TRAINING_FAULT_BOUND = 60
HARD_DEADLINE = 300
TABLE: list[dict] = []


@dataclass
class Observed(WatchedGang):
    """How each worker of one scenario gang ended, in wall-clock seconds since the epoch."""

    backend: str
    out: str
    marker: str

    def result(self, worker: int) -> dict:
        return common.load_result(self.out, worker)

    def fault_time(self) -> float:
        with open(os.path.join(self.out, "fault.json")) as handle:
            return json.load(handle)["time"]

    def log(self) -> str:
        return f"[{self.backend}] codes={self.codes}\n{self.output[-6000:]}\norphans: {self.orphans}"


def observe(backend: str, out: str, workers: int, *args: str, wait_for: set[int] | None = None,
            per_worker_env: dict[int, dict[str, str]] | None = None, deadline: float = HARD_DEADLINE,
            rendezvous_timeout: float = RENDEZVOUS_TIMEOUT) -> Observed:
    """Runs the scenario as a gang and lets every worker in `wait_for` exit *on its own*.

    Workers outside `wait_for` (a stopped one) and any worker still alive at `deadline` are
    then stopped as the launcher would (SIGTERM, SIGKILL); see `tests.multiworker.watch_gang`.
    """
    marker = f"kmwms-fault-{uuid.uuid4().hex[:12]}"
    env = worker_env(backend, lean=True, KERAS_MWMS_RENDEZVOUS_TIMEOUT=str(rendezvous_timeout))
    os.makedirs(out, exist_ok=True)
    watched = watch_gang(python_worker("fault_scenario.py", out, "--marker", marker, *args), workers,
                         deadline, env=env, wait_for=wait_for, per_worker_env=per_worker_env, marker=marker)
    with open(os.path.join(out, "gang.log"), "w") as handle:
        handle.write(watched.output)
    return Observed(**vars(watched), backend=backend, out=out, marker=marker)


def record(case: str, observed: Observed, since: float, bound: float | None, outcome: str) -> float:
    """Adds one row to the exit-time table; returns seconds from `since` to the last exit.

    `bound` None: a case that must succeed; its seconds are the whole run's (gang start to end).
    """
    seconds = max(observed.exit_times.values()) - since
    TABLE.append({"case": case, "backend": observed.backend, "seconds": round(seconds, 1),
                  "bound": bound, "outcome": outcome,
                  "exit_codes": {str(k): v for k, v in sorted(observed.codes.items())}})
    return seconds


@pytest.fixture(scope="module", autouse=True)
def exit_time_table(tmp_path_factory):
    """Writes and prints the measured exit times once the module's cases ran."""
    yield
    path = tmp_path_factory.mktemp("fault_table") / "exit_times.json"
    path.write_text(json.dumps(TABLE, indent=1))
    print(f"\nfault matrix exit times ({path}):")
    print(f"{'case':<29}{'backend':<12}{'seconds':>8}{'bound':>7}  outcome / exit codes")
    for row in TABLE:
        bound = "-" if row["bound"] is None else row["bound"]
        print(f"{row['case']:<29}{row['backend']:<12}{row['seconds']:>8}{bound:>7}  "
              f"{row['outcome']} {row['exit_codes']}")


def assert_no_orphans(observed: Observed) -> None:
    assert not observed.orphans, f"processes left behind: {observed.orphans}\n{observed.log()}"


def any_line(observed: Observed, worker: int, *needles: str) -> bool:
    """True if one output line of `worker` contains every needle."""
    return any(all(needle in line for needle in needles) for line in observed.lines(worker).splitlines())


# -- start-up -----------------------------------------------------------------------------
LATE_SECONDS = 30
# The late worker still has to import its backend after its 30 s sleep: on a loaded 2-core CI
# box that took up to 60 s, after the chief is already waiting, so the chief waits up to 180 s.
LATE_RENDEZVOUS_TIMEOUT = 180
NAN_BACKENDS = BACKENDS


MISMATCHED_BACKENDS = (("tensorflow", "jax"), ("jax", "torch"), ("torch", "tensorflow"))
BAD_HOST = "no-such-host.invalid:1"


@pytest.fixture(scope="module")
def startup_runs(tmp_path_factory):
    """Every start-up case at once (their gangs mostly wait or fail fast), keyed (kind, backends).

    * `late`: worker 1 starts 30 s late; TF_CONFIG changes after the strategy; worker 1's data
      has NaN at batch 3 (TensorFlow, torch) with TerminateOnNaN;
    * `badhost`: one live worker whose TF_CONFIG lists a second worker on an unresolvable host;
    * `mismatch`: worker 0 and worker 1 run different Keras backends.
    """
    def run(job):
        kind, backends = job
        backend = backends[0]
        out = outs[job]
        if kind == "late":
            args = ["--late-worker", "1", "--late-seconds", str(LATE_SECONDS), "--change-tf-config"]
            if backend in NAN_BACKENDS:
                args += ["--nan-worker", "1", "--at-batch", "3"]
            return observe(backend, out, 2, *args, rendezvous_timeout=LATE_RENDEZVOUS_TIMEOUT)
        if kind == "badhost":
            return observe(backend, out, 1, "--extra-host", BAD_HOST)
        return observe(backend, out, 2, per_worker_env={1: {"KERAS_BACKEND": backends[1]}})

    jobs = [("late", (backend,)) for backend in BACKENDS] + \
           [("badhost", (backend,)) for backend in BACKENDS] + \
           [("mismatch", pair) for pair in MISMATCHED_BACKENDS]
    # Made here: tmp_path_factory is not thread-safe on its first use.
    outs = {(kind, backends): str(tmp_path_factory.mktemp(f"{kind}_{'_'.join(backends)}"))
            for kind, backends in jobs}
    return concurrently(run, jobs, at_once=len(jobs))   # they mostly wait: all at once


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("backend", BACKENDS)
def test_worker_started_30_s_late_still_trains(startup_runs, backend):
    observed = startup_runs[("late", (backend,))]
    assert observed.codes == {0: 0, 1: 0}, observed.log()
    chief = observed.result(0)
    # The chief waited in the rendezvous for the late worker (30 s plus its imports).
    assert chief["strategy_seconds"] > LATE_SECONDS - 5, observed.log()
    record("late worker (30 s)", observed, observed.started, None,
           f"trained; chief waited {chief['strategy_seconds']:.0f} s in the rendezvous")
    assert_no_orphans(observed)


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("backend", BACKENDS)
def test_tf_config_changed_after_the_strategy_warns_at_fit(startup_runs, backend):
    observed = startup_runs[("late", (backend,))]
    for worker in (0, 1):
        warned = observed.result(worker)["warnings"]
        assert len(warned) == 1 and "TF_CONFIG changed after" in warned[0], observed.log()
        assert "Set TF_CONFIG before creating the strategy" in warned[0]


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("backend", NAN_BACKENDS)
def test_nan_loss_on_one_worker_stops_every_worker_at_the_same_step(startup_runs, backend):
    observed = startup_runs[("late", (backend,))]
    results = [observed.result(worker) for worker in (0, 1)]
    # TerminateOnNaN sees the global loss: both stop at batch 3 of epoch 0, no hang.
    assert [result["last_batch"] for result in results] == [[0, 3], [0, 3]], observed.log()
    assert all(np.isnan(result["history"]["loss"][0]) for result in results)
    assert any_line(observed, 0, "Batch 3", "Invalid loss") and any_line(observed, 1, "Batch 3", "Invalid loss")
    for first, second in zip(common.load_weights(observed.out, 0), common.load_weights(observed.out, 1)):
        np.testing.assert_array_equal(first, second)   # NaN == NaN here: identical bits
    record("NaN loss on worker 1", observed, observed.started, None,
           "both stopped at batch 3, weights identical")


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("backend", BACKENDS)
def test_unresolvable_host_fails_fast_naming_worker_and_host(startup_runs, backend):
    observed = startup_runs[("badhost", (backend,))]
    assert observed.codes == {0: 2}, observed.log()
    error = observed.result(0)["error"]
    assert "RendezvousError" in error and "worker:1" in error and BAD_HOST in error, error
    assert "Cannot resolve" in error
    started = observed.result(0)["strategy_started"]
    seconds = record("unresolvable host", observed, started, RENDEZVOUS_TIMEOUT + 10, "RendezvousError")
    assert seconds <= RENDEZVOUS_TIMEOUT + 10, observed.log()
    assert_no_orphans(observed)


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("pair", MISMATCHED_BACKENDS, ids="-".join)
def test_mismatched_backends_fail_fast_naming_the_field(startup_runs, pair):
    observed = startup_runs[("mismatch", pair)]
    assert all(code not in (0, None) for code in observed.codes.values()), observed.log()
    for worker in (0, 1):
        error = observed.result(worker)["error"]
        assert "RendezvousError" in error and "backend" in error, error
        assert pair[0] in error and pair[1] in error, error
    # From the moment both workers were in the rendezvous (the slower backend imports longer).
    started = max(observed.result(worker)["strategy_started"] for worker in (0, 1))
    seconds = record(f"backends {pair[0]}/{pair[1]}", observed, started, RENDEZVOUS_TIMEOUT + 10,
                     "RendezvousError names `backend`")
    assert seconds <= RENDEZVOUS_TIMEOUT + 10, observed.log()
    assert_no_orphans(observed)


LOST_WORKER_1 = "lost worker 1 (worker:1 at"
HUNG_WORKER_1 = "keras_mwms hang verdict: no answer: worker 1 did not answer"


def assert_survivor_names_worker_1(observed: Observed) -> None:
    """Worker 0 raised keras_mwms' `WorkerLostError` naming worker 1, or ended on the hang
    verdict naming it (exit 5: a stopped peer on JAX, reported before JAX's heartbeat abort)."""
    if HUNG_WORKER_1 in observed.lines(0):
        assert observed.codes[0] == 5, observed.log()
        return
    assert LOST_WORKER_1 in observed.lines(0), observed.log()
    assert "WorkerLostError" in observed.result(0)["error"], observed.log()


def survivor_outcome(observed: Observed, backend: str) -> str:
    """Asserts that worker 0 said why it stopped after losing worker 1; returns how, for the table.

    Either keras_mwms' `WorkerLostError` naming worker 1, or (JAX only) JAX's own abort: its
    coordination service may abort the survivor (SIGABRT) when a peer stops heartbeating,
    before keras_mwms can raise; then only JAX's words name the task, if any.
    `assert_survivor_names_worker_1` is the strict check.
    """
    output = observed.lines(0)
    if HUNG_WORKER_1 in output:
        assert observed.codes[0] == 5, observed.log()
        return "survivor: the hang verdict names worker 1"
    if LOST_WORKER_1 in output:
        assert "WorkerLostError" in observed.result(0)["error"], observed.log()
        return "survivor: WorkerLostError names worker 1"
    assert backend == "jax", observed.log()
    assert "JAX distributed service detected fatal errors" in output, observed.log()
    if "stopped sending heartbeats" in output:
        assert "unhealthy (stopped sending heartbeats):\n1\n" in output, observed.log()
        return "survivor aborted by JAX: 'tasks are unhealthy: 1' (not a WorkerLostError)"
    return "survivor aborted by JAX (shutdown barrier failed; worker 1 not named)"


# -- training -----------------------------------------------------------------------------
UNEVEN_BACKENDS = BACKENDS
STOPPED_BACKENDS = ("tensorflow", "jax")   # torch: test_backend_torch.py::test_hung_peer_...
# JAX's heartbeat timeout follows `timeout_seconds`; here it is 30 s, as a user bounds a hang:
# the hang report, its threshold kept 15 s below that, names the stopped worker within
# TRAINING_FAULT_BOUND (before: JAX's own abort, SIGABRT, ended the survivor without naming it).
SIGSTOP_ARGUMENTS = {"jax": ("--timeout", "30")}


@pytest.fixture(scope="module")
def training_runs(tmp_path_factory):
    """Training faults, all gangs at once, keyed (kind, backend).

    * `raise`: a first fit with uneven arrays on worker 1 (TensorFlow, torch: must be a clear
      error on both workers), then a fit where a callback raises on worker 1 at batch 3;
    * `sigstop`: worker 1 SIGSTOPs itself at batch 3 (TensorFlow, JAX); the survivor must end
      alone, then the gang is stopped as the launcher does (which kills the stopped one).
    """
    def run(job):
        kind, backend = job
        out = outs[job]
        if kind == "sigstop":
            return observe(backend, out, 2, "--stop-worker", "1", "--at-batch", "3",
                           *SIGSTOP_ARGUMENTS.get(backend, ()), wait_for={0})
        uneven = ["--uneven-worker", "1", "--uneven-rows", "200"] if backend in UNEVEN_BACKENDS else []
        return observe(backend, out, 2, "--raise-worker", "1", "--at-batch", "3", *uneven)

    jobs = [("raise", backend) for backend in BACKENDS] + [("sigstop", backend) for backend in STOPPED_BACKENDS]
    outs = {(kind, backend): str(tmp_path_factory.mktemp(f"{kind}_{backend}")) for kind, backend in jobs}
    return concurrently(run, jobs, at_once=len(jobs))   # they mostly wait: all at once


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("backend", BACKENDS)
def test_callback_raising_on_one_worker_stops_every_worker(training_runs, backend):
    observed = training_runs[("raise", backend)]
    assert all(code not in (0, None) for code in observed.codes.values()), observed.log()
    assert "injected failure in a callback on worker 1" in observed.result(1)["error"], observed.log()
    # JAX too: the raising worker leaves without JAX's shutdown barrier, so the survivor's
    # collective fails at once and it names the lost worker.
    assert_survivor_names_worker_1(observed)
    seconds = record("raise in callback, worker 1", observed, observed.fault_time(),
                     TRAINING_FAULT_BOUND, survivor_outcome(observed, backend))
    assert seconds <= TRAINING_FAULT_BOUND, observed.log()
    assert_no_orphans(observed)


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("backend", UNEVEN_BACKENDS)
def test_uneven_arrays_are_a_clear_error_on_every_worker(training_runs, backend):
    observed = training_runs[("raise", backend)]
    for worker in (0, 1):
        result = observed.result(worker)
        error = result["uneven_error"]
        assert error and error.startswith(
            f"ValueError: keras_mwms worker {worker}: model.fit() got different data"), observed.log()
        assert "worker 0: 256 rows, worker 1: 200 rows" in error, error
        assert result["uneven_seconds"] <= TRAINING_FAULT_BOUND
    seconds = max(observed.result(worker)["uneven_seconds"] for worker in (0, 1))
    TABLE.append({"case": "uneven arrays, worker 1", "backend": backend, "seconds": round(seconds, 1),
                  "bound": TRAINING_FAULT_BOUND, "outcome": "ValueError on both before step 1 "
                  "(time to the error; the run then continued)", "exit_codes": {}})


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.parametrize("backend", STOPPED_BACKENDS)
def test_hung_worker_makes_the_survivor_exit_within_60_s_saying_why(training_runs, backend):
    observed = training_runs[("sigstop", backend)]
    assert observed.codes[0] not in (0, None), observed.log()
    assert observed.codes[1] is None   # still stopped when the survivor ended: killed by the stop
    seconds = record("SIGSTOP worker 1", observed, observed.fault_time(), TRAINING_FAULT_BOUND,
                     survivor_outcome(observed, backend) + "; stopped one killed")
    assert seconds <= TRAINING_FAULT_BOUND, observed.log()
    assert_no_orphans(observed)


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.parametrize("backend", STOPPED_BACKENDS)
def test_hung_worker_is_named_by_the_survivor(training_runs, backend):
    assert_survivor_names_worker_1(training_runs[("sigstop", backend)])
