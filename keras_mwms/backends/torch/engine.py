"""The torch engine: `torch.distributed` joined at the chief's address, and its collectives.

* **join** — `torch.distributed.init_process_group` at the chief's `TF_CONFIG` address (the
  port the rendezvous just released), bounded by `CommunicationOptions.timeout_seconds`
  (default `DEFAULT_COLLECTIVE_TIMEOUT_SECONDS`, far below torch's 30 minutes). AUTO picks
  nccl with CUDA and gloo otherwise, RING is gloo, NCCL without CUDA is refused at once.
* **collectives** — the collective port (`all_reduce`, `broadcast_object`, `barrier`) and its
  torch forms: bucketed flat all-reduces (`all_reduce_flat`) and broadcasts
  (`broadcast_tensors`). Every one runs `guarded`: a crashed or hung peer ends *this* worker
  with `keras_mwms.WorkerLostError` naming the lost worker(s) (`keras_mwms.backends.faults`;
  torch's hook: `keras_mwms.backends.torch.faults`).
* **leave** — the process group is destroyed in order, at `strategy.close()` or at exit.

One replica per worker process (one CPU or one GPU); several GPUs per worker are out of scope:
start one worker per GPU instead. Which GPU is `keras_mwms.devices.assignment`'s answer (the
launcher's, or the local rank's, or the only one); `join` makes it the current CUDA device before
Keras creates a tensor, so Keras' "cuda" means this worker's GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from keras_mwms import devices
from keras_mwms.backends import policy
from keras_mwms.backends.base import Backend
from keras_mwms.backends.faults import bounded
from keras_mwms.backends.rows import StepRows
from keras_mwms.backends.torch import faults
from keras_mwms.communication import CommunicationImplementation, CommunicationOptions
from keras_mwms.diagnostics import LEDGER
from keras_mwms.errors import NcclUnavailableError, WorkerLostError
from keras_mwms.startup import network
from keras_mwms.startup.cluster import ClusterResolver, split_address

DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 300.0
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# At a normal exit, how long the chief waits for the other workers to sign off its store.
_SIGN_OFF_SECONDS = 10.0


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


def resolve_engine(implementation: CommunicationImplementation, gpu_count: int) -> str:
    """The `torch.distributed` backend a request gets on a worker with `gpu_count` GPUs.

    `policy.choose_implementation` decides (AUTO: nccl with CUDA and NCCL, gloo otherwise;
    RING: gloo), except that torch does not fall back: NCCL where CUDA or NCCL is missing
    raises `NcclUnavailableError` at once, before any network wait.

    Example:

    >>> resolve_engine(CommunicationImplementation.RING, 0), resolve_engine(CommunicationImplementation.AUTO, 0)
    ('gloo', 'gloo')
    """
    nccl_usable = gpu_count > 0 and dist.is_nccl_available()
    if implementation is CommunicationImplementation.NCCL and not nccl_usable:
        missing = "no CUDA device is visible" if gpu_count == 0 else "this torch build lacks NCCL"
        raise NcclUnavailableError(
            f"CommunicationImplementation.NCCL was requested but {missing} (torch "
            f"{torch.__version__}). Use CommunicationImplementation.AUTO (gloo on CPU) or RING, or "
            "run on a machine with CUDA GPUs and a CUDA build of torch."
        )
    chosen = policy.choose_implementation(implementation, gpu_count, "torch", "gloo", nccl_usable=nccl_usable)
    return "nccl" if chosen is CommunicationImplementation.NCCL else "gloo"


def existing_process_group_backend() -> str | None:
    """The backend (`"gloo"`, `"nccl"`) of a process group started before the strategy, or None.

    Example:

    >>> existing_process_group_backend() is None or dist.is_initialized()
    True
    """
    return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None


class TorchEngine(Backend):
    """The process group and the collective port of the torch backend (see the module docstring).

    `keras_mwms.backends.torch.TorchBackend` adds the scope, the tf.distribute-style surface
    and the Keras patches on top; it is built with `Backend`'s arguments.
    """

    name = "torch"

    def __init__(self, resolver: ClusterResolver, options: CommunicationOptions,
                 tf_config_at_creation: str = ""):
        super().__init__(resolver, options, tf_config_at_creation)
        self.timeout_seconds = float(options.timeout_seconds or DEFAULT_COLLECTIVE_TIMEOUT_SECONDS)
        self.bucket_bytes = options.bytes_per_pack or DEFAULT_BUCKET_BYTES
        self.faults = faults.TorchFaults(self)   # lost peers: `keras_mwms.backends.faults`
        self._engine: str | None = None
        self._joined = False
        self._group_size = 1   # fixed when the group is joined: `distributed` is read several times a step
        # A process group the launcher started before the script (Ray's TorchTrainer) is joined,
        # not started again, and left for its owner to destroy.
        self._owns_process_group = False
        self._tcp_store: dist.TCPStore | None = None   # the store of a process group we started
        # This step's rows and loss weight: begun and weighed by `step` alone (`StepRows`).
        self.rows = StepRows()
        # Inside the distributed train step of a model created in the scope: an ordinary
        # BatchNormalization then computes global moments (`policy.global_batch_norm_moments`).
        self.in_train_step = False
        # This step is compiled and all-reduces its gradients in its graph (`gradients.in_graph_applies`).
        self.gradients_in_graph = False
        # This step is compiled as one graph, its backward by `autograd.grad` (`compiled_step`).
        self.backward_in_graph = False
        # This worker's GPU (or none): decided now, so a worker that cannot tell which GPU is
        # its own fails before the rendezvous.
        self.gpu_assignment = devices.gpu_assignment("torch", self.num_workers)

    # -- identity -------------------------------------------------------------------------
    @staticmethod
    def version() -> str:
        return torch.__version__

    def engine_description(self) -> str:
        if self._engine is None:
            self._engine = existing_process_group_backend() or \
                resolve_engine(self.options.implementation, len(self.gpu_assignment.gpus))
        return self._engine

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers

    @property
    def distributed(self) -> bool:
        """True when collectives actually cross processes (more than one worker)."""
        return self._joined and self._group_size > 1

    @property
    def device(self) -> torch.device:
        """Where collective payloads live: this worker's GPU with nccl, else the CPU."""
        return torch.device(f"cuda:{self.gpu_assignment.gpus[0]}") if self.engine_description() == "nccl" \
            else torch.device("cpu")

    # -- life cycle -----------------------------------------------------------------------
    def use_compute_threads(self, threads: int) -> bool:
        torch.set_num_threads(threads)
        return True

    def join(self) -> None:
        """Starts `torch.distributed` at the chief's address (bounded by the collective timeout)."""
        engine = self.engine_description()
        if self.gpu_assignment.gpus:
            torch.cuda.set_device(self.gpu_assignment.gpus[0])
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
                self._owns_process_group = True
                atexit.register(self.leave)
            except Exception as error:
                raise WorkerLostError(
                    f"keras_mwms worker {self.worker_index}: torch.distributed ({engine}) could not "
                    f"start at the chief's address {host}:{port} within "
                    f"{time.monotonic() - started:.0f} s (timeout {self.timeout_seconds:.0f} s): "
                    f"{error}. Check that every worker is still running and that port {port} is "
                    "reachable from every worker.", where="torch.distributed start"
                ) from error
        self._group_size = self.num_workers
        self._joined = True

    def _check_existing_process_group(self) -> None:
        """Joins a process group started before the strategy (by Ray's TorchTrainer, a launcher
        or the script), if it is the one the cluster describes; its owner destroys it."""
        policy.check_started_group(self, "torch.distributed", dist.get_world_size(), dist.get_rank(),
                                   "init_process_group")

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
        """Tears the process group down in order (`strategy.close()`, and at exit); safe twice.

        torch asks for `destroy_process_group()` before exit: left to interpreter finalization,
        gloo's threads can be destroyed while still holding work and abort the process
        ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489,
        #179291), so a finished job would be reported failed and retrained by
        `--max-restarts`. Order: the chief's TCPStore serves every worker, so the other workers
        destroy their process group and then sign off on the store, and the chief destroys its
        own (and with it the store) once they all signed off, or after `_SIGN_OFF_SECONDS`.
        Nobody else waits: a worker still in a collective with one that left learns of it at
        once, and after an uncaught exception the chief waits for nobody.
        """
        store, self._tcp_store = self._tcp_store, None
        if not self._joined:
            return
        if not self._owns_process_group:
            self._joined = False
            return
        if store is None or not dist.is_initialized():
            self.destroy_process_group()
            return
        try:
            if self.worker_index != 0:
                self.destroy_process_group()
                store.set(f"keras_mwms/left/{self.worker_index}", "1")
                return
            if getattr(sys, "last_value", None) is None:   # no uncaught exception
                store.wait([f"keras_mwms/left/{rank}" for rank in range(1, self.num_workers)],
                           datetime.timedelta(seconds=_SIGN_OFF_SECONDS))
            self.destroy_process_group()
        except Exception:
            # A peer is gone or late: leave anyway, within a bound.
            self.abandon()

    def destroy_process_group(self) -> None:
        """Destroys the process group keras_mwms started, now, without waiting for anyone."""
        if self._owns_process_group and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._joined = False

    def abandon(self) -> None:
        """Leaves without the ordered sign-off (a peer is lost), bounded in time."""
        self._tcp_store = None
        self._joined = False
        bounded(self.destroy_process_group, faults.TEARDOWN_SECONDS)

    # -- collectives ----------------------------------------------------------------------
    def guarded(self, what: str) -> contextlib.AbstractContextManager:
        """Runs collectives; a failure becomes `keras_mwms.WorkerLostError` naming the lost workers."""
        return self.faults.guarded(what)

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
        nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        with LEDGER.collective(what, nbytes), self.guarded(what):
            pending = []
            for bucket in buckets:
                flat = torch.cat([tensors[i].reshape(-1) for i in bucket])
                pending.append((bucket, flat, dist.all_reduce(flat, op=reduce_op, async_op=True)))
            for bucket, flat, work in pending:
                work.wait()
                _unflatten(flat, bucket, tensors, results)
        return results  # type: ignore[return-value]

    def all_reduce_in_graph(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sums same-role tensors across workers, in buckets as `all_reduce_flat`, traceably.

        torch's functional collectives (`torch.distributed._functional_collectives`): inside a
        `torch.compile`d step they become nodes of its graph instead of a graph break. No
        ledger entry and no `guarded` here (neither traces): the distributed train step guards
        the whole compiled step (`keras_mwms.backends.torch.step`).
        """
        import torch.distributed._functional_collectives as functional

        tensors = list(tensors)
        if not self.distributed or not tensors:
            return [tensor.clone() for tensor in tensors]
        buckets = self._buckets(tensors)
        pending = [(bucket, functional.all_reduce(torch.cat([tensors[i].reshape(-1) for i in bucket]),
                                                  "sum", dist.group.WORLD))
                   for bucket in buckets]
        results: list[torch.Tensor | None] = [None] * len(tensors)
        for bucket, flat in pending:
            _unflatten(functional.wait_tensor(flat), bucket, tensors, results)
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
        nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        with LEDGER.collective(what, nbytes), self.guarded(what):
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
        self.all_reduce_flat([torch.zeros(1, device=self.device)], what=f"barrier {name!r}")

    def all_reduce(self, value: np.ndarray, op: str = "sum") -> np.ndarray:
        """Sum, min or max of a host array over workers (one gloo/nccl all-reduce)."""
        tensor = torch.as_tensor(np.array(value))
        if self.distributed:
            tensor = tensor.to(self.device)
        (reduced,) = self.all_reduce_flat([tensor], op=op, what=f"all-reduce ({op})")
        return reduced.cpu().numpy()

    def broadcast_object(self, value: Any, root: int = 0) -> Any:
        if not self.distributed:
            return value
        holder = [value if self.worker_index == root else None]
        with LEDGER.collective("broadcast_object"), self.guarded("broadcast_object"):
            dist.broadcast_object_list(holder, src=root)
        return holder[0]


def _unflatten(flat: torch.Tensor, bucket: list[int], tensors: Sequence[torch.Tensor], results: list) -> None:
    """Puts a reduced bucket's pieces back in `results`, each a view shaped as its tensor."""
    offset = 0
    for i in bucket:
        size = tensors[i].numel()
        results[i] = flat[offset:offset + size].view_as(tensors[i])
        offset += size
