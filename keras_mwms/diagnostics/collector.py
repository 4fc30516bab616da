"""The launcher's end of the side channel: progress, hang reports, the verdict, the time table.

`python -m keras_mwms.launch` listens on a UDP port of its own and hands it to every worker as
`KERAS_MWMS_DIAGNOSTICS_ADDRESS`. Each worker's watchdog then sends it

* a `progress` message every second (train steps, collectives, seconds waiting for data,
  computing, waiting in collectives): when no worker made progress for
  `no_progress_seconds`, the launcher asks every worker for a hang report;
* its hang reports and, from the worker that decided, the verdict: the launcher prints the
  same text, line for line (`[launcher] ` before each line). If no verdict comes although
  reports did (the deciding worker is stuck too), it decides from the reports it has — unless
  a worker made progress meanwhile (a round opened while one worker was busy, e.g. compiling,
  is no hang). A verdict it decided itself is withdrawn, in one line, if the gang makes
  progress after it, and a later hang gets a verdict of its own.

At the end of a run, `time_table()` is the per-worker table of where the time went.

Example:

>>> import io
>>> log = io.StringIO()
>>> collector = HangCollector(["127.0.0.1:1"], log=log)
>>> collector.on_message({"type": "progress", "worker": 0, "step": 3, "sequence": 9,
...                       "totals": {"data": 0.5, "compute": 2.0, "collective": 1.0, "steps": 3}})
>>> print(collector.time_table().splitlines()[1])
worker 0           3      0.50      2.00      1.00
>>> collector.close()
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from keras_mwms.diagnostics import verdict as verdicts
from keras_mwms.diagnostics.channel import Channel, resolve
from keras_mwms.diagnostics.watchdog import COLLECT_SECONDS, VERDICT_WAIT_SECONDS

TICK_SECONDS = 0.2


class HangCollector:
    """Listens for the workers of one gang (see the module docstring).

    Args:
        addresses: the gang's worker addresses, in worker order.
        host: where to listen (the host the workers reach the launcher at).
        no_progress_seconds: ask for a hang report when no worker made progress this long
            (None: never).
        log: where the verdict goes (the launcher's stderr).
    """

    def __init__(self, addresses: list[str], host: str = "127.0.0.1",
                 no_progress_seconds: float | None = None, log: TextIO | None = None):
        self.workers = [resolve(address) for address in addresses]
        self.channel = Channel(host, 0)
        self.address = f"{host}:{self.channel.address[1]}"
        self.no_progress_seconds = no_progress_seconds
        self.log = log or sys.stderr
        self.progress: dict[int, dict] = {}
        self.reports: dict[int, dict] = {}
        self.verdict_text: str | None = None
        self._own_verdict_at: float | None = None   # when the launcher decided itself (no worker did)
        self._last_change = time.monotonic()
        self._round_started: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="keras_mwms-hang-collector", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.channel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                messages = self.channel.receive(TICK_SECONDS)
            except (OSError, ValueError):
                return
            for message in messages:
                self.on_message(message)
            self.tick(time.monotonic())

    def on_message(self, message: dict) -> None:
        """Handles one message from a worker."""
        kind, worker = message.get("type"), message.get("worker")
        if kind == "progress" and isinstance(worker, int):
            before = self.progress.get(worker)
            if before is None or (before["step"], before["sequence"]) != (message["step"], message["sequence"]):
                self._last_change = time.monotonic()
                if before is not None:
                    self._withdraw_own_verdict(worker)
            self.progress[worker] = message
        elif kind in ("request", "report"):
            if self._round_started is None:
                self._round_started, self.reports = time.monotonic(), {}
            if kind == "report" and isinstance(worker, int):
                self.reports[worker] = message
        elif kind == "verdict":
            self._round_started = None
            if message.get("final") and self.verdict_text is None:
                self._say(message.get("text", ""))

    def tick(self, now: float) -> None:
        """Asks for reports after no progress; decides itself when no verdict arrived."""
        if self.verdict_text is not None:
            return
        if self._round_started is not None and now - self._round_started > COLLECT_SECONDS + VERDICT_WAIT_SECONDS + 2:
            started, self._round_started = self._round_started, None
            if self._last_change > started:   # a worker moved on meanwhile: busy, not hung
                return
            verdict = verdicts.decide(self.reports, len(self.workers))
            if verdict is not None:
                self._say(verdict.text.replace("\n", " (decided by the launcher: no worker sent a verdict)\n", 1))
                self._own_verdict_at = now
            return
        if (self.no_progress_seconds and self._round_started is None and self.progress
                and now - self._last_change > self.no_progress_seconds):
            self._last_change = now
            self._round_started, self.reports = now, {}
            reason = f"the launcher saw no progress for {self.no_progress_seconds:g} s"
            for destination in self.workers:
                self.channel.send({"type": "request", "worker": -1, "reason": reason}, destination)

    def _withdraw_own_verdict(self, worker: int) -> None:
        """The gang moved after a verdict the launcher decided itself: it was no hang."""
        if self._own_verdict_at is None:
            return
        waited = time.monotonic() - self._own_verdict_at
        self._own_verdict_at, self.verdict_text = None, None
        self.log.write(f"[launcher] verdict withdrawn: worker {worker} made progress {waited:.1f} s after "
                       "it, so the gang was busy (a long compile or step), not hung; training goes on\n")
        self.log.flush()

    def _say(self, text: str) -> None:
        self.verdict_text = text
        for line in text.splitlines():
            self.log.write(f"[launcher] {line}\n")
        self.log.flush()

    def time_table(self) -> str:
        """Where each worker's time went, from its last progress message (empty if none came,
        or no worker trained a step: a script that failed before training has nothing to say)."""
        if not any(entry.get("totals", {}).get("steps", 0) for entry in self.progress.values()):
            return ""
        lines = [f"{'':<12}{'steps':>8}{'data s':>10}{'compute s':>10}{'coll. s':>10}"]
        for worker in sorted(self.progress):
            totals = self.progress[worker].get("totals", {})
            lines.append(f"{f'worker {worker}':<12}{int(totals.get('steps', 0)):>8}"
                         f"{totals.get('data', 0.0):>10.2f}{totals.get('compute', 0.0):>10.2f}"
                         f"{totals.get('collective', 0.0):>10.2f}")
        return "\n".join(lines)
