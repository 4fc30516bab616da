"""Workers forked from a process that has already imported Keras: start-up paid once.

Most of a worker's start-up is `import keras` with its backend and `import keras_mwms` (2-5 CPU
seconds on a laptop core, more on a loaded node), and a launcher pays it again for every worker
and every restart. A *preloaded process* (`PreloadedProcess`) pays it once: started with the
workers' environment, it imports Keras, the backend and keras_mwms, then forks one child per
worker it is asked for. The child sets the worker's environment, folder and argv and runs the
worker's command as `python -u script.py args` (or `-m module`, `-c code`) would: its
`__main__`, its `atexit` handlers, its exit code. It is a new process in every sense a job sees
(its own pid, process group, `TF_CONFIG`, rendezvous, ports and collectives); only the imports
are shared, made before any backend state exists. `python -m keras_mwms.launch --preload` uses
it for every worker and every restart.

Forking is the same as a fresh start only where

* the command is this interpreter running a script, `-m module` or `-c code` (`-u` at most;
  `forkable_command`);
* every variable read at import time (Keras', TensorFlow's, JAX's, torch's, Python's, the
  thread counts') has the preloaded process's value (`import_time_key`); a worker's identity
  (`TF_CONFIG`, `KERAS_MWMS_*`, `CUDA_VISIBLE_DEVICES`, ...) is read later and may differ;
* the preloaded process still has one thread after its imports (forking a threaded process
  copies locks without their owners: it imports with numpy's OpenBLAS pool and pyarrow's
  allocator thread off, `SINGLE_THREADED`), and no device runtime started (CUDA, JAX's backends,
  TensorFlow's devices: a worker's GPUs are chosen by its `CUDA_VISIBLE_DEVICES`, read when
  its runtime starts; none of the three starts one at import).

Elsewhere `PreloadedProcess.start` answers None with the reason in `refusal`, and the caller
starts that worker fresh.

Protocol: a request is one JSON line (the command, the environment, the folder, the niceness) sent with the
child's stdin and stdout descriptors (`SCM_RIGHTS`; stderr joins stdout) over a Unix socket; the
answer is one line with the child's pid, then, on the same connection when it ends, one line
with its wait status and CPU seconds (the preloaded process reaps it). A preloaded process lives
until it is stopped or the process that started it is gone; its children then die with it
(`die_with_parent`).

Pure Python on the caller's side: only the preloaded process imports an ML framework.

Example:

>>> import os, subprocess, sys
>>> env = {**os.environ, "KERAS_BACKEND": "jax"}
>>> preloaded = PreloadedProcess(env)
>>> child = preloaded.start([sys.executable, "-c", "import sys; print('keras' in sys.modules)"], env)
>>> child.stdout.read(), child.wait(timeout=60)
(b'True\\n', 0)
>>> preloaded.stop()
"""

from __future__ import annotations

import ctypes
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
from collections.abc import Callable

# Variables a process reads while importing Keras, its backend or keras_mwms (or at interpreter
# start-up): a child forked after those imports must have the values its preloaded process had.
IMPORT_TIME_PREFIXES = ("KERAS_", "TF_", "JAX_", "XLA_", "PYTHON", "OMP_", "MKL_", "CUDA_", "TORCH_",
                        "LD_", "TPU_", "NVIDIA_", "HIP_", "ROCR_")
# ... except these, read when the strategy starts (a worker's identity, its GPUs, XLA's flags).
READ_LATER = ("TF_CONFIG", "KERAS_MWMS_", "PYTHONUNBUFFERED", "TF_XLA_FLAGS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES",
              "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# Threads started at import, off in the preloaded process only (a process forked with them
# would hold copies of locks without their owners): pyarrow's jemalloc background thread
# (pyarrow comes with Keras through pandas; the children allocate as they would, minus that
# thread) and numpy's OpenBLAS pool, which starts `OMP_NUM_THREADS` - 1 threads at import (the
# launcher sets cores ÷ workers; the children's numpy BLAS then runs on one thread, while
# TensorFlow's and torch's pools are sized when the strategy starts). A user's own
# OPENBLAS_NUM_THREADS wins (and above 1 it keeps the process from forking).
SINGLE_THREADED = {"JE_ARROW_MALLOC_CONF": "background_thread:false", "OPENBLAS_NUM_THREADS": "1"}
START_TIMEOUT_SECONDS = 120    # for the imports and the first answer (3-5 s on a laptop)
ANSWER_TIMEOUT_SECONDS = 30    # for a running preloaded process to answer with a child's pid
_PR_SET_PDEATHSIG = 1
_OUTPUT_KEPT = 8000            # characters of the preloaded process's own output kept for messages


def die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (`PR_SET_PDEATHSIG`).

    Run in a child before it execs (`subprocess.Popen(preexec_fn=die_with_parent)`) or, in a
    forked worker, at its start. Does nothing where the call is not available.

    Example:

    >>> import subprocess, sys
    >>> subprocess.run([sys.executable, "-c", "pass"], preexec_fn=die_with_parent).returncode
    0
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def import_time_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` read at import time (`IMPORT_TIME_PREFIXES` but `READ_LATER`), sorted.

    Example:

    >>> import_time_key({"KERAS_BACKEND": "jax", "TF_CONFIG": "{}", "HOME": "/root"})
    (('KERAS_BACKEND', 'jax'),)
    """
    return tuple(sorted((name, value) for name, value in env.items()
                        if name.startswith(IMPORT_TIME_PREFIXES) and not name.startswith(READ_LATER)))


def forkable_command(argv: list[str]) -> list[str] | None:
    """`argv` after the interpreter as `["script", path, ...]`, `["module", name, ...]` or
    `["code", code, ...]`; None for any other form (another interpreter, other flags).

    Example:

    >>> import sys
    >>> forkable_command([sys.executable, "-u", "-m", "train", "--epochs", "2"])
    ['module', 'train', '--epochs', '2']
    >>> forkable_command(["nice", sys.executable, "train.py"]) is None
    True
    """
    argv = [str(part) for part in argv]
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
    """A child of a preloaded process, held like a `subprocess.Popen` (`pid`, `args`, `stdout`,
    `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`).

    `stdout` is the read end of the pipe its stdout and stderr write to; `on_exit(cpu_seconds)`
    is called once with its user + system CPU seconds when its end is read.
    """

    def __init__(self, pid: int, connection: socket.socket, stdout, argv: list[str], pending: bytes,
                 on_exit: Callable[[float], None] | None = None):
        self.pid = pid
        self.args = argv
        self.stdout = stdout
        self.stderr = None
        self.returncode: int | None = None
        self._connection = connection
        self._pending = pending   # what came after the pid line (the status, if it ended at once)
        self._lock = threading.Lock()
        self._on_exit = on_exit

    def poll(self) -> int | None:
        """Its exit code (minus the signal's number for a death by signal), or None while it runs."""
        return self._read_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        """Waits for its end (raises `subprocess.TimeoutExpired` after `timeout` seconds)."""
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
                    if self._on_exit is not None:
                        self._on_exit(float(cpu))
                elif not chunk:   # the preloaded process died: its children died with it
                    self.returncode = -signal.SIGKILL
                if self.returncode is not None:
                    self._connection.close()
            return self.returncode

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to it (nothing once it ended)."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """Sends SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Sends SIGKILL."""
        self.send_signal(signal.SIGKILL)


class PreloadedProcess:
    """One process that imports Keras, its backend and keras_mwms with `env`, then forks workers.

    Example:

    >>> import os, sys
    >>> env = {**os.environ, "KERAS_BACKEND": "jax"}
    >>> preloaded = PreloadedProcess(env)
    >>> preloaded.start([sys.executable, "-c", "raise SystemExit(3)"], env).wait(timeout=60)
    3
    >>> preloaded.start([sys.executable, "-c", "import os; print(os.nice(0))"], env, nice=5).stdout.read()
    b'5\\n'
    >>> preloaded.start(["nice", sys.executable, "-c", "pass"], env) is None, preloaded.refusal
    (True, 'the command is not this interpreter running a script, -m module or -c code')
    >>> preloaded.stop()

    Args:
        env: the environment it imports with; a worker whose import-time variables
            (`import_time_key`) differ is not forked.
        cwd: its folder (each child sets its own).
        start_timeout: seconds for the imports; a process that does not answer in time is
            stopped and forks nothing.
    """

    def __init__(self, env: dict[str, str], cwd: str | None = None,
                 start_timeout: float = START_TIMEOUT_SECONDS):
        self.key = import_time_key(env)
        self.folder = tempfile.mkdtemp(prefix="keras-mwms-preloaded-")
        self.address = os.path.join(self.folder, "socket")
        status_read, status_write = os.pipe()
        # The process's own folder entry leaves sys.path: a worker's sys.path starts with its own.
        code = ("import sys; del sys.path[0]; from keras_mwms.startup.preload import serve; "
                f"serve({self.address!r}, {os.getpid()}, {status_write})")
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-c", code], env={**SINGLE_THREADED,
                                                     **{k: v for k, v in env.items() if k != "TF_CONFIG"}},
            cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            pass_fds=(status_write,), start_new_session=True)   # a terminal's Ctrl-C is the caller's to forward
        os.close(status_write)
        self._status = os.fdopen(status_read, "rb")
        self._deadline = time.monotonic() + start_timeout
        self._output: list[str] = []
        threading.Thread(target=self._keep_output, daemon=True).start()
        self.ready: bool | None = None
        self.refusal: str | None = None   # why the last `start` answered None
        self.not_ready_reason = ""        # why it does not fork, once `wait_ready` said False
        self.forked = 0
        self.lock = threading.Lock()      # one caller waits for "ready"; the others wait for it

    def _keep_output(self) -> None:
        for line in iter(self.process.stdout.readline, b""):
            self._output.append(line.decode(errors="replace"))
            while sum(map(len, self._output)) > _OUTPUT_KEPT and len(self._output) > 1:
                del self._output[0]
        self.process.stdout.close()

    @property
    def output(self) -> str:
        """The end of what the process printed itself (its imports' warnings, a traceback)."""
        return "".join(self._output)

    def wait_ready(self) -> bool:
        """True once its imports are done and it forks; False (and stopped) if it will not."""
        with self.lock:
            if self.ready is None:
                readable, _, _ = select.select([self._status], [], [],
                                               max(0.0, self._deadline - time.monotonic()))
                line = self._status.readline().decode(errors="replace").strip() if readable else ""
                self._status.close()
                self.ready = line == "ready"
                if not self.ready:
                    self.not_ready_reason = self._why_not_ready(line)
                    self.stop()
            return self.ready

    def _why_not_ready(self, line: str) -> str:
        if line:
            return line
        if self.process.poll() is None:
            return "no answer within the start timeout"
        last = self.output.strip().splitlines()[-1:] or ["(no output)"]
        return f"it exited with code {self.process.returncode} while importing: {last[0]}"

    def alive(self) -> bool:
        """Whether it still runs (and forks)."""
        return bool(self.ready) and self.process.poll() is None

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None = None,
              nice: int = 0) -> ForkedProcess | None:
        """Forks a worker running `argv` with `env` in `cwd` (at `nice` niceness, as `nice -n`
        would start it); its stdout and stderr come on the answer's `stdout` pipe, its stdin is
        /dev/null. None (the reason in `refusal`) where a fork is not the same as a fresh start."""
        command = forkable_command(argv)
        if command is None:
            return self._refuse("the command is not this interpreter running a script, -m module or -c code")
        if import_time_key(env) != self.key:
            changed = sorted({name for name, _ in set(import_time_key(env)) ^ set(self.key)})
            return self._refuse(f"{', '.join(changed)} differ from the preloaded process's (read at import)")
        if not self.wait_ready():
            return self._refuse(f"the preloaded process does not fork: {self.not_ready_reason}")
        if self.process.poll() is not None:
            return self._refuse(f"the preloaded process ended (exit code {self.process.returncode})")
        read_end, write_end = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            pid, connection, pending = self._request({"command": command, "env": env, "cwd": str(cwd or os.getcwd()),
                                                       "nice": nice}, devnull, write_end)
        except OSError as error:
            os.close(read_end)
            return self._refuse(f"the preloaded process did not answer ({error})")
        finally:
            os.close(write_end)
            os.close(devnull)
        self.forked += 1
        return ForkedProcess(pid, connection, os.fdopen(read_end, "rb"), [str(part) for part in argv], pending,
                             self._on_child_exit)

    def _on_child_exit(self, cpu_seconds: float) -> None:
        """Called with each child's CPU seconds when its end is read (subclasses count them)."""

    def _refuse(self, reason: str) -> None:
        self.refusal = reason
        return None

    def _request(self, request: dict, stdin: int, stdout: int) -> tuple[int, socket.socket, bytes]:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(ANSWER_TIMEOUT_SECONDS)
        try:
            connection.connect(self.address)
            socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [stdin, stdout])
            answer = b""
            while b"\n" not in answer:
                chunk = connection.recv(4096)
                if not chunk:
                    raise OSError(f"preloaded process {self.process.pid} closed the connection without a pid")
                answer += chunk
        except OSError:
            connection.close()
            raise
        line, _, rest = answer.partition(b"\n")
        connection.settimeout(None)
        return int(line), connection, rest

    def stop(self) -> None:
        """Stops it (its running children die with it) and removes its socket."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


# ---------------------------------------------------------------- the preloaded process itself


def serve(address: str, parent: int, status_fd: int) -> None:
    """Runs in the preloaded process: imports, says "ready" on `status_fd` (or why not), then
    forks a child per request on the Unix socket at `address` until `parent` is gone.

    The parent is watched by its pid, not by a parent-death signal: that signal follows the
    *thread* that started this process, and callers may start it from short-lived threads."""
    import keras  # noqa: F401  (the imports every worker would pay)

    import keras_mwms  # noqa: F401
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        os.write(status_fd, f"{threads} threads run after the imports (numpy's OpenBLAS pool: "
                            "OPENBLAS_NUM_THREADS=1); forking would copy their locks\n".encode())
        return
    started = _runtime_started()
    if started:   # every child would share one device runtime's state (and not its GPUs' choice)
        os.write(status_fd, f"{started} while importing; forking would share it\n".encode())
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    os.write(status_fd, b"ready\n")
    os.close(status_fd)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            connection, _ = listener.accept()
            child = _fork_one(listener, connection, children)
            if child:
                children[child] = connection
        _reap(children)
    # The caller is gone: so is this process, at once (no interpreter shutdown, which takes
    # seconds with a framework loaded), and with it its children (their parent-death signal).
    os._exit(0)


def _runtime_started() -> str | None:
    """Which device runtime the imports started, or None: a worker picks its devices later
    (`CUDA_VISIBLE_DEVICES`, read when the runtime starts), so none may have started here."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialized CUDA"
    if "jax" in sys.modules:
        from jax._src import xla_bridge
        if getattr(xla_bridge, "backends_are_initialized", lambda: False)():
            return "JAX initialized its backends"
    if "tensorflow" in sys.modules:
        from tensorflow.python.eager import context
        if getattr(context.context(), "_context_handle", None) is not None:
            return "TensorFlow initialized its devices"
    return None


def _reap(children: dict[int, socket.socket]) -> None:
    """Sends each ended child's wait status and CPU seconds on its connection."""
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(f"{status} {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
            except OSError:
                pass
            connection.close()


def _fork_one(listener, connection, children) -> int | None:
    connection.settimeout(ANSWER_TIMEOUT_SECONDS)
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
        die_with_parent()
        if request.get("nice"):
            os.nice(request["nice"])
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


def _set_up_child(request) -> None:
    """The worker's environment, folder and streams, as the interpreter sets them up for `-u`."""
    import io
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    # As `python -u`: every write reaches the pipe at once.
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")


def _run(request) -> int:
    """In the child: sets it up as a fresh worker, runs its `__main__`, answers its exit code."""
    import builtins
    import runpy
    import traceback
    import types
    _set_up_child(request)
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
                sys.argv = [target, *arguments]
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                main.__file__ = target
                with open(target, "rb") as source:
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
    return _finish(code)


def _finish(code: int) -> int:
    """As the interpreter ends: non-daemon threads first, then `atexit`, then the streams."""
    import atexit
    import traceback
    try:
        threading._shutdown()
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
    sys.stderr.flush()
    os.write(2, f"{value}\n".encode(errors="backslashreplace"))
    return 1
