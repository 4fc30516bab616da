"""Test workers forked from a process that has already imported Keras: start-up paid once.

Most of a test worker's start-up is `import keras` with its backend and `import keras_mwms`
(2–5 CPU seconds each here), and the suite starts hundreds of workers. A *preloaded process*
pays that import once per backend and environment, then forks one child per worker it is asked
for: the child sets the worker's environment, folder and argv, and runs the worker's script as
`python -u script.py args` would (its `__main__`, its exit code, its `atexit` handlers). A forked
child is a new process in every sense the tests check (its own pid, process group, TF_CONFIG,
rendezvous, ports and collectives); only the imports are shared, before any backend state exists.

`popen(argv, env, ...)` is the one entry point: it answers a `subprocess.Popen` (or an object
with the same `pid`, `stdout`, `poll`, `wait`, `returncode`, `send_signal`, `kill`) and forks
only where that is the same as a fresh start:

* the command is this interpreter running a script, `-m module` or `-c code` (with `-u` at most);
* every variable read at import time (Keras', TensorFlow's, JAX's, torch's, Python's, threads)
  has the value a preloaded process was started with: processes are keyed by those values, and
  the first of a key is started on demand (one per backend in a typical run);
* the preloaded process still has one thread after its imports (forking a threaded process is
  not safe; it then answers "no" and every request of that key starts a fresh process).

`KERAS_MWMS_TEST_FRESH_PROCESSES=1` turns forking off for a run (every worker a fresh process).
Where freshness is the point of a test (first-run output, version overlays, a crash at import)
the test keeps `subprocess.Popen`.

Protocol: a request is one JSON line (argv after the interpreter, env, cwd) sent with the
child's stdin and stdout (stderr joins stdout) descriptors (SCM_RIGHTS) over a Unix socket; the
answer is one line with the child's pid, then, on the same connection, one line with its wait
status and CPU seconds when it ends (the preloaded process reaps it: `reaped_cpu_seconds()` is
what `tests/suite_budget.py` adds to the session's own children). A preloaded process lives until
the session's pid is gone (not a parent-death signal: that one follows the *thread* that started
it, and the suite starts them from pool threads); at most `MAX_RUNNING` run at once.

    process = popen([sys.executable, "-u", "tests/workers/fit_scenario.py"], env=worker_env("torch"))
    output = process.stdout.read()      # the worker's stdout and stderr
    assert process.wait(timeout=300) == 0
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from keras_mwms.launch import _die_with_parent

REPO = Path(__file__).resolve().parent.parent
FRESH_ENV = "KERAS_MWMS_TEST_FRESH_PROCESSES"
# Variables a process reads while importing Keras, its backend or keras_mwms (or at interpreter
# start-up): a child forked after those imports must have the values its preloaded process had.
IMPORT_TIME_PREFIXES = ("KERAS_", "TF_", "JAX_", "XLA_", "PYTHON", "OMP_", "MKL_", "CUDA_", "TORCH_",
                        "LD_", "TPU_", "NVIDIA_", "HIP_", "ROCR_")
# ... except these, read when the strategy starts (a worker's identity, its GPUs, XLA's flags).
READ_LATER = ("TF_CONFIG", "KERAS_MWMS_", "PYTHONUNBUFFERED", "TF_XLA_FLAGS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES",
              "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# pyarrow (imported by Keras through pandas) starts jemalloc's background thread at load; a
# process forked with it would hold a copy of a lock without its owner. Off in the preloaded
# process only (the children allocate as they would, minus that thread).
SINGLE_THREADED = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}
MAX_RUNNING = 6         # preloaded processes alive at once (the suite's environments: about 12)
START_TIMEOUT = 120     # seconds for a preloaded process to import and answer (3-5 s here)
ANSWER_TIMEOUT = 30     # seconds for a running one to answer a request with the child's pid


def import_time_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` read at import time (see `IMPORT_TIME_PREFIXES`), sorted."""
    return tuple(sorted((name, value) for name, value in env.items()
                        if name.startswith(IMPORT_TIME_PREFIXES) and not name.startswith(READ_LATER)))


def _parse(argv: list[str]) -> list[str] | None:
    """argv after the interpreter, as ["script", path, ...], ["module", name, ...] or
    ["code", code, ...]; None for any other form (another interpreter, other flags)."""
    if not argv or argv[0] != sys.executable:
        return None
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if not rest:
        return None
    if rest[0] == "-m" and len(rest) >= 2:
        return ["module", *rest[1:]]
    if rest[0] == "-c" and len(rest) >= 2:
        return ["code", *rest[1:]]
    if rest[0].startswith("-"):
        return None
    return ["script", *rest]


class ForkedProcess:
    """A child of a preloaded process, held like a `subprocess.Popen` (the methods the test
    helpers and `keras_mwms.launch.Gang` use)."""

    def __init__(self, pid: int, connection: socket.socket, stdout, argv: list[str], pending: bytes,
                 owner: _Preloaded):
        self.pid = pid
        self.args = argv
        self.stdout = stdout
        self.stderr = None
        self.returncode: int | None = None
        self._connection = connection
        self._pending = pending   # what came after the pid line (the status, if it ended at once)
        self._lock = threading.Lock()
        self.owner = owner

    def poll(self) -> int | None:
        return self._read_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._read_status(0.2 if left is None else min(0.2, left)) is not None:
                return self.returncode
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)

    def _read_status(self, seconds: float) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            readable, _, _ = select.select([self._connection], [], [], seconds)
            if readable:
                chunk = self._connection.recv(4096)
                self._pending += chunk
                if b"\n" in self._pending:
                    status, cpu = self._pending.split(b"\n")[0].split()
                    self.returncode = os.waitstatus_to_exitcode(int(status))
                    _count_cpu(float(cpu), self.owner)
                elif not chunk:   # the preloaded process died: its children died with it
                    self.returncode = -signal.SIGKILL
                if self.returncode is not None:
                    self._connection.close()
            return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Preloaded:
    """One running preloaded process (client side)."""

    def __init__(self, env: dict[str, str]):
        self.environment = env
        self.folder = tempfile.mkdtemp(prefix="preloaded-")
        self.address = os.path.join(self.folder, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-u", __file__, self.address, str(os.getpid())], env={**env, **SINGLE_THREADED},
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.ready: bool | None = None
        self.startup_output = ""
        self.forked = 0
        self.children_cpu = 0.0   # reported by it for its ended children (it reaped them)
        self.children: list[ForkedProcess] = []
        self.last_used = time.monotonic()
        self.lock = threading.Lock()   # one caller waits for "ready"; the others wait for it

    def wait_ready(self) -> bool:
        """True once the process answered "ready"; False (and stopped) if it will not fork."""
        if self.ready is None:
            deadline = time.monotonic() + START_TIMEOUT
            lines = []
            while self.ready is None:
                readable, _, _ = select.select([self.process.stdout], [], [],
                                               max(0.0, deadline - time.monotonic()))
                line = self.process.stdout.readline() if readable else b""
                if line.strip() == b"ready":
                    self.ready = True
                elif not line:   # ended, or no answer in time
                    self.ready = False
                else:            # the imports' own output (TensorFlow's start-up lines)
                    lines.append(line.decode(errors="replace"))
            self.startup_output = "".join(lines)
            if self.ready:   # whatever it prints later (it should not) never fills the pipe
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
            else:
                self.stop()
        return self.ready

    def fork(self, command: list[str], env: dict[str, str], cwd: str, stdin: int,
             stdout: int) -> tuple[int, socket.socket, bytes]:
        """Asks for a child; once it runs, returns its pid, the connection its status will come
        on, and what already came after the pid."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(ANSWER_TIMEOUT)
        connection.connect(self.address)
        request = json.dumps({"command": command, "env": env, "cwd": cwd}).encode() + b"\n"
        socket.send_fds(connection, [request], [stdin, stdout])
        answer = b""
        while b"\n" not in answer:
            chunk = connection.recv(4096)
            if not chunk:
                raise OSError(f"preloaded process {self.process.pid} closed the connection without a pid")
            answer += chunk
        line, _, rest = answer.partition(b"\n")
        connection.settimeout(None)
        return int(line), connection, rest

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        # Reaping it added its reaped children's CPU to this process's RUSAGE_CHILDREN, which
        # `reaped_cpu_seconds()` already counted: once only.
        _count_cpu(-self.children_cpu)
        self.children_cpu = 0.0
        if self.ready is False:
            self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)   # its socket


_preloaded: dict[tuple, _Preloaded] = {}
_lock = threading.RLock()   # re-entered: stopping one under it counts CPU under it
_reaped_cpu = [0.0]
_stopped: list = []   # preloaded processes stopped to make room, kept for the summary


def _count_cpu(seconds: float, owner: _Preloaded | None = None) -> None:
    with _lock:
        _reaped_cpu[0] += seconds
        if owner is not None:
            owner.children_cpu += seconds


def _stop_idle_beyond(count: int) -> None:
    """Stops the least recently used preloaded processes with no running child until at most
    `count` run (each holds its imports' memory, 0.3-0.8 GB here). Called under `_lock`."""
    running = [item for item in _preloaded.items() if item[1].ready and item[1].process.poll() is None]
    running.sort(key=lambda item: item[1].last_used)
    for key, preloaded in running[:max(0, len(running) - count)]:
        if not any(child.poll() is None for child in preloaded.children):
            preloaded.stop()
            del _preloaded[key]
            _stopped.append(preloaded)


def reaped_cpu_seconds() -> float:
    """CPU seconds of the forked children that ended so far (reaped by their preloaded process,
    so not in this process's `RUSAGE_CHILDREN`): `tests/suite_budget.py` adds them."""
    return _reaped_cpu[0]


def summary() -> str:
    """One line for the suite's time table: how many workers were forked, from how many
    preloaded processes, and how many fell back to a fresh start."""
    every = [*_preloaded.values(), *_stopped]
    ready = [preloaded for preloaded in every if preloaded.ready]
    forked = sum(preloaded.forked for preloaded in ready)
    refused = len(every) - len(ready)
    return (f"{forked} workers forked from {len(ready)} preloaded processes (start-up paid once each)"
            + (f"; {refused} environment(s) could not preload and started fresh" if refused else ""))


def details() -> list[dict]:
    """Per preloaded process: its import-time variables, whether it forked, how many children."""
    return [{"environment": dict(import_time_key(preloaded.environment)), "ready": preloaded.ready,
             "forked": preloaded.forked, "running": preloaded.process.poll() is None}
            for preloaded in [*_preloaded.values(), *_stopped]]


@atexit.register
def _stop_all() -> None:
    for preloaded in _preloaded.values():
        preloaded.stop()


def _preloaded_for(env: dict[str, str]) -> _Preloaded | None:
    key = import_time_key(env)
    with _lock:
        if key not in _preloaded:
            _stop_idle_beyond(MAX_RUNNING - 1)
            _preloaded[key] = _Preloaded({name: value for name, value in env.items()
                                          if name not in ("TF_CONFIG",)})
        preloaded = _preloaded[key]
    with preloaded.lock:
        if preloaded.wait_ready() and preloaded.process.poll() is not None:   # it died: start another
            with _lock:
                if _preloaded.get(key) is preloaded:
                    del _preloaded[key]
            return _preloaded_for(env)
        return preloaded if preloaded.ready else None


def popen(argv, env: dict[str, str], cwd=None, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, start_new_session: bool = True, preexec_fn=None):
    """`subprocess.Popen(argv, env=env, cwd=cwd, stdin, stdout=PIPE, stderr=STDOUT,
    start_new_session=True)`, forked from a preloaded process where that is the same (see the
    module docstring); stdout is a pipe the caller reads, stderr goes with it."""
    argv = [str(part) for part in argv]
    command = _parse(argv)
    fresh = (command is None or os.environ.get(FRESH_ENV) == "1" or stdout is not subprocess.PIPE
             or stderr is not subprocess.STDOUT or stdin is not subprocess.DEVNULL or not start_new_session)
    preloaded = None if fresh else _preloaded_for(env)
    if preloaded is not None:
        read_end, write_end = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            pid, connection, rest = preloaded.fork(command, env, str(cwd or os.getcwd()), devnull, write_end)
        except OSError:   # it ended meanwhile (the next request starts another): start this one fresh
            os.close(read_end)
            preloaded = None
        finally:
            os.close(write_end)
            os.close(devnull)
    if preloaded is None:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                start_new_session=start_new_session, preexec_fn=preexec_fn)
    process = ForkedProcess(pid, connection, os.fdopen(read_end, "rb"), argv, rest, preloaded)
    with _lock:   # the same lock `_stop_idle_beyond` reads `children` under: no running child missed
        preloaded.forked += 1
        preloaded.children = [child for child in preloaded.children if child.poll() is None] + [process]
        preloaded.last_used = time.monotonic()
    return process


# ---------------------------------------------------------------- the preloaded process itself


def _serve(address: str, parent: int) -> None:
    """Imports, then forks a child per request until `parent` (the test session) is gone.

    The session is watched by its pid, not by a parent-death signal: that signal follows the
    *thread* that started this process, and sessions start it from short-lived pool threads."""
    import keras  # noqa: F401  (the imports every worker would pay; keras_mwms.launch is imported above)

    import keras_mwms  # noqa: F401
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        print(f"not forking: {threads} threads after the imports", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        if os.getppid() != parent:
            return   # the children die with this process (their parent-death signal)
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            connection, _ = listener.accept()
            child = _fork_one(listener, connection, children)
            if child:
                children[child] = connection
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(f"{status} {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
                except OSError:
                    pass
                connection.close()


def _fork_one(listener, connection, children) -> int | None:
    connection.settimeout(ANSWER_TIMEOUT)
    try:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
        while not message.endswith(b"\n"):
            more = connection.recv(1 << 20)
            if not more:
                raise OSError("request cut short")
            message += more
    except OSError:
        connection.close()
        return None
    request = json.loads(message)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        connection.sendall(f"{pid}\n".encode())
        return pid
    try:
        listener.close()
        for other in children.values():
            other.close()
        connection.close()
        os.setsid()
        _die_with_parent()
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        code = _run(request)
    except BaseException:   # noqa: BLE001 - the child must never return into the server loop
        import traceback
        traceback.print_exc()
        code = 1
    os._exit(code)


def _run(request) -> int:
    """In the child: the worker's environment, folder, streams and `__main__`, as the
    interpreter would set them up; runs it and answers its exit code."""
    import builtins
    import io
    import runpy
    import traceback
    import types
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    # As `python -u` (the gangs set PYTHONUNBUFFERED): every write reaches the pipe at once.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")
    kind, target, *arguments = request["command"]
    code = 0
    try:
        if kind == "module":
            sys.argv = [target, *arguments]
            sys.path.insert(0, os.getcwd())
            runpy._run_module_as_main(target, alter_argv=False)
        else:
            main = types.ModuleType("__main__")
            main.__builtins__ = builtins
            sys.modules["__main__"] = main
            if kind == "script":
                path = os.path.abspath(target)
                sys.argv = [target, *arguments]
                sys.path.insert(0, os.path.dirname(path))
                main.__file__ = target
                with open(path, "rb") as source:
                    code_object = compile(source.read(), target, "exec")
            else:
                sys.argv = ["-c", *arguments]
                sys.path.insert(0, "")
                code_object = compile(target, "<string>", "exec")
            exec(code_object, main.__dict__)
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:   # noqa: BLE001 - as the interpreter: the traceback, then exit 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()   # as the interpreter does: non-daemon threads end first
    except BaseException:   # noqa: BLE001
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    del sys.path[0]   # this folder: a worker's sys.path starts with its own script's folder
    _serve(sys.argv[1], int(sys.argv[2]))
