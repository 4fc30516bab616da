"""Local gang launcher and supervisor: `python -m keras_mwms.launch --workers 2 train.py`.

The model: a *gang* is N worker processes of one script, each with its own `TF_CONFIG`
(localhost addresses on free ports, chosen at start). Synchronous training is all-or-nothing,
so the gang lives and dies together:

* every output line of worker i is prefixed with `[worker i]` (once: keras_mwms' own messages
  carry it already);
* the workers report hangs and progress to the launcher over UDP
  (`KERAS_MWMS_DIAGNOSTICS_ADDRESS`): it prints the hang verdict, asks every worker for a hang
  report when none made progress for `--no-progress-seconds`, and prints where each worker's
  time went (data, compute, collectives) at the end of a run that failed, or of every run with
  `--report` (which also sets `KERAS_MWMS_REPORT=1` in the workers: every epoch's straggler
  table, not only those naming a straggler; `keras_mwms.diagnostics`);
* when a worker exits non-zero, the others are stopped (SIGTERM, then SIGKILL after
  `--grace-period` seconds) and the gang's exit code is that worker's;
* with `--max-restarts K` a failed gang is started again, up to K times, on fresh ports,
  saying why; a script with `keras_mwms.callbacks.BackupAndRestore` resumes where it stopped;
* with `--min-workers M`, once the same worker has failed `--shrink-after` times in a row (a
  lost machine), the gang restarts with one worker fewer, down to M, saying why; the backup
  restores on any worker count with the same global batch (each restart still counts against
  `--max-restarts`);
* SIGINT/SIGTERM sent to the launcher are forwarded to every worker; whatever is still running
  `--grace-period` seconds later is SIGKILLed, and a second signal SIGKILLs it at once. Then
  the launcher exits with 128 + the signal's number. The escalation is not optional: a
  TensorFlow worker blocked in a collective catches SIGTERM and never exits, so a launcher
  that only waited outlived `timeout` and scheduler time limits, workers and all;
* each worker runs in its own process group, killed as a whole, and is told by the kernel to
  die with the launcher (`PR_SET_PDEATHSIG`), so no process outlives the launcher.

Exit code: 0 only when every worker of the last attempt exits 0.

Each worker gets `TF_CONFIG`, `KERAS_MWMS_ATTEMPT` (0 on the first start),
`KERAS_MWMS_LOCAL_WORKERS` (N) and, unless already set, `OMP_NUM_THREADS` = cores ÷ N (the
split every worker makes on its own, `keras_mwms.devices.threads`, exported so OpenMP starts with it):
oversubscribing cores made synchronous training several times slower in our probes, and
`TF_CPP_MIN_LOG_LEVEL=1` (TensorFlow's C++ INFO lines off; warnings and errors kept).

GPUs (`--gpus-per-worker`, see `keras_mwms.devices.assignment`): each worker gets
`KERAS_MWMS_LOCAL_RANK` (its index) and, on a host with GPUs, its own `CUDA_VISIBLE_DEVICES`:
one GPU per worker by default, K with `--gpus-per-worker K`, every GPU with `all`.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from keras_mwms import devices, settings
from keras_mwms.devices import assignment, threads
from keras_mwms.diagnostics.straggler import REPORT_ENV
from keras_mwms.startup import advice
from keras_mwms.startup.cluster import format_address, make_tf_config
from keras_mwms.startup.preload import PreloadedProcess, die_with_parent

DEFAULT_GRACE_PERIOD_SECONDS = 10.0
# A SIGKILLed process is gone in milliseconds unless stuck in the kernel (a dead NFS mount);
# the launcher must still exit then.
REAP_TIMEOUT_SECONDS = 10.0
DEFAULT_NO_PROGRESS_SECONDS = 600.0


def find_free_ports(count: int, host: str = "localhost") -> list[int]:
    """Returns `count` distinct ports free on `host` right now, for TCP and for UDP.

    UDP too: each worker's hang watchdog listens on UDP at its TF_CONFIG port number
    (`keras_mwms.diagnostics.channel`), so a port another gang's watchdog holds is skipped.

    The ports come from below the kernel's ephemeral range (Linux's
    `/proc/sys/net/ipv4/ip_local_port_range`, 32768–60999 by default) where there is one: the
    kernel hands out ephemeral ports to every outgoing connection and every listener bound to
    port 0 (gloo, gRPC, other gangs), so a port drawn from that range can be taken between this
    call and the moment the worker listens on it. Elsewhere the kernel picks them.

    Example:

    A port this process handed out in the last `_REISSUE_AFTER_SECONDS` is never offered again:
    its gang may not listen on it yet, so two gangs started at once from one process (the test
    suite's threads, the benchmark) cannot be given the same port.

    >>> ports = find_free_ports(2)
    >>> len(set(ports)) == 2 and all(1024 <= port <= 65535 for port in ports)
    True
    >>> set(ports) & set(find_free_ports(2))
    set()
    """
    sockets: list[socket.socket] = []
    ports: list[int] = []
    with _GIVEN_LOCK:
        now = time.monotonic()
        for port, given in list(_GIVEN.items()):
            if now - given > _REISSUE_AFTER_SECONDS:
                del _GIVEN[port]
        try:
            candidates = _ports_below_ephemeral_range()
            for port in candidates:
                if len(ports) == count:
                    break
                if port not in _GIVEN and _hold_tcp_and_udp(host, port, sockets) is not None:
                    ports.append(port)
            while len(ports) < count:     # no such range here, or all of the tries were taken
                port = _hold_tcp_and_udp(host, 0, sockets)
                if port is not None and port not in ports and port not in _GIVEN:
                    ports.append(port)
        finally:
            for sock in sockets:
                sock.close()
        _GIVEN.update((port, now) for port in ports)
    return ports


# Ports `find_free_ports` handed out, with when: a gang can take minutes (imports) to listen.
_GIVEN: dict[int, float] = {}
_GIVEN_LOCK = threading.Lock()
_REISSUE_AFTER_SECONDS = 900.0


_FIRST_UNPRIVILEGED_CANDIDATE = 10000    # above most services' fixed ports
_PORT_TRIES = 64


def _ports_below_ephemeral_range() -> list[int]:
    """Up to `_PORT_TRIES` random ports between 10000 and the kernel's first ephemeral port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            first_ephemeral = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    span = range(_FIRST_UNPRIVILEGED_CANDIDATE, first_ephemeral)
    # The system's generator: a script that seeded `random` must not make two gangs collide.
    return random.SystemRandom().sample(span, min(_PORT_TRIES, len(span)))


def _hold_tcp_and_udp(host: str, port: int, sockets: list[socket.socket]) -> int | None:
    """Binds `port` (0: any) on `host` for TCP and on every interface for UDP; the port, or None.

    The sockets stay open in `sockets` until the caller closes them, so a port is not offered twice.
    """
    stream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sockets.append(stream)
    try:
        stream.bind((host, port))
    except OSError:
        if port == 0:
            raise   # no port at all on `host` (e.g. it does not resolve): the caller must not retry
        return None
    port = stream.getsockname()[1]
    datagram = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sockets.append(datagram)
    try:
        datagram.bind(("0.0.0.0", port))
    except OSError:
        return None   # held for UDP: the TCP socket stays bound so it is not offered again
    return port


def exit_code_of(returncode: int) -> int:
    """Shell-style exit code: a death by signal N becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """`"exit code 3"` or `"signal SIGKILL"`, for messages."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class WorkerProcess:
    """One running worker of a gang."""

    index: int
    process: subprocess.Popen
    pump: threading.Thread


class Gang:
    """Starts, watches and stops N workers of one command.

    Example:

    >>> import sys
    >>> gang = Gang([sys.executable, "-c", "print('hi')"], workers=2)
    >>> gang.run(output=open("/dev/null", "w"))
    0

    Args:
        command: the worker command line (`[python, script, args...]`).
        workers: how many workers to start.
        host: the host name used in every worker's TF_CONFIG address.
        port_base: first port (worker i gets `port_base + i`); free ports if None.
        grace_period: seconds between SIGTERM and SIGKILL when stopping workers.
        attempt: passed to workers as `KERAS_MWMS_ATTEMPT`.
        extra_env: variables added to every worker's environment.
        worker_env: variables added to one worker's environment, by worker index (for
            fault injection and tests).
        start_process: how a worker process is started: `subprocess.Popen` (the default) or a
            function taking the same arguments and answering an object with its `pid`,
            `stdout`, `poll`, `wait` and `returncode` (a test suite's pre-imported workers).
    """

    def __init__(self, command: Sequence[str], workers: int, host: str = "localhost",
                 port_base: int | None = None, grace_period: float = DEFAULT_GRACE_PERIOD_SECONDS,
                 attempt: int = 0, extra_env: dict[str, str] | None = None,
                 worker_env: dict[int, dict[str, str]] | None = None,
                 start_process: Callable[..., subprocess.Popen] = subprocess.Popen):
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        self.command = list(command)
        self.workers = workers
        self.host = host
        ports = (list(range(port_base, port_base + workers)) if port_base
                 else find_free_ports(workers, host))
        self.addresses = [format_address(host, port) for port in ports]
        self.port_base = port_base
        self.grace_period = grace_period
        self.attempt = attempt
        self.extra_env = dict(extra_env or {})
        self.worker_env = {index: dict(env) for index, env in (worker_env or {}).items()}
        self.start_process = start_process
        self.running: list[WorkerProcess] = []
        self._output_lock = threading.Lock()

    def _environment(self, index: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(self.worker_env.get(index, {}))
        env["TF_CONFIG"] = make_tf_config(self.addresses, index)
        # The gang is described by TF_CONFIG, also inside a Slurm step or a torchrun/MPI job.
        env[settings.CLUSTER_SOURCE.name] = "tf_config"
        env[advice.LAUNCH_ATTEMPT_ENV] = str(self.attempt)
        if self.port_base:   # a port clash then says "another --port-base" (keras_mwms.startup.advice)
            env[advice.LAUNCH_PORT_BASE_ENV] = str(self.port_base)
        env[devices.LOCAL_WORKERS_ENV] = str(self.workers)
        env[assignment.LOCAL_RANK_ENV] = str(index)
        env["PYTHONUNBUFFERED"] = "1"
        if threads.USER_THREADS_ENV not in env:   # the user's choice wins (keras_mwms.devices.threads)
            env[threads.USER_THREADS_ENV] = env[threads.CHOSEN_ENV] = str(devices.threads_per_worker(self.workers))
        # TensorFlow's INFO lines (its coordination service's "Waiting for 1/2 tasks to
        # connect", barriers, memory patches) are the gang's start-up chatter, not the user's
        # business; warnings and errors still print. A user's own setting wins.
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        return env

    def _pump(self, index: int, stream, output) -> None:
        prefix = f"[worker {index}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._output_lock:   # keras_mwms' own messages already carry the label (keras_mwms.log)
                output.write((line if line.startswith(prefix) else prefix + line) + "\n")
                output.flush()
        stream.close()

    def start(self, output=None) -> None:
        """Starts every worker; their merged stdout/stderr go to `output` line by line."""
        output = output or sys.stdout
        for index in range(self.workers):
            process = self.start_process(
                self.command, env=self._environment(index), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent,
            )
            pump = threading.Thread(target=self._pump, args=(index, process.stdout, output),
                                    daemon=True)
            pump.start()
            self.running.append(WorkerProcess(index, process, pump))

    def signal_all(self, signum: int) -> None:
        """Sends `signum` to every live worker's whole process group."""
        for worker in self.running:
            if worker.process.poll() is None:
                try:
                    os.killpg(worker.process.pid, signum)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        """SIGKILLs every worker's whole process group, now."""
        for worker in self.running:
            # The group may hold grandchildren even after the leader exited.
            try:
                os.killpg(worker.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, signum: int | None = signal.SIGTERM,
             grace_period: float | None = None) -> list[int]:
        """Asks every live worker to exit with `signum`, SIGKILLs the rest after the grace period.

        `signum=None` sends nothing first, for workers already sent a signal; `grace_period`
        defaults to the gang's. Waits for every worker (each wait bounded) and returns the
        indices of those still running when the grace period ended.
        """
        if signum is not None:
            self.signal_all(signum)
        grace_period = self.grace_period if grace_period is None else grace_period
        deadline = time.monotonic() + max(0.0, grace_period)
        while time.monotonic() < deadline and any(w.process.poll() is None for w in self.running):
            time.sleep(0.05)
        overdue = [worker.index for worker in self.running if worker.process.poll() is None]
        self.kill()
        for worker in self.running:
            try:
                worker.process.wait(timeout=REAP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            worker.pump.join(timeout=5)
        return overdue

    def wait(self, timeout: float | None = None) -> tuple[int, int | None]:
        """Waits until all exit 0 (returns `(0, None)`) or one fails (`(code, worker index)`).

        Raises `TimeoutError` when `timeout` seconds pass first (the workers keep running).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"workers still running after {timeout} s")
            codes = [worker.process.poll() for worker in self.running]
            for worker, code in zip(self.running, codes):
                if code not in (None, 0):
                    return code, worker.index
            if all(code == 0 for code in codes):
                return 0, None
            time.sleep(0.05)

    def run(self, output=None) -> int:
        """Starts the gang, waits, stops the rest on the first failure; returns the raw code."""
        self.start(output)
        try:
            code, _ = self.wait()
        finally:
            self.stop()
        return code


class PreloadedStarts:
    """How `--preload` starts a worker (`Gang(start_process=)`): forked from one
    `keras_mwms.startup.preload.PreloadedProcess`, which imported Keras, its backend and
    keras_mwms once with the first worker's environment and serves every restart after it.
    A worker that a fork would not start as a fresh process does (another interpreter, an
    import-time variable of its own, a preloaded process that does not fork) starts fresh,
    and `say` is told why, once per reason.

    Takes `Gang.start`'s arguments: the child's stdin is /dev/null, its stdout and stderr one
    pipe, its session its own, and it dies with the preloaded process, which dies with this one.

    Example:

    >>> import os, subprocess, sys
    >>> said = []
    >>> starts = PreloadedStarts(say=said.append)
    >>> env = {**os.environ, "KERAS_BACKEND": "jax", "OMP_NUM_THREADS": "1"}
    >>> worker = starts([sys.executable, "-c", "print('hi')"], env=env, stdout=subprocess.PIPE)
    >>> worker.stdout.read(), worker.wait(timeout=60), starts.forked
    (b'hi\\n', 0, 1)
    >>> said[0].startswith("--preload: Keras, its backend and keras_mwms imported once")
    True
    >>> starts.stop()
    """

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.preloaded: PreloadedProcess | None = None
        self.forked = 0
        self._told: set[str] = set()

    def __call__(self, argv: Sequence[str], env: dict[str, str], **popen_options) -> subprocess.Popen:
        if self.preloaded is not None and self.preloaded.ready and not self.preloaded.alive():
            self.say(f"--preload: the preloaded process {self.preloaded.process.pid} ended; starting another")
            self.preloaded = None
        if self.preloaded is None:
            self.preloaded = PreloadedProcess(env)
        process = self.preloaded.start(list(argv), env)
        if process is None:
            if self.preloaded.refusal not in self._told:
                self._told.add(self.preloaded.refusal)
                self.say(f"--preload: {self.preloaded.refusal}; starting workers fresh instead")
            return subprocess.Popen(list(argv), env=env, **popen_options)
        if not self.forked:
            self.say(f"--preload: Keras, its backend and keras_mwms imported once (process "
                     f"{self.preloaded.process.pid}); workers and restarts are forked from it")
        self.forked += 1
        return process

    def stop(self) -> None:
        """Stops the preloaded process (after the workers ended: it reaps them)."""
        if self.preloaded is not None:
            self.preloaded.stop()
            self.preloaded = None


class Launcher:
    """Runs a gang, restarting it up to `max_restarts` times after a failure.

    Example:

    >>> import sys
    >>> Launcher([sys.executable, "-c", "pass"], workers=2, log=open("/dev/null", "w")).run()
    0

    Args:
        command: the worker command line.
        workers: workers per gang.
        max_restarts: how many times a failed gang is started again.
        host: host name for TF_CONFIG addresses.
        port_base: fixed first port, or None for free ports on every attempt.
        grace_period: seconds between SIGTERM and SIGKILL.
        log: where the launcher's own messages go (stderr by default).
        output: where the workers' merged, `[worker i]`-prefixed output goes (stdout by default).
        worker_env: variables added to one worker's environment, by worker index (its GPUs).
        no_progress_seconds: how long no worker may finish a step before the launcher collects
            a hang report from every worker (`--no-progress-seconds`; None: never).
        min_workers: the fewest workers a gang may shrink to (None: never shrink).
        shrink_after: failures in a row of one worker after which the gang loses a worker.
        report: print where each worker's time went after every run, not only a failed one,
            and ask the workers for every epoch's straggler table (`KERAS_MWMS_REPORT=1`).
        preload: fork every worker and every restart from one process that imported Keras, its
            backend and keras_mwms once (`--preload`, `PreloadedStarts`).
    """

    def __init__(self, command: Sequence[str], workers: int, max_restarts: int = 0,
                 host: str = "localhost", port_base: int | None = None,
                 grace_period: float = DEFAULT_GRACE_PERIOD_SECONDS, log=None, output=None,
                 worker_env: dict[int, dict[str, str]] | None = None,
                 no_progress_seconds: float | None = DEFAULT_NO_PROGRESS_SECONDS,
                 min_workers: int | None = None, shrink_after: int = 2, report: bool = False,
                 preload: bool = False):
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        if min_workers is not None and not 1 <= min_workers <= workers:
            raise ValueError(f"--min-workers must be between 1 and --workers ({workers}), got "
                             f"{min_workers}")
        if shrink_after < 1:
            raise ValueError(f"--shrink-after must be >= 1, got {shrink_after}")
        self.min_workers = min_workers
        self.shrink_after = shrink_after
        self.report = report   # every table, also of a healthy run (`--report`)
        self._failures_in_a_row: tuple[int | None, int] = (None, 0)   # (worker, count)
        self.command = list(command)
        self.workers = workers
        self.max_restarts = max_restarts
        self.host = host
        self.port_base = port_base
        self.grace_period = grace_period
        self.log = log or sys.stderr
        self.output = output or sys.stdout
        self.worker_env = worker_env   # per worker index, e.g. its GPUs (`gpu_worker_env`)
        self.no_progress_seconds = no_progress_seconds   # hang reports (`_hang_collector`)
        self.gang: Gang | None = None
        self.starts = PreloadedStarts(self._say) if preload else None
        self._signalled: int | None = None
        self._signal_count = 0
        self._signal_deadline = 0.0

    def _say(self, message: str) -> None:
        self.log.write(f"[launcher] {message}\n")
        self.log.flush()

    def _on_signal(self, signum, frame) -> None:
        del frame
        self._signal_count += 1
        name = signal.Signals(signum).name
        if self._signalled is not None:
            self._say(f"received {name} again; killing every worker now (SIGKILL)")
            if self.gang is not None:
                self.gang.kill()
            return
        self._signalled = signum
        self._signal_deadline = time.monotonic() + self.grace_period
        self._say(f"received {name}; forwarding it to every worker, SIGKILL for any still running "
                  f"in {self.grace_period:g} s (a second signal kills them now)")
        if self.gang is not None:
            self.gang.signal_all(signum)

    def _wait_for_gang(self) -> tuple[int | None, int | None]:
        """`Gang.wait`'s result, or `(None, None)` as soon as the launcher is signalled.

        Workers need not exit on the forwarded signal, so the grace period is counted from
        the signal, not from whenever they choose to exit.
        """
        while self._signalled is None:
            try:
                return self.gang.wait(timeout=0.1)
            except TimeoutError:
                pass
        return None, None

    def _stop_gang(self) -> list[int]:
        if self._signalled is None:
            return self.gang.stop()
        return self.gang.stop(signum=None,
                              grace_period=self._signal_deadline - time.monotonic())

    def _report_signal(self, elapsed: float, overdue: list[int]) -> int:
        name = signal.Signals(self._signalled).name
        if self._signal_count > 1:
            outcome = "killed every worker on the second signal"
        elif overdue:
            outcome = (f"worker(s) {', '.join(map(str, overdue))} still running after the "
                       f"{self.grace_period:g} s grace period, killed (SIGKILL)")
        else:
            outcome = "every worker exited"
        self._say(f"stopped by {name} after {elapsed:.1f} s: {outcome}; "
                  f"exiting with {128 + self._signalled}")
        return 128 + self._signalled

    def run(self) -> int:
        """Runs until success, a signal, or the restart budget is spent; returns the exit code."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handlers[signum] = signal.signal(signum, self._on_signal)
        try:
            return self._run_attempts()
        finally:
            if self.gang is not None:
                self.gang.stop()
            if self.starts is not None:
                self.starts.stop()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    def _run_attempts(self) -> int:
        for attempt in range(self.max_restarts + 1):
            if self._signalled is not None:
                # Signalled between attempts: starting workers now would only mean killing them.
                return self._report_signal(0.0, [])
            self.gang = Gang(self.command, self.workers, self.host, self.port_base,
                             self.grace_period, attempt, worker_env=self.worker_env,
                             start_process=self.starts or subprocess.Popen)
            self._say(f"attempt {attempt + 1}/{self.max_restarts + 1}: starting {self.workers} "
                      f"worker(s) at {', '.join(self.gang.addresses)}")
            collector = self._hang_collector()
            if self.report:
                self.gang.extra_env[REPORT_ENV] = "1"
            started = time.monotonic()
            self.gang.start(self.output)
            code: int | None = None
            try:
                code, index = self._wait_for_gang()
            finally:
                overdue = self._stop_gang()
                self._close_hang_collector(collector, show_times=self.report or code != 0)
            elapsed = time.monotonic() - started
            if self._signalled is not None:
                return self._report_signal(elapsed, overdue)
            if code == 0:
                self._say(f"all {self.workers} worker(s) finished successfully in {elapsed:.1f} s")
                return 0
            reason = f"worker {index} failed with {describe_exit(code)} after {elapsed:.1f} s"
            if attempt < self.max_restarts:
                shrunk = self._shrink_after_failure(index)
                self._say(f"{reason}; stopped the others; restarting the gang{shrunk} "
                          f"(restart {attempt + 1} of {self.max_restarts})")
                continue
            budget = f" and {self.max_restarts} restart(s) were used" if self.max_restarts else ""
            self._say(f"{reason}; stopped the others{budget}; giving up")
            return exit_code_of(code)
        raise AssertionError("unreachable")


    def _shrink_after_failure(self, index: int | None) -> str:
        """Drops one worker when worker `index` failed `shrink_after` times in a row (and the
        gang is above `min_workers`); returns the reason to print, or ''."""
        worker, count = self._failures_in_a_row
        count = count + 1 if index == worker else 1
        self._failures_in_a_row = (index, count)
        if self.min_workers is None or count < self.shrink_after or self.workers <= self.min_workers:
            return ""
        self._failures_in_a_row = (None, 0)
        self.workers -= 1
        return (f" with one worker fewer ({self.workers + 1} -> {self.workers}, --min-workers "
                f"{self.min_workers}): worker {index} failed "
                + ("once" if count == 1 else f"{count} times in a row") + ", as a lost machine does")

    def _hang_collector(self):
        """Listens for the gang's progress, hang reports and verdict (`keras_mwms.diagnostics`)."""
        from keras_mwms.diagnostics.channel import LAUNCHER_ADDRESS_ENV
        from keras_mwms.diagnostics.collector import HangCollector

        try:
            collector = HangCollector(self.gang.addresses, "0.0.0.0", self.no_progress_seconds, self.log)
        except OSError as error:
            self._say(f"no hang reports through the launcher: cannot listen on UDP ({error})")
            return None
        collector.address = f"{self.host}:{collector.channel.address[1]}"
        self.gang.extra_env[LAUNCHER_ADDRESS_ENV] = collector.address
        collector.start()
        return collector

    def _close_hang_collector(self, collector, show_times: bool) -> None:
        """Stops listening; with `show_times` (a failed run, or `--report`), prints where each
        worker's time went (data, compute, collectives)."""
        if collector is None:
            return
        collector.close()
        table = collector.time_table() if show_times else ""
        if table:
            self._say("where each worker's time went (seconds; from its collective ledger):")
            for line in table.splitlines():
                self._say(f"  {line}")


def build_parser(prog: str = "python -m keras_mwms.launch") -> argparse.ArgumentParser:
    """The launcher's command-line interface."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start N local workers of a Keras script with TF_CONFIG set, watch them, "
                    "stop them together, and optionally restart the gang.",
        epilog="Example: %(prog)s --workers 2 --max-restarts 3 train.py --epochs 5",
    )
    parser.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    parser.add_argument("--min-workers", type=int, default=None, metavar="M",
                        help="after one worker fails --shrink-after times in a row, restart the "
                             "gang with one worker fewer, down to M (default: never shrink)")
    parser.add_argument("--shrink-after", type=int, default=2, metavar="K",
                        help="failures in a row of one worker that shrink the gang (default 2)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="restart the whole gang up to this many times after a failure (default 0)")
    parser.add_argument("--host", default="localhost",
                        help="host name in TF_CONFIG addresses (default localhost)")
    parser.add_argument("--port-base", type=int, default=None, metavar="PORT",
                        help="worker i listens on PORT + i (default: free ports)")
    parser.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD_SECONDS, metavar="SECONDS",
                        help="seconds between SIGTERM and SIGKILL when stopping workers "
                             f"(default {DEFAULT_GRACE_PERIOD_SECONDS:g})")
    parser.add_argument("--gpus-per-worker", default=assignment.AUTO, metavar="K",
                        help="GPUs each worker trains on, via its CUDA_VISIBLE_DEVICES: 'auto' "
                             "(default: one per worker when the host has a GPU per worker), a "
                             "number K (TensorFlow and JAX use several as local replicas; torch "
                             "takes 1), 'all' (every worker sees every GPU: one TensorFlow worker "
                             "with all GPUs as local replicas), or 0 (the CPU)")
    parser.add_argument("--no-progress-seconds", type=float, default=DEFAULT_NO_PROGRESS_SECONDS,
                        metavar="SECONDS", help="ask every worker for a hang report when none made progress (a train "
                             f"step or a collective) this long (default {DEFAULT_NO_PROGRESS_SECONDS:g}; "
                             "0: never); the verdict is printed here too")
    parser.add_argument("--report", action="store_true",
                        help="print where each worker's time went after every run (by default "
                             "only after a failed one) and every epoch's straggler table (by "
                             "default only one that names a straggler)")
    parser.add_argument("--preload", action="store_true",
                        help="import Keras, its backend and keras_mwms once in a helper process and "
                             "fork every worker and every restart from it: a restart starts in a "
                             "fraction of a second instead of paying the imports again (also "
                             f"{settings.PRELOAD.name}=1; a worker a fork cannot start as a fresh "
                             "process starts fresh, and the launcher says why)")
    parser.add_argument("-m", dest="module", default=None,
                        help="run a module (like python -m) instead of a script")
    parser.add_argument("script_and_args", nargs=argparse.REMAINDER,
                        help="the training script and its arguments")
    return parser


def command_from_arguments(arguments: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Turns parsed arguments into the worker command line, or exits with a usage error."""
    rest = list(arguments.script_and_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if arguments.module:
        return [sys.executable, "-u", "-m", arguments.module, *rest]
    if not rest:
        parser.error("give the training script to run (or -m module)")
    if not os.path.exists(rest[0]):
        parser.error(f"script {rest[0]!r} not found")
    return [sys.executable, "-u", *rest]


def gpu_worker_env(workers: int, gpus_per_worker: str = assignment.AUTO, environ=None,
                   log=None) -> dict[int, dict[str, str]]:
    """Each worker's `CUDA_VISIBLE_DEVICES` and `KERAS_MWMS_GPUS_PER_WORKER` (nothing on a CPU host).

    Raises `keras_mwms.devices.assignment.GpuAssignmentError` when the request does not fit the host.

    Example:

    >>> gpu_worker_env(2, "auto", {"CUDA_VISIBLE_DEVICES": "4,5,6", "KERAS_BACKEND": "torch"},
    ...                log=open("/dev/null", "w"))[1]
    {'CUDA_VISIBLE_DEVICES': '5', 'KERAS_MWMS_GPUS_PER_WORKER': '1'}
    >>> gpu_worker_env(2, "auto", {"CUDA_VISIBLE_DEVICES": ""})
    {}
    """
    environ = os.environ if environ is None else environ
    per_worker = assignment.parse_gpus_per_worker(gpus_per_worker)
    names = devices.visible_gpu_names(environ)
    backend = devices.configured_backend_name(environ)
    plan = assignment.plan_launch(backend, workers, names, per_worker)
    if plan is None:
        return {}
    share = "all" if per_worker == assignment.ALL else str(len(plan[0].split(",")) if plan[0] else 0)
    log = log or sys.stderr
    listing = "; ".join(f"worker {index}: {visible or 'CPU'}" for index, visible in enumerate(plan))
    used = {name for visible in plan for name in visible.split(",") if name}
    idle = f"; {len(names) - len(used)} GPU(s) left idle" if 0 < len(used) < len(names) else ""
    log.write(f"[launcher] GPUs ({backend}, --gpus-per-worker {gpus_per_worker}): "
              f"CUDA_VISIBLE_DEVICES {listing}{idle}\n")
    log.flush()
    return {index: {"CUDA_VISIBLE_DEVICES": visible, assignment.GPUS_PER_WORKER_ENV: share}
            for index, visible in enumerate(plan)}


def main(argv: Sequence[str] | None = None, prog: str = "python -m keras_mwms.launch") -> int:
    """Entry point of `python -m keras_mwms.launch` and `keras-mwms launch`."""
    parser = build_parser(prog)
    arguments = parser.parse_args(argv)
    if arguments.workers < 1:
        parser.error(f"--workers must be at least 1, got {arguments.workers}")
    if arguments.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {arguments.max_restarts}")
    if arguments.min_workers is not None and not 1 <= arguments.min_workers <= arguments.workers:
        parser.error(f"--min-workers must be between 1 and --workers ({arguments.workers}), got "
                     f"{arguments.min_workers}")
    if arguments.shrink_after < 1:
        parser.error(f"--shrink-after must be >= 1, got {arguments.shrink_after}")
    if arguments.port_base is not None and not 1 <= arguments.port_base <= 65535 - arguments.workers:
        parser.error(f"--port-base {arguments.port_base} leaves no room for "
                     f"{arguments.workers} ports below 65536")
    command = command_from_arguments(arguments, parser)
    missing = devices.missing_backend_error()
    if missing is not None:   # every worker would fail importing it: say the install line once
        parser.error(str(missing))
    try:
        worker_env = gpu_worker_env(arguments.workers, arguments.gpus_per_worker)
    except assignment.GpuAssignmentError as error:
        parser.error(str(error))
    launcher = Launcher(command, arguments.workers, arguments.max_restarts, arguments.host,
                        arguments.port_base, arguments.grace_period, worker_env=worker_env,
                        no_progress_seconds=arguments.no_progress_seconds or None,
                        min_workers=arguments.min_workers, shrink_after=arguments.shrink_after,
                        report=arguments.report, preload=arguments.preload or settings.PRELOAD.read())
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
