"""The hang watchdog: one thread per worker that notices a stuck collective and gets a verdict.

It wakes every `TICK_SECONDS` and starts a **hang report** when

* this worker has waited in one collective longer than `CommunicationOptions.hang_report_seconds`,
* the process received SIGUSR1 (seen through `signal.set_wakeup_fd`, so even while the main
  thread is blocked inside a C++ collective), or
* a peer or the launcher asked for one over the side channel (`keras_mwms.diagnostics.channel`).

A report round: every worker sends its report (ledger + stacks, `keras_mwms.diagnostics.report`)
to every worker and to the launcher; after `COLLECT_SECONDS`, or once all reported, the
lowest-index worker that reported (the chief unless it is the stuck one) decides
(`keras_mwms.diagnostics.verdict.decide`), prints the verdict, sends it to everyone, and each
worker ends at once with exit status `HANG_EXIT_CODE` (`os._exit`: the stuck engine's teardown
would wait forever). No verdict (every worker waits in the same collective: a slow step) lets
training go on; the next report can come one threshold later. A report asked for by SIGUSR1
is printed and never ends the job, verdict or not: on request the workers are caught between
collectives as often as stuck in one.

A worker whose script ends (or that closes its strategy) without an error announces *leaving*
(its last collective's sequence number). A peer that then waits in a collective with a higher
number waits for someone who can never join: a round starts at once, and the verdict says the
call ran on some workers only (`if strategy.is_chief: model.evaluate(...)`). A worker that had
left and still waits in its engine's exit barrier ends with status 0 on the verdict.

When a backend is about to report a lost peer (`keras_mwms.backends.policy.raise_worker_lost`),
`confirm_lost` runs one round first: if every peer answers and they wait in different
collectives, the diagnosis is a desync, not a lost worker (TensorFlow's collectives time out
that way); otherwise the `WorkerLostError` goes ahead.

Example (one worker alone: the report round is over at once; nothing waits, so no verdict):

>>> import io
>>> from keras_mwms.diagnostics.ledger import Ledger
>>> from keras_mwms.launch import find_free_ports
>>> out = io.StringIO()
>>> dog = Watchdog(0, [f"127.0.0.1:{find_free_ports(1)[0]}"], threshold=60, ledger=Ledger(), output=out)
>>> dog.request("SIGUSR1"); dog.tick()
>>> "keras_mwms hang report" in out.getvalue()
True
>>> dog.close()
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback as traceback_module
from typing import TextIO

from keras_mwms.diagnostics import report as reports
from keras_mwms.diagnostics import verdict as verdicts
from keras_mwms.diagnostics.channel import Channel, resolve
from keras_mwms.diagnostics.ledger import Ledger
from keras_mwms.log import get_logger
from keras_mwms.startup.cluster import split_address

logger = get_logger(__name__)
HANG_EXIT_CODE = 5
TICK_SECONDS = 0.2
COLLECT_SECONDS = 2.0
VERDICT_WAIT_SECONDS = 3.0
PROGRESS_SECONDS = 1.0
# A collective entered after a peer left the job waits this long before the at-once round: one
# that needs no peer (an empty broadcast) ends by itself first.
LEFT_GRACE_SECONDS = 1.0
# How long the reporter lingers after sending the verdict, so peers read it before its exit
# breaks their collectives.
LINGER_SECONDS = 0.5


_COLLECTIVE_WORDS = ("collective", "gloo", "nccl", "connection reset", "unavailable", "aborted",
                     "mismatch", "heartbeat", "peer")


def looks_like_collective_failure(error: BaseException) -> bool:
    """Whether an error's type or text reads like a failed collective (any backend's words).

    Example:

    >>> looks_like_collective_failure(RuntimeError("Collective ops is aborted by: ..."))
    True
    """
    text = f"{type(error).__name__} {error}".lower()
    return any(word in text for word in _COLLECTIVE_WORDS)


class Watchdog:
    """The watchdog of worker `worker_index` (see the module docstring).

    Args:
        worker_index: this worker.
        addresses: every worker's `host:port` in worker order (TF_CONFIG's).
        threshold: seconds in one collective before a report round starts.
        ledger: this worker's ledger.
        launcher: the launcher's `host:port`, if it runs the gang.
        labels: how messages name each worker (default `worker I`).
        output: where the verdict is written (default: the "keras_mwms" logger, `keras_mwms.log`).
    """

    def __init__(self, worker_index: int, addresses: list[str], threshold: float, ledger: Ledger,
                 launcher: str | None = None, labels: list[str] | None = None,
                 output: TextIO | None = None):
        self.index = worker_index
        self.num_workers = len(addresses)
        self.threshold = float(threshold)
        self.ledger = ledger
        self.labels = labels or [f"worker {index}" for index in range(self.num_workers)]
        self.output = output
        self.peers = [resolve(address) for address in addresses]
        self.launcher = resolve(launcher) if launcher else None
        self.channel = Channel("0.0.0.0", split_address(addresses[worker_index])[1])
        self._lock = threading.Lock()
        self._collect_until: float | None = None
        self._verdict_until: float | None = None
        self._reports: dict[int, dict] = {}
        self._sent_report = False
        self._manual = False
        self._confirm = False
        self._confirmed = threading.Event()
        self._requested: str | None = None
        self._rearm_at = 0.0
        self._progress_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_read: socket.socket | None = None
        self._wake_write: socket.socket | None = None
        self._previous_wakeup_fd: int | None = None
        self._previous_sigusr1 = signal.SIG_DFL
        self._failed = False   # this worker's own collective failed (`confirm_lost`)
        self._escaping = False   # an error is leaving the script (`on_escaping_error`)
        self._announced_leaving = False
        self._left: dict[int, dict] = {}   # peers that left the job: worker -> their last sequence, call
        self._previous_excepthook = sys.excepthook
        self._epochs: dict[int, dict[int, dict]] = {}   # epoch number -> worker -> times (chief)

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Starts the thread; from the main thread it also arms SIGUSR1 and the exception hook."""
        self._arm_sigusr1()
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit)
        self._thread = threading.Thread(target=self._run, name="keras_mwms-hang-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the thread and releases the socket and SIGUSR1; safe to call twice."""
        self._stop.set()
        atexit.unregister(self._at_exit)
        self._at_exit()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self._previous_wakeup_fd is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            signal.signal(signal.SIGUSR1, self._previous_sigusr1)
            self._previous_wakeup_fd = None
        for sock in (self._wake_read, self._wake_write):
            if sock is not None:
                sock.close()
        self._wake_read = self._wake_write = None
        self.channel.close()

    def _arm_sigusr1(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return   # the script handles SIGUSR1 itself
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        previous = signal.set_wakeup_fd(self._wake_write.fileno(), warn_on_full_buffer=False)
        if previous != -1:   # someone else (asyncio) owns the wake-up fd: leave it to them
            signal.set_wakeup_fd(previous)
            return
        self._previous_wakeup_fd = previous
        self._previous_sigusr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: None)

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        import select

        while not self._stop.is_set():
            waiting = [self.channel.sock] + ([self._wake_read] if self._wake_read else [])
            try:
                readable, _, _ = select.select(waiting, [], [], TICK_SECONDS)
            except (OSError, ValueError):
                return
            if self._wake_read is not None and self._wake_read in readable:
                try:
                    signals = self._wake_read.recv(64)
                except OSError:
                    signals = b""
                if signal.SIGUSR1 in signals:
                    self.request("SIGUSR1")
            self.tick()

    def request(self, reason: str, confirm: bool = False) -> None:
        """Asks for a report round (from any thread; the watchdog thread runs it)."""
        with self._lock:
            self._requested = reason
            self._confirm = self._confirm or confirm
            self._manual = self._manual or reason == "SIGUSR1"

    def tick(self) -> None:
        """One round of the watchdog's work (the thread calls it every `TICK_SECONDS`)."""
        for message in self.channel.receive(0):
            self._on_message(message)
        now = time.monotonic()
        with self._lock:
            requested, self._requested = self._requested, None
        if requested:
            self._begin(requested, now)
        current = self.ledger.current
        if (current is not None and self._collect_until is None and self._verdict_until is None
                and now >= self._rearm_at and now - current.started > self.threshold):
            self._begin(f"worker {self.index} waited {now - current.started:.1f} s in collective "
                        f"#{current.sequence} '{current.kind}'", now)
        if (current is not None and self._left and self._collect_until is None
                and self._verdict_until is None and now >= self._rearm_at
                and now - current.started >= LEFT_GRACE_SECONDS
                and current.sequence > max(int(left.get("sequence") or 0) for left in self._left.values())):
            # A collective no one who left can join: no need to wait for the hang threshold. The
            # grace lets one that needs no peer (an empty broadcast), or the last one both shared
            # and still ending here, end by itself.
            self._begin(f"worker {self.index} entered collective #{current.sequence} '{current.kind}' "
                        f"after worker(s) {sorted(self._left)} left the job", now)
        answered = len(self._reports) + len(set(self._left) - set(self._reports))
        if self._collect_until is not None and (answered >= self.num_workers or now >= self._collect_until):
            self._conclude(now)
        if self._verdict_until is not None and now >= self._verdict_until:
            self._decide_and_end(note=" (decided by this worker: no verdict arrived)")
        if self.launcher is not None and now >= self._progress_at:
            self._progress_at = now + PROGRESS_SECONDS
            self.send_progress()

    def _at_exit(self) -> None:
        """The script ended (or closed its strategy): final totals to the launcher, and the peers
        learn that this worker left (a collective they enter later is one it never joins)."""
        self.send_progress()
        self.announce_leaving()

    def announce_leaving(self) -> None:
        """Tells every peer this worker left the job after its last collective; once, and only
        when it ends well (not after a failed collective or an error leaving the script)."""
        if (self._announced_leaving or self._failed or self._escaping or getattr(sys, "last_value", None)
                or self.ledger.open_calls):   # it left a fit/evaluate loop by an error: a lost worker
            return
        self._announced_leaving = True
        message = {"type": "left", "worker": self.index, "sequence": self.ledger.sequence,
                   "step": self.ledger.step, "call": self.ledger.call}
        for rank, peer in enumerate(self.peers):
            if rank != self.index:
                self.channel.send(message, peer)

    def send_progress(self) -> None:
        """Tells the launcher (if any) this worker's train steps, collectives and time totals."""
        if self.launcher is not None:
            self.channel.send({"type": "progress", "worker": self.index, "step": self.ledger.step,
                               "sequence": self.ledger.sequence, "totals": dict(self.ledger.totals)},
                              self.launcher)

    # -- epoch times (`keras_mwms.diagnostics.straggler`) -------------------------------------
    def send_to(self, worker: int, message: dict) -> None:
        """Sends one message to worker `worker` over the side channel."""
        self.channel.send(message, self.peers[worker])

    def epoch_times(self, number: int) -> dict[int, dict]:
        """The epoch times the other workers sent for epoch report `number` so far."""
        with self._lock:
            return dict(self._epochs.get(number, {}))

    # -- a report round ---------------------------------------------------------------------
    def _everyone(self, message: dict) -> None:
        for rank, peer in enumerate(self.peers):
            if rank != self.index:
                self.channel.send(message, peer)
        if self.launcher is not None:
            self.channel.send(message, self.launcher)

    def _begin(self, reason: str, now: float, asked: bool = True) -> None:
        if self._collect_until is None and self._verdict_until is None:
            self._collect_until = now + COLLECT_SECONDS
            self._reports, self._sent_report = {}, False
        if asked:
            self._everyone({"type": "request", "worker": self.index, "reason": reason,
                            "confirm": self._confirm, "manual": self._manual})
        self._send_report()

    def _send_report(self) -> None:
        if self._sent_report:
            return
        self._sent_report = True
        own = reports.build_report(self.index, self.labels[self.index], self.ledger, self.threshold,
                                   failed=self._failed)
        self._reports[self.index] = own
        self._everyone(own)

    def _on_message(self, message: dict) -> None:
        kind = message.get("type")
        if kind == "request":
            with self._lock:
                self._confirm = self._confirm or bool(message.get("confirm"))
                self._manual = self._manual or bool(message.get("manual"))
            self._begin(message.get("reason", ""), time.monotonic(), asked=False)
        elif kind == "left" and isinstance(message.get("worker"), int):
            self._left[message["worker"]] = message
        elif kind == "report" and isinstance(message.get("worker"), int):
            self._left.pop(message["worker"], None)   # it answers: it is still in the job
            if self._collect_until is None and self._verdict_until is None:
                self._begin("a peer reported", time.monotonic(), asked=False)
            self._reports[message["worker"]] = message
        elif kind == "epoch" and isinstance(message.get("worker"), int):
            with self._lock:
                self._epochs.setdefault(message.get("number"), {})[message["worker"]] = message.get("times", {})
        elif kind == "verdict":
            if message.get("final"):
                self._end(None, message.get("text", ""), message.get("reporter"))
            else:
                self._reset()

    def _conclude(self, now: float) -> None:
        self._collect_until = None
        if min(self._reports) == self.index:
            self._decide_and_end()
        else:
            self._verdict_until = now + VERDICT_WAIT_SECONDS

    def _decide_and_end(self, note: str = "") -> None:
        self._verdict_until = None
        verdict = verdicts.decide(self._reports, self.num_workers, settled=self._confirm, left=self._left)
        # A report asked for by SIGUSR1 is a snapshot of a job that may well be healthy (one
        # worker between collectives while its peer already waits): print it, never end the job.
        # A real hang still trips the threshold and gets its verdict then.
        if verdict is not None and not self._manual and (not self._confirm or verdict.kind in ("desync", "called alone")):
            text = verdict.text.replace("\n", f"{note}\n", 1) if note else verdict.text
            self._everyone({"type": "verdict", "final": True, "text": text, "kind": verdict.kind,
                            "workers": verdict.workers, "reporter": self.index})
            self._end(verdict, text, self.index)
            return
        if self._manual:
            lasting = ("" if verdict is None else
                       f"\n  if this lasts {self.threshold:g} s, the verdict will be: {verdict.text.splitlines()[0]}")
            found = "no hang found" if verdict is None else "training goes on"
            self._say(logging.INFO, f"keras_mwms hang report (SIGUSR1): {found}; every worker:\n" +
                      "\n".join(f"  worker {worker}: {verdicts._where(self._reports[worker])}"
                                 for worker in sorted(self._reports)) + lasting)
        self._everyone({"type": "verdict", "final": False, "reporter": self.index})
        self._reset()

    def _reset(self) -> None:
        self._collect_until = self._verdict_until = None
        self._reports, self._sent_report = {}, False
        self._rearm_at = time.monotonic() + self.threshold
        with self._lock:
            self._manual = False
            confirm, self._confirm = self._confirm, False
        if confirm:
            self._confirmed.set()

    def _end(self, verdict: verdicts.Verdict | None, text: str, reporter: int | None) -> None:
        """Prints the verdict (the reporter) or one line naming it, then ends this process."""
        if verdict is not None:
            self._say(logging.ERROR, text)
            time.sleep(LINGER_SECONDS)
        else:
            first_line = text.splitlines()[0] if text else "(no text)"
            finished = " (this worker had finished its script: exit status 0)" if self._announced_leaving else ""
            self._say(logging.ERROR, f"keras_mwms worker {self.index}: ending after worker {reporter}'s hang verdict"
                        f"{finished}: {first_line}")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        # A worker that had finished its script (it announced leaving; it may wait in the
        # engine's exit barrier for the stuck peers) ends as it would have: successfully.
        os._exit(0 if self._announced_leaving else HANG_EXIT_CODE)

    def _say(self, level: int, text: str) -> None:
        if self.output is None:
            logger.log(level, text)
        else:
            self.output.write(text + "\n")
            self.output.flush()

    def on_native_terminate(self) -> None:
        """A native thread called std::terminate (`keras_mwms.diagnostics.native`): report first.

        Runs on that thread; the verdict ends the process from the watchdog thread. Returns
        (and the process aborts as it would have) when no verdict comes.
        """
        self.request(f"worker {self.index}: a native thread called std::terminate (often a "
                     "collective mismatch detected by gloo)")
        time.sleep(COLLECT_SECONDS + VERDICT_WAIT_SECONDS + 4 * TICK_SECONDS + 1)

    def _excepthook(self, kind, error, traceback) -> None:
        """An uncaught error: the traceback, then `on_escaping_error`."""
        self._previous_excepthook(kind, error, traceback)
        self.on_escaping_error(error, traceback)

    def on_escaping_error(self, error: BaseException, traceback) -> None:
        """An error leaving the script (uncaught, or leaving `with strategy:`): if it reads like a
        failed collective, one confirming round first, which ends the job on a desync.

        TensorFlow reports mismatched collectives as an error on each worker ("Collective
        instance 147 expected type 0 and data_type 1 but got ..."): the round names the desync.
        """
        self._escaping = True
        if looks_like_collective_failure(error):
            # The stack is unwound now: the Keras method the error came through says the call.
            calls = [entry.name for entry in traceback_module.extract_tb(traceback)
                     if entry.name in reports.KERAS_CALLS]
            if calls:
                self.ledger.call = calls[0]
            self.confirm_lost("an uncaught error from a collective")

    # -- lost-worker confirmation -----------------------------------------------------------
    def confirm_lost(self, where: str) -> None:
        """Before a lost-peer error: one report round; returns unless it finds a desync (see above)."""
        if self._thread is None or self._stop.is_set():
            return
        self._confirmed.clear()
        self._failed = True
        self.request(f"worker {self.index}: a collective failed during {where}", confirm=True)
        self._confirmed.wait(COLLECT_SECONDS + VERDICT_WAIT_SECONDS + 2 * TICK_SECONDS + 1)
