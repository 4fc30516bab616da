"""Hang reports (issue 21): the ledger, the verdict rules, and real gangs on every backend.

The gang cases run `tests/workers/hang_scenario.py` through the real launcher
(`python -m keras_mwms.launch`, `tests.multiworker.run_launcher`) with a 3 s hang threshold
(`KERAS_MWMS_HANG_REPORT_SECONDS=3`): worker 1 (a) sleeps 30 s making batch 3 of its input,
(b) runs one extra `train_on_batch` (a desync; inside `with strategy:` and before a shuffled
fit, where TensorFlow raised "Collective instance … expected type 0 and data_type 1 but got
type 0 and data_type 9" and no verdict before issue 31), (b') runs that `train_on_batch` in a
callback's `on_epoch_end` inside `fit` (TensorFlow's mismatch then came with fit's own step and
collective numbers: raw `InternalError`, no verdict, before issue 44), (c) is SIGSTOPped at
batch 3; and (d) the chief alone calls `model.evaluate` (`if strategy.is_chief:`) while worker
1's script ends. Each gang must end non-zero within threshold + 15 s of the fault, the chief's verdict
must name the worker and the kind (and the batch for (a)), and the launcher must print the same
verdict, line for line; in (d) worker 1 must have finished its script. The fifteen gangs run
three at a time (they mostly wait); their times go to a table printed at the end
(`pytest -s`). Nothing here imports keras or a backend in the pytest process.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass

import pytest

from keras_mwms.diagnostics import verdict as verdicts
from keras_mwms.diagnostics.channel import Channel, decode, encode
from keras_mwms.diagnostics.ledger import Ledger, counted_in_graph
from keras_mwms.diagnostics.watchdog import Watchdog
from keras_mwms.launch import find_free_ports
from tests.multiworker import REPO, WORKERS_DIR, concurrently, run_launcher, selected_params, worker_env

BACKENDS = ("tensorflow", "jax", "torch")
FAULTS = ("data", "desync", "callback-desync", "sigstop", "chief-evaluate")
EXTRA_ARGUMENTS = {"desync": ["--shuffle", "--with-block"], "callback-desync": ["--epochs", "2"]}
THRESHOLD = 3
BOUND = THRESHOLD + 15
AT_BATCH = 3
GANG_TIMEOUT = 240
TABLE: list[dict] = []


# -- the ledger and the verdict, without processes -------------------------------------------
def test_the_ledger_numbers_collectives_once_each_and_keeps_the_last_ones():
    ledger = Ledger(capacity=3)
    for _ in range(5):
        with ledger.train_step():
            with ledger.collective("gradient all-reduce", 64):
                with ledger.collective("inner bucket", 8):   # nested: the same collective
                    pass
    entries = ledger.last_entries()
    assert [entry.sequence for entry in entries] == [3, 4, 5]
    assert {entry.kind for entry in entries} == {"gradient all-reduce"}
    assert ledger.step == 5 and ledger.totals["steps"] == 5


def test_the_ledger_times_data_compute_and_collectives_apart():
    ledger = Ledger()

    def fit():
        with ledger.data(0):
            time.sleep(0.05)
        with ledger.train_step(caller=1):
            time.sleep(0.02)
            with ledger.collective("gradient all-reduce"):
                time.sleep(0.04)

    fit()
    assert ledger.call == "fit"
    assert 0.045 <= ledger.totals["data"] < 0.2
    assert 0.035 <= ledger.totals["collective"] < 0.2
    assert 0.015 <= ledger.totals["compute"] < 0.035 + 0.05


def test_an_in_graph_step_is_one_entry_and_is_wrapped_once():
    ledger = Ledger()
    step = counted_in_graph(lambda: None, ledger)
    assert counted_in_graph(step, ledger) is step

    def train_on_batch():
        step()

    train_on_batch()
    assert [(entry.kind, entry.step) for entry in ledger.last_entries()] == [
        ("train step (in-graph collectives)", 1)]
    assert ledger.call == "train_on_batch"


def test_a_disabled_ledger_records_nothing():
    ledger = Ledger(enabled=False)
    with ledger.train_step(), ledger.collective("x"):
        pass
    assert (ledger.sequence, ledger.step, ledger.last_entries()) == (0, 0, [])


def _report(worker, sequence, step, kind="gradient all-reduce", waiting=True, call="fit", data=None):
    current = {"sequence": sequence, "kind": kind, "nbytes": 8, "step": step, "seconds": 4.0}
    return {"worker": worker, "threshold": 3.0, "call": call, "stack": ["  File x, line 1\n"],
            "ledger": {"sequence": sequence, "step": step, "phase": "all-reduce" if waiting else "callback",
                       "data": data, "in_collective": current if waiting else None,
                       "entries": [[sequence, kind, 8, step, "all-reduce", 0.1]]}}


def test_verdict_rules():
    assert verdicts.decide({0: _report(0, 5, 2), 1: _report(1, 5, 2)}, 2) is None
    missing = verdicts.decide({0: _report(0, 5, 2)}, 3)
    assert (missing.kind, missing.workers) == ("no answer", [1, 2])
    data = verdicts.decide({0: _report(0, 5, 2), 1: _report(1, 4, 1, waiting=False, data={
        "batch": 7, "seconds": 9.0, "main_thread": True})}, 2)
    assert (data.kind, data.workers) == ("data wait", [1]) and "making batch 7 of this epoch" in data.text
    behind = verdicts.decide({0: _report(0, 5, 2), 1: _report(1, 4, 2, waiting=False)}, 2)
    assert (behind.kind, behind.workers) == ("behind", [1])
    computing = _report(1, 4, 2, waiting=False)
    computing["ledger"]["phase"] = "forward-backward"   # e.g. compiling its first step
    assert verdicts.decide({0: _report(0, 5, 2), 1: computing}, 2) is None
    more_steps = verdicts.decide({0: _report(0, 5, 2), 1: _report(1, 9, 3)}, 2)
    assert (more_steps.kind, more_steps.workers) == ("desync", [1]) and "1 train step(s) more" in more_steps.text
    call = verdicts.decide({0: _report(0, 5, 2), 1: _report(1, 4, 2, call="train_on_batch")}, 2)
    assert (call.kind, call.workers) == ("desync", [1]) and "model.train_on_batch" in call.text
    # A train_on_batch in one worker's callback, at fit's own step and collective numbers.
    nested = verdicts.decide({0: _report(0, 5, 2), 1: _report(1, 5, 2, call="train_on_batch")}, 2)
    assert (nested.kind, nested.workers) == ("desync", [1]) and "model.train_on_batch while" in nested.text
    three = verdicts.decide({0: _report(0, 5, 2), 1: _report(1, 5, 2), 2: _report(2, 6, 2)}, 3)
    assert (three.kind, three.workers) == ("desync", [2])
    # After failed collectives (`settled`): where each failed worker was last.
    failed = [_report(0, 5, 2, waiting=False), _report(1, 6, 3, waiting=False, call="train_on_batch")]
    for report in failed:
        report["failed"] = True
    settled = verdicts.decide(dict(enumerate(failed)), 2, settled=True)
    assert (settled.kind, settled.workers) == ("desync", [1])
    # A live peer outside any collective (asleep in a callback) is behind, not out of step.
    asleep = verdicts.decide({0: failed[0], 1: _report(1, 6, 3, waiting=False)}, 2, settled=True)
    assert (asleep.kind, asleep.workers) == ("behind", [1])
    # Worker 1 left the job after collective #5; worker 0 waits in #6 of evaluate: called alone.
    alone = verdicts.decide({0: _report(0, 6, 2, call="evaluate")}, 2,
                            left={1: {"sequence": 5, "call": "fit"}})
    assert (alone.kind, alone.workers) == ("called alone", [0])
    assert "model.evaluate was called on worker 0 only; every worker must call it" in alone.text
    # It left after the collective worker 0 still finishes (#6): that is not the mistake.
    finishing = verdicts.decide({0: _report(0, 6, 2)}, 2, left={1: {"sequence": 6, "call": "fit"}})
    assert finishing.kind == "no answer"


def test_datagrams_carry_reports_and_cut_stacks_to_fit():
    report = _report(0, 1, 1)
    report["stack"] = ["x" * 5000] * 200
    data = encode(report)
    assert len(data) <= 60000 and decode(data)["worker"] == 0
    sender, receiver = Channel("127.0.0.1", 0), Channel("127.0.0.1", 0)
    try:
        assert sender.send({"type": "ping"}, receiver.address)
        assert receiver.receive(timeout=2.0) == [{"type": "ping"}]
    finally:
        sender.close()
        receiver.close()


class _Ending(Watchdog):
    """A watchdog that records how it would end instead of ending the process."""

    def _end(self, verdict, text, reporter):
        self.ended = (verdict.kind if verdict else None, text, reporter)
        self._collect_until = self._verdict_until = None


def test_the_launchers_time_table_has_nothing_to_say_before_a_first_step():
    """A script that failed before training (a NameError) gets no table of zeros."""
    from keras_mwms.diagnostics.collector import HangCollector

    collector = HangCollector(["127.0.0.1:1", "127.0.0.1:2"], log=io.StringIO())
    try:
        for worker in (0, 1):
            collector.on_message({"type": "progress", "worker": worker, "step": 0, "sequence": 0,
                                  "totals": {"data": 0.0, "compute": 0.0, "collective": 0.0, "steps": 0}})
        assert collector.time_table() == ""
        collector.on_message({"type": "progress", "worker": 1, "step": 2, "sequence": 5,
                              "totals": {"data": 0.1, "compute": 0.2, "collective": 0.3, "steps": 2}})
        assert "worker 1" in collector.time_table()
    finally:
        collector.close()


def test_the_launcher_decides_no_hang_for_a_busy_worker_and_withdraws_one_the_gang_outlived():
    """A round opened while worker 0 was busy (a long compile) and never answered: the launcher
    decides nothing if a worker moved on before its wait ended; if the gang moves only after
    the launcher's own verdict, that verdict is withdrawn in one line and a later hang is named."""
    from keras_mwms.diagnostics.collector import HangCollector
    from keras_mwms.diagnostics.report import build_report
    from keras_mwms.diagnostics.watchdog import COLLECT_SECONDS, VERDICT_WAIT_SECONDS

    wait = COLLECT_SECONDS + VERDICT_WAIT_SECONDS + 3
    log = io.StringIO()
    collector = HangCollector(["127.0.0.1:1", "127.0.0.1:2"], log=log)
    ledger = Ledger()
    collective = ledger.collective("gradient all-reduce", 64)
    collective.__enter__()

    def progress(worker, sequence):
        collector.on_message({"type": "progress", "worker": worker, "step": sequence, "sequence": sequence,
                              "totals": {"data": 0.0, "compute": 1.0, "collective": 1.0, "steps": sequence}})

    try:
        progress(0, 1)
        progress(1, 1)
        collector.on_message(build_report(1, "worker 1", ledger, threshold=3))   # worker 0: no answer
        progress(1, 2)                                                             # ... then it moved on
        collector.tick(time.monotonic() + wait)
        assert log.getvalue() == "" and collector.verdict_text is None

        collector.on_message(build_report(1, "worker 1", ledger, threshold=3))   # a second busy spell
        collector.tick(time.monotonic() + wait)
        assert "no answer: worker 0" in log.getvalue() and "decided by the launcher" in log.getvalue()
        progress(0, 3)                                                             # worker 0 is back
        withdrawn = log.getvalue().splitlines()[-1]
        assert withdrawn.startswith("[launcher] verdict withdrawn: worker 0 made progress"), log.getvalue()
        assert "not hung; training goes on" in withdrawn and collector.verdict_text is None

        collector.on_message(build_report(1, "worker 1", ledger, threshold=3))   # a real hang now
        collector.tick(time.monotonic() + wait)
        assert log.getvalue().count("no answer: worker 0") == 2, log.getvalue()
        progress(1, 2)   # a progress line of an unchanged step withdraws nothing
        assert log.getvalue().count("withdrawn") == 1
    finally:
        collective.__exit__(None, None, None)
        collector.close()


def test_two_watchdogs_and_a_launcher_agree_on_one_verdict():
    """In-process: worker 1 waits in a collective, worker 0 is busy elsewhere; the launcher
    asks after no progress; worker 0 decides, worker 1 and the launcher print its verdict."""
    from keras_mwms.diagnostics.collector import HangCollector

    addresses = [f"127.0.0.1:{port}" for port in find_free_ports(2)]
    log = io.StringIO()
    collector = HangCollector(addresses, no_progress_seconds=1.0, log=log)
    ledgers = [Ledger(), Ledger()]
    dogs = [_Ending(index, addresses, threshold=60, ledger=ledgers[index], launcher=collector.address,
                    output=io.StringIO()) for index in (0, 1)]
    collective = ledgers[1].collective("gradient all-reduce", 64)
    collective.__enter__()
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline and not all(hasattr(dog, "ended") for dog in dogs):
            for dog in dogs:
                if not hasattr(dog, "ended"):
                    dog.tick()
            for message in collector.channel.receive(0):
                collector.on_message(message)
            collector.tick(time.monotonic())
            time.sleep(0.05)
        for message in collector.channel.receive(0.5):
            collector.on_message(message)
    finally:
        for dog in dogs:
            dog.close()
        collector.close()
    assert all(hasattr(dog, "ended") for dog in dogs), log.getvalue()
    kind, text, reporter = dogs[0].ended
    assert (kind, reporter) == ("behind", 0) and text.startswith("keras_mwms hang verdict: behind: worker 0")
    assert dogs[1].ended[1:] == (text, 0)
    assert log.getvalue() == "".join(f"[launcher] {line}\n" for line in text.splitlines())


def test_sigusr1_reports_while_the_main_thread_sleeps_in_c():
    """SIGUSR1 reaches the watchdog through the wake-up fd although the main thread never
    returns to Python; with nothing waiting in a collective the report says so and nobody exits."""
    port = find_free_ports(1)[0]
    script = textwrap.dedent(f"""
        import sys, time
        from keras_mwms.diagnostics.ledger import Ledger
        from keras_mwms.diagnostics.watchdog import Watchdog
        dog = Watchdog(0, ["127.0.0.1:{port}"], threshold=60, ledger=Ledger())
        dog.start()
        print("ready", flush=True)
        time.sleep(8)   # one C call: Python-level signal handlers cannot run meanwhile
        print("slept", flush=True)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert process.stdout.readline().strip() == "ready"
        started = time.monotonic()
        process.send_signal(signal.SIGUSR1)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert "keras_mwms hang report (SIGUSR1): no hang found" in output
    assert output.index("keras_mwms hang report") < output.index("slept"), output
    assert time.monotonic() - started < 15


def test_a_report_on_request_never_ends_the_job():
    """Worker 1 is between collectives while worker 0 waits in one: the round's snapshot reads
    "behind", but a report asked for by SIGUSR1 is printed and both workers live on."""
    ports = find_free_ports(2)
    script = textwrap.dedent(f"""
        import time
        from keras_mwms.diagnostics.ledger import Ledger
        from keras_mwms.diagnostics.watchdog import Watchdog
        addresses = ["127.0.0.1:{ports[0]}", "127.0.0.1:{ports[1]}"]
        waiting, working = Ledger(enabled=True), Ledger(enabled=True)
        second = Watchdog(1, addresses, threshold=60, ledger=working)
        second.start()   # the first started arms SIGUSR1: worker 1 is asked
        first = Watchdog(0, addresses, threshold=60, ledger=waiting)
        first.start()
        def train_step():
            with working.train_step():
                pass
        train_step()
        print("ready", flush=True)
        with waiting.collective("gradient all-reduce"):
            time.sleep(8)
        print("alive", flush=True)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert process.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        process.send_signal(signal.SIGUSR1)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert "keras_mwms hang report (SIGUSR1): training goes on; every worker:" in output, output
    assert "if this lasts 60 s, the verdict will be: " + verdicts.HEADLINE in output, output
    assert output.index("keras_mwms hang report") < output.index("alive"), output


# -- real gangs -------------------------------------------------------------------------------
@dataclass
class Run:
    backend: str
    fault: str
    out: str
    code: int
    output: str
    log: str
    ended: float
    orphans: str

    def fault_time(self) -> float:
        with open(os.path.join(self.out, "fault.json")) as handle:
            return json.load(handle)["time"]

    def verdict(self, prefix: str, text: str) -> list[str]:
        """The verdict block (headline and its indented lines) printed under `prefix`."""
        lines = [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]
        starts = [i for i, line in enumerate(lines) if line.startswith(verdicts.HEADLINE)]
        assert len(starts) == 1, self.describe()
        block = [lines[starts[0]]]
        for line in lines[starts[0] + 1:]:
            if not line.startswith("  "):
                break
            block.append(line)
        return block

    def describe(self) -> str:
        return (f"[{self.backend} {self.fault}] exit {self.code}\n--- launcher\n{self.log[-5000:]}\n"
                f"--- workers\n{self.output[-8000:]}\norphans: {self.orphans}")


def _run(backend: str, fault: str, out: str) -> Run:
    marker = f"kmwms-hang-{uuid.uuid4().hex[:12]}"
    os.makedirs(out, exist_ok=True)
    env = worker_env(backend, lean=True, KERAS_MWMS_HANG_REPORT_SECONDS=str(THRESHOLD))
    result = run_launcher(["--workers", "2", "--grace-period", "3"],
                          [str(WORKERS_DIR / "hang_scenario.py"), out, "--fault", fault, "--at-batch",
                           str(AT_BATCH), "--sleep", str(10 * THRESHOLD), "--marker", marker,
                           *EXTRA_ARGUMENTS.get(fault, [])],
                          timeout=GANG_TIMEOUT, env=env)
    ended = time.time()
    orphans = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.strip()
    return Run(backend, fault, out, result.returncode, result.output, result.launcher_log, ended, orphans)


@pytest.fixture(scope="module")
def hang_runs(request, tmp_path_factory):
    """The selected gangs (all fifteen in a full run), three at a time, keyed (backend, fault)."""
    jobs = selected_params(request, "backend", "fault")
    outs = {job: str(tmp_path_factory.mktemp(f"hang_{job[0]}_{job[1]}")) for job in jobs}
    runs = concurrently(lambda job: _run(*job, outs[job]), jobs)
    yield runs
    print(f"\nhang report times (threshold {THRESHOLD} s, bound {BOUND} s from the fault to the launcher's exit):")
    for row in TABLE:
        print(f"  {row['backend']:<11} {row['fault']:<8} {row['seconds']:>5} s  exit {row['code']}  {row['headline']}")


HEADLINES = {
    "data": f"data wait: worker 1 is behind, waiting for data: its input pipeline has been making batch {AT_BATCH} of this epoch",
    "desync": "desync: the workers wait in different collectives; worker 1 is out of step: worker 1 is in model.train_on_batch",
    # A train_on_batch in worker 1's on_epoch_end (TensorFlow: the mismatched collective fails
    # at once, with fit's step numbers): named by its call, or (JAX) by its extra train step.
    "callback-desync": "desync: the workers wait in different collectives; worker 1 is out of step: worker 1 ",
    "sigstop": "no answer: worker 1 did not answer the hang report",
    "chief-evaluate": "called on some workers only: model.evaluate was called on worker 0 only; every "
                      "worker must call it. worker 1 had left the job (its script ended after collective",
}


@pytest.mark.slow
@pytest.mark.tensorflow
@pytest.mark.jax
@pytest.mark.torch
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_gang_ends_with_one_verdict_naming_the_stuck_worker(hang_runs, backend, fault):
    run = hang_runs[(backend, fault)]
    chief = run.verdict("[worker 0] ", run.output)
    launcher = run.verdict("[launcher] ", run.log)
    seconds = round(run.ended - run.fault_time(), 1)
    TABLE.append({"backend": backend, "fault": fault, "seconds": seconds, "code": run.code,
                  "headline": chief[0][:100]})
    assert run.code != 0, run.describe()
    assert chief[0].startswith(f"{verdicts.HEADLINE} {HEADLINES[fault]}"), run.describe()
    assert chief == launcher, run.describe()
    if fault == "data":
        assert "time.sleep" in "\n".join(chief), run.describe()   # worker 1's stack, at the sleep
    if fault == "chief-evaluate":   # the healthy worker finished its script, and was not called lost
        with open(os.path.join(run.out, "w1.json")) as handle:
            assert json.load(handle)["completed"], run.describe()
        assert "lost worker" not in run.output, run.describe()
    assert seconds <= BOUND, run.describe()
    assert not run.orphans, run.describe()


@pytest.mark.torch
def test_kill_usr1_on_a_healthy_gang_prints_the_report_and_training_goes_on(tmp_path):
    """`kill -USR1` reaches worker 1 while it makes a batch and worker 0 waits in a collective:
    the report is printed once, and the gang finishes both fits and exits 0."""
    marker = f"kmwms-usr1-{uuid.uuid4().hex[:12]}"
    result = run_launcher(["--workers", "2", "--grace-period", "3"],
                          [str(WORKERS_DIR / "hang_scenario.py"), str(tmp_path), "--fault", "usr1",
                           "--at-batch", str(AT_BATCH), "--sleep", "4", "--marker", marker],
                          timeout=GANG_TIMEOUT, env=worker_env("torch", lean=True))
    described = f"exit {result.returncode}\n{result.launcher_log[-3000:]}\n{result.output[-6000:]}"
    assert result.returncode == 0, described
    assert result.output.count("keras_mwms hang report (SIGUSR1)") == 1, described
    for index in (0, 1):
        with open(tmp_path / f"w{index}.json") as handle:
            assert json.load(handle)["completed"], described
