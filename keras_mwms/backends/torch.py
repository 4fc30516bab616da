"""The PyTorch backend: `torch.distributed` collectives under Keras' torch trainer.

Keras 3.15.1 has no multi-process support on torch, so this adapter supplies all of it:

* **join** — `torch.distributed.init_process_group` at the chief's `TF_CONFIG` address (the
  port the rendezvous just released), bounded by `CommunicationOptions.timeout_seconds`
  (default `DEFAULT_COLLECTIVE_TIMEOUT_SECONDS`, far below torch's 30 minutes). AUTO picks
  nccl with CUDA and gloo otherwise, RING is gloo, NCCL without CUDA is refused at once.
* **collectives** — bucketed flat all-reduces, broadcasts and barriers. Every one is wrapped so
  that a crashed or hung peer ends *this* worker with a `WorkerLostError` naming the lost
  worker(s), tears the process group down, and guarantees the process exits non-zero.
* **training** — `keras_mwms.backends.torch_training` patches Keras' torch trainer for models
  created in `scope()`: broadcast from the chief, averaged gradients, global metrics, sharded
  inputs (`keras_mwms.backends.torch_data`), synchronized BatchNormalization.

One replica per worker process (one CPU or one GPU); several GPUs per worker are out of scope:
start one worker per GPU instead.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from keras_mwms import devices, network
from keras_mwms.backends.base import Backend
from keras_mwms.cluster import ClusterResolver, split_address
from keras_mwms.communication import CommunicationImplementation, CommunicationOptions
from keras_mwms.data import InputContext

DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 300.0
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# After a collective fails, survivors check in for this long to find out who is gone.
_LIVENESS_WINDOW_SECONDS = 3.0
# Upper bound for the process to end after a lost worker, even if gloo's teardown hangs.
_EXIT_WATCHDOG_SECONDS = 30.0
# At a normal exit, how long the chief waits for the other workers to sign off its store.
_SIGN_OFF_SECONDS = 10.0
LOCAL_WORKERS_ENV = "KERAS_MWMS_LOCAL_WORKERS"


def _bind_gloo_to(host: str) -> None:
    """Makes gloo listen on, and advertise, the interface holding this worker's TF_CONFIG host.

    By default gloo uses the address the machine's host name resolves to: often 127.0.0.1 from
    /etc/hosts, which it then advertises to peers on other machines, who cannot connect
    ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). `GLOO_SOCKET_IFNAME` is gloo's own
    setting; a value the user set is kept.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    interface = network.interface_of(host)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


class WorkerLostError(RuntimeError):
    """A peer crashed, hung or left; synchronous training cannot continue on any worker.

    Example:

    >>> issubclass(WorkerLostError, RuntimeError)
    True
    """


class NcclUnavailableError(RuntimeError):
    """`CommunicationImplementation.NCCL` was requested where torch cannot use NCCL.

    Example:

    >>> issubclass(NcclUnavailableError, RuntimeError)
    True
    """


def resolve_engine(implementation: CommunicationImplementation) -> str:
    """The `torch.distributed` backend name for a requested implementation.

    AUTO: nccl with CUDA, gloo otherwise. RING: gloo. NCCL: nccl, or `NcclUnavailableError` at
    once (before any network wait) when CUDA or NCCL is missing.

    Example:

    >>> resolve_engine(CommunicationImplementation.RING)
    'gloo'
    """
    has_cuda = devices.local_gpu_count() > 0
    if implementation == CommunicationImplementation.RING:
        return "gloo"
    if implementation == CommunicationImplementation.AUTO:
        return "nccl" if has_cuda and dist.is_nccl_available() else "gloo"
    if not has_cuda or not dist.is_nccl_available():
        missing = "no CUDA device is visible" if not has_cuda else "this torch build lacks NCCL"
        raise NcclUnavailableError(
            f"CommunicationImplementation.NCCL was requested but {missing} (torch "
            f"{torch.__version__}). Use CommunicationImplementation.AUTO (gloo on CPU) or RING, or "
            "run on a machine with CUDA GPUs and a CUDA build of torch."
        )
    return "nccl"


def default_thread_count() -> int:
    """Intra-op threads for one worker: cores ÷ local workers (at least 1).

    `KERAS_MWMS_LOCAL_WORKERS` is set by the launcher; oversubscribed cores made synchronous
    training several times slower in our probes.

    Example:

    >>> default_thread_count() >= 1
    True
    """
    try:
        local_workers = max(1, int(os.environ.get(LOCAL_WORKERS_ENV, "1")))
    except ValueError:
        local_workers = 1
    return max(1, (os.cpu_count() or 1) // local_workers)


class TorchBackend(Backend):
    """`torch.distributed` engine for `keras_mwms.MultiWorkerMirroredStrategy` on `KERAS_BACKEND=torch`.

    Built by the strategy; use it through the strategy, or directly for the primitives
    (`all_reduce`, `broadcast_object`, `barrier`).

    Example:

    ```python
    strategy = keras_mwms.MultiWorkerMirroredStrategy()     # KERAS_BACKEND=torch
    strategy.backend.broadcast_object({"run_id": 7})         # the chief's value everywhere
    ```

    Args:
        resolver: the validated cluster and this task.
        options: the user's `CommunicationOptions`.
    """

    name = "torch"

    def __init__(self, resolver: ClusterResolver, options: CommunicationOptions,
                 tf_config_at_creation: str = ""):
        super().__init__(resolver, options, tf_config_at_creation)
        self.timeout_seconds = float(options.timeout_seconds or DEFAULT_COLLECTIVE_TIMEOUT_SECONDS)
        self.bucket_bytes = options.bytes_per_pack or DEFAULT_BUCKET_BYTES
        self._engine: str | None = None
        self._joined = False
        self._tcp_store: dist.TCPStore | None = None   # the store of a process group we started
        self._scope_depth = 0
        self._scope_lock = threading.Lock()
        self._created_in_scope: dict[int, Any] = {}
        self._scope_exits = 0
        self._failure_count = 0
        # Rows of this worker's shard in the current training step (set by the train function)
        # and whether the loss was scaled by them (set by the optimizer's scale_loss).
        self.step_rows = 1
        self.loss_weighted_by_rows = False

    # -- identity -------------------------------------------------------------------------
    @staticmethod
    def version() -> str:
        return torch.__version__

    def engine_description(self) -> str:
        if self._engine is None:
            self._engine = resolve_engine(self.options.implementation)
        return self._engine

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers

    @property
    def distributed(self) -> bool:
        """True when collectives actually cross processes (more than one worker)."""
        return self._joined and self.num_workers > 1

    @property
    def device(self) -> torch.device:
        return torch.device(f"cuda:{torch.cuda.current_device()}") if self.engine_description() == "nccl" \
            else torch.device("cpu")

    # -- life cycle -----------------------------------------------------------------------
    def join(self) -> None:
        """Starts `torch.distributed` at the chief's address and installs the Keras patches."""
        engine = self.engine_description()
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(default_thread_count())
        if dist.is_initialized():
            self._check_existing_process_group()
        elif self.num_workers > 1:
            host, port = split_address(self.resolver.worker_addresses[0])
            if engine == "gloo":
                _bind_gloo_to(split_address(self.resolver.worker_addresses[self.worker_index])[0])
            started = time.monotonic()
            try:
                store = self._store(host, port)
                dist.init_process_group(
                    engine, store=store, rank=self.worker_index, world_size=self.num_workers,
                    timeout=datetime.timedelta(seconds=self.timeout_seconds))
                self._tcp_store = store
                atexit.register(self._leave_at_exit)
            except Exception as error:
                raise WorkerLostError(
                    f"keras_mwms worker {self.worker_index}: torch.distributed ({engine}) could not "
                    f"start at the chief's address {host}:{port} within "
                    f"{time.monotonic() - started:.0f} s (timeout {self.timeout_seconds:.0f} s): "
                    f"{error}. Check that every worker is still running and that port {port} is "
                    "reachable from every worker."
                ) from error
        self._joined = True
        from keras_mwms.backends import torch_training

        torch_training.install(self)

    def _check_existing_process_group(self) -> None:
        """Reuses a process group the script started itself, if it is the one TF_CONFIG describes."""
        size, rank = dist.get_world_size(), dist.get_rank()
        if (size, rank) != (self.num_workers, self.worker_index):
            raise RuntimeError(
                f"keras_mwms worker {self.worker_index}: torch.distributed was already initialised "
                f"in this process with world_size={size}, rank={rank}, but TF_CONFIG describes "
                f"{self.num_workers} worker(s) with this one at index {self.worker_index}. Let "
                "keras_mwms.MultiWorkerMirroredStrategy() start the process group (remove your "
                "init_process_group call), or make its world size and rank match TF_CONFIG."
            )

    def _store(self, host: str, port: int) -> dist.TCPStore:
        """The TCPStore `init_method="tcp://host:port"` would make, the chief's bound to `host` only.

        Left to itself the store's server listens on every interface; the chief binds the
        socket to its TF_CONFIG address first and hands it over (`master_listen_fd`). If that
        host is not an address of this machine (NAT, a service name) torch binds as usual.
        """
        listener = network.listen_on(host, port) if self.worker_index == 0 else None
        if self.worker_index != 0:
            # Connect only once the chief's store listens: torch's client logs a warning with a
            # C++ stack trace for every refused attempt. On timeout the store reports it below.
            network.wait_until_accepting(host, port, self.timeout_seconds)
        # The store owns the descriptor from here on; Python must not close it.
        listen_fd = listener.detach() if listener is not None else None
        return dist.TCPStore(host.strip("[]"), port, self.num_workers, self.worker_index == 0,
                             timeout=datetime.timedelta(seconds=self.timeout_seconds),
                             multi_tenant=True, master_listen_fd=listen_fd)

    def leave(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._joined = False

    def _leave_at_exit(self) -> None:
        """Tears the process group down in order when the interpreter exits (registered by `join`).

        torch asks for `destroy_process_group()` before exit: left to interpreter finalization,
        gloo's threads can be destroyed while still holding work and abort the process
        ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489,
        #179291). Seen here: 3 of 23 two-worker runs aborted after training and saving had
        finished, so the launcher reported a failure and `--max-restarts` would retrain a
        finished job. Order: the chief's TCPStore serves every worker, so the other workers
        destroy their process group and then sign off on the store, and the chief destroys its
        own (and with it the store) once they all signed off, or after `_SIGN_OFF_SECONDS`.
        Nobody else waits: a worker still in a collective with one that left learns of it at
        once, as before, and a chief that is still saving keeps nobody waiting.
        """
        store, self._tcp_store = self._tcp_store, None
        if store is None or not self._joined or not dist.is_initialized():
            return
        try:
            if self.worker_index != 0:
                self.leave()
                store.set(f"keras_mwms/left/{self.worker_index}", "1")
                return
            if getattr(sys, "last_value", None) is None:   # no uncaught exception
                store.wait([f"keras_mwms/left/{rank}" for rank in range(1, self.num_workers)],
                           datetime.timedelta(seconds=_SIGN_OFF_SECONDS))
            self.leave()
        except Exception:
            # A peer is gone or late: leave anyway, within a bound.
            self._teardown_bounded()

    # -- scope ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _scope(self):
        with self._scope_lock:
            self._scope_depth += 1
        try:
            yield self
        finally:
            with self._scope_lock:
                self._scope_depth -= 1
                created = list(self._created_in_scope.values()) if self._scope_depth == 0 else []
                if self._scope_depth == 0:
                    self._created_in_scope.clear()
        # Reached only when the block did not raise: a worker whose block failed joins nothing.
        self._agree_on_variables(created)

    def scope(self) -> contextlib.AbstractContextManager:
        """Variables created inside take the chief's values when the outermost scope is left.

        Creating a variable enters no collective, so one worker may build or load a model alone
        (`keras.models.load_model`, `model.save` on the chief). The variables created inside
        the block are broadcast from the chief in one collective at its exit, which every worker
        reaches, so `model.get_weights()` agrees everywhere right after the block even when the
        workers seeded differently. Every worker must therefore run the same
        `with strategy.scope():` blocks, as with TensorFlow's MultiWorkerMirroredStrategy; a
        block that differs is a clear error on every worker, not a hang.
        """
        return self._scope()

    def note_new_variable(self, variable) -> None:
        """Called for every new Keras variable; those created in `scope()` are agreed at its exit."""
        if self._scope_depth and self.distributed:
            self._created_in_scope[id(variable)] = variable

    def _agree_on_variables(self, variables: list) -> None:
        """The chief's values for `variables` on every worker, checked first through the store.

        Each worker posts the shapes and dtypes it created and reads everyone's, so all workers
        decide alike: the same list everywhere is one broadcast per dtype; a different list, or
        a worker that never leaves a scope (a block run on one worker alone), is a `ValueError`
        naming the workers and the fix, raised without entering any collective.
        """
        import json

        variables = [variable for variable in variables
                     if getattr(variable, "_value", None) is not None
                     and variable._value.device.type != "meta"]
        if not variables or not self.distributed:
            return
        self._scope_exits += 1
        prefix = f"keras_mwms/scope-variables/{self._scope_exits}/"
        keys = [f"{prefix}{rank}" for rank in range(self.num_workers)]
        signature = [[list(variable.shape), str(variable.dtype)] for variable in variables]
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[self.worker_index], json.dumps(signature))
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_seconds))
        except Exception as error:
            absent = [rank for rank, key in enumerate(keys) if not _has_key(store, key)]
            raise ValueError(
                f"keras_mwms worker {self.worker_index}: "
                f"{', '.join(self._describe(rank) for rank in absent) or 'a worker'} did not leave "
                f"`strategy.scope()` block #{self._scope_exits} within {self.timeout_seconds:.0f} s "
                f"({error}). Every worker must run the same `with strategy.scope():` blocks, "
                "creating the same models and optimizers in the same order; build or load what "
                "one worker needs alone (under `if strategy.is_chief:`) outside the scope."
            ) from error
        signatures = [json.loads(store.get(key)) for key in keys]
        differing = [rank for rank in range(1, self.num_workers) if signatures[rank] != signatures[0]]
        if differing:
            raise ValueError(
                f"keras_mwms worker {self.worker_index}: the variables created in "
                f"`strategy.scope()` block #{self._scope_exits} differ between workers: "
                f"{len(signatures[0])} on the chief, "
                + ", ".join(f"{len(signatures[rank])} on worker {rank}" for rank in differing)
                + f" (first shapes and dtypes on the chief {signatures[0][:3]}, on worker "
                f"{differing[0]} {signatures[differing[0]][:3]}). Every worker must run the same "
                "`with strategy.scope():` blocks, creating the same models and optimizers in the "
                "same order; build what one worker needs alone outside the scope.")
        self.broadcast_tensors([variable.value.data for variable in variables],
                               what="broadcast of the chief's values at the end of strategy.scope()")

    @property
    def in_scope(self) -> bool:
        return self._scope_depth > 0

    # -- fault handling -------------------------------------------------------------------
    @contextlib.contextmanager
    def guarded(self, what: str):
        """Runs collectives; a failure becomes a `WorkerLostError` naming the lost workers."""
        try:
            yield
        except WorkerLostError:
            raise
        except (RuntimeError, ValueError) as error:
            if not self.distributed or not _looks_like_collective_failure(error):
                raise
            self._fail(what, error)

    def _fail(self, what: str, error: BaseException):
        # The process must end even if gloo's teardown or interpreter exit hangs on dead peers.
        faulthandler.dump_traceback_later(_EXIT_WATCHDOG_SECONDS, exit=True)
        lost = self._find_lost_workers()
        names = [self._describe(rank) for rank in lost] or ["an unidentified worker"]
        message = (
            f"keras_mwms worker {self.worker_index}: lost {', '.join(names)} during {what} "
            f"(collective timeout {self.timeout_seconds:.0f} s): "
            f"{str(error).splitlines()[0][:300]}. Synchronous training cannot continue; every "
            "worker stops. Restart the job (`python -m keras_mwms.launch --max-restarts N`) and "
            "use keras_mwms.callbacks.BackupAndRestore to resume."
        )
        print(message, file=sys.stderr, flush=True)
        self._teardown_bounded()
        raise WorkerLostError(message) from error

    def _describe(self, rank: int) -> str:
        job, index = self.resolver.group_tasks[rank]
        address = self.resolver.worker_addresses[rank]
        chief = ", the chief" if rank == 0 else ""
        return f"worker {rank} ({job}:{index} at {address}{chief})"

    def _find_lost_workers(self) -> list[int]:
        """Survivors check in on the chief's store; whoever does not is reported lost."""
        self._failure_count += 1
        prefix = f"keras_mwms/alive/{self._failure_count}/"
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=_LIVENESS_WINDOW_SECONDS))
            store.set(f"{prefix}{self.worker_index}", "1")
            others = [rank for rank in range(self.num_workers) if rank != self.worker_index]
            deadline = time.monotonic() + _LIVENESS_WINDOW_SECONDS
            alive: set[int] = set()
            while time.monotonic() < deadline and len(alive) < len(others):
                alive.update(rank for rank in others
                             if rank not in alive and store.check([f"{prefix}{rank}"]))
                time.sleep(0.1)
            return [rank for rank in others if rank not in alive]
        except Exception:
            # The store lives in the chief: unreachable means the chief is gone.
            return [0] if self.worker_index != 0 else []

    def _teardown_bounded(self) -> None:
        thread = threading.Thread(target=self.leave, name="keras_mwms-teardown", daemon=True)
        thread.start()
        thread.join(5.0)

    # -- collectives ----------------------------------------------------------------------
    def all_reduce_flat(self, tensors: Sequence[torch.Tensor], op: str = "sum",
                        what: str = "all-reduce") -> list[torch.Tensor]:
        """Reduces same-role tensors across workers in few flat buckets; returns new tensors.

        Tensors are grouped by dtype and packed into flat buckets of at most
        `CommunicationOptions.bytes_per_pack` bytes (default 25 MiB), launched together and
        awaited in order: one collective per bucket, not per tensor.
        """
        tensors = list(tensors)
        if not self.distributed or not tensors:
            return [tensor.clone() for tensor in tensors]
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                     "min": dist.ReduceOp.MIN}[op]
        buckets = self._buckets(tensors)
        results: list[torch.Tensor | None] = [None] * len(tensors)
        with self.guarded(what):
            pending = []
            for bucket in buckets:
                flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
                pending.append((bucket, flat, dist.all_reduce(flat, op=reduce_op, async_op=True)))
            for bucket, flat, work in pending:
                work.wait()
                offset = 0
                for i in bucket:
                    size = tensors[i].numel()
                    results[i] = flat[offset:offset + size].view_as(tensors[i])
                    offset += size
        return results  # type: ignore[return-value]

    def _buckets(self, tensors: Sequence[torch.Tensor]) -> list[list[int]]:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, tensor in enumerate(tensors):
            by_dtype.setdefault(tensor.dtype, []).append(i)
        buckets = []
        for indices in by_dtype.values():
            current, size = [], 0
            for i in indices:
                nbytes = tensors[i].numel() * tensors[i].element_size()
                if current and size + nbytes > self.bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append(i)
                size += nbytes
            buckets.append(current)
        return buckets

    @torch.no_grad()
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], root: int = 0,
                          what: str = "broadcast") -> None:
        """Overwrites `tensors` in place with worker `root`'s values (one flat broadcast per dtype)."""
        tensors = list(tensors)
        if not self.distributed or not tensors:
            return
        with self.guarded(what):
            for bucket in self._buckets(tensors):
                flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
                dist.broadcast(flat, src=root)
                offset = 0
                for i in bucket:
                    size = tensors[i].numel()
                    tensors[i].copy_(flat[offset:offset + size].view_as(tensors[i]))
                    offset += size

    def barrier(self, name: str = "barrier") -> None:
        if not self.distributed:
            return
        # A tiny all-reduce rather than dist.barrier: it honours the group timeout on gloo and
        # fails the same way as every other collective.
        self.all_reduce_flat([torch.zeros(1)], what=f"barrier {name!r}")

    def all_reduce(self, value: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum, min or max of a host array over workers (one gloo/nccl all-reduce)."""
        (reduced,) = self.all_reduce_flat([torch.as_tensor(np.array(value))], op=op,
                                          what=f"all-reduce ({op})")
        return reduced.numpy()

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        if not self.distributed:
            return value
        holder = [value if self.worker_index == root else None]
        with self.guarded("broadcast_object"):
            dist.broadcast_object_list(holder, src=root)
        return holder[0]

    # -- tf.distribute-style surface ------------------------------------------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        # One replica per worker: the per-replica value is the plain value.
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: str, value: Any, axis: int | None) -> Any:
        from keras.src import tree

        leaves = tree.flatten(value)
        tensors = [torch.as_tensor(np.asarray(leaf) if not torch.is_tensor(leaf) else leaf)
                   for leaf in leaves]
        if axis is None:
            sums = self.all_reduce_flat([t.detach().to(torch.float64 if not t.is_floating_point()
                                                       else t.dtype) for t in tensors],
                                        what="strategy.reduce")
            if reduce_op == "MEAN":
                sums = [s / self.num_replicas_in_sync for s in sums]
        else:
            local = [t.detach().sum(dim=axis) for t in tensors]
            counts = [torch.tensor(float(t.shape[axis]), dtype=torch.float64) for t in tensors]
            reduced = self.all_reduce_flat(local + counts, what="strategy.reduce")
            sums, totals = reduced[:len(local)], reduced[len(local):]
            if reduce_op == "MEAN":
                sums = [s / total.to(s.dtype) for s, total in zip(sums, totals)]
        return tree.pack_sequence_as(value, sums)

    def experimental_local_results(self, value: Any) -> tuple:
        return (value,)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        from keras_mwms.backends import torch_data

        return torch_data.shard_global_batches(dataset, self, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        context = InputContext(self.num_workers, self.worker_index, self.num_replicas_in_sync)
        return dataset_fn(context)


def _has_key(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _looks_like_collective_failure(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}".lower()
    return any(marker in text for marker in (
        "gloo", "nccl", "connection", "timed out", "timeout", "peer", "distbackend",
        "broken pipe", "store", "closed"))
