"""Gradient all-reduces that start during `backward()`, one bucket at a time (torch backend).

Keras' torch train step runs `loss.backward()` and only then hands the gradients to the
optimizer. Reducing them there leaves the network idle for the whole backward pass and the
processor idle for the whole all-reduce. `OverlappedGradients` instead hooks every trainable
parameter (`register_post_accumulate_grad_hook`): when the last gradient of a bucket is final,
the bucket is packed into its flat buffer (allocated once, reused every step) and its
all-reduce starts asynchronously, while autograd goes on with the earlier layers. The
optimizer's `apply` then only waits, and divides each bucket by the step's global weight.

Buckets follow the reverse order of the trainable weights (backward produces the last layers'
gradients first), hold one dtype each, and are launched strictly in bucket order, so every
worker issues the same collectives in the same order whatever autograd's timing. The first
bucket closes at `FIRST_BUCKET_BYTES` to start communicating early; the rest at the
strategy's `bytes_per_pack`. A gradient that never arrives (a parameter the loss does not use)
is sent as zeros when `apply` asks for the result, on every worker alike.

The hooks act only while *armed*, i.e. inside a keras_mwms training step of an eager model:
a user's own `backward()` elsewhere never starts a collective.

Small per-step values that must be summed too (the row counts, BatchNormalization moving
statistics, metric states) can ride in the last bucket: `arm(rows, extras=fn)` calls `fn()` when
that bucket launches and `finish()` hands back their sums, so a step needs no separate
latency-bound all-reduce for them.

With `CommunicationOptions(compression=...)` a float32 bucket is cast to bf16/fp16 before its
all-reduce and back to float32 when `finish` collects it (`keras_mwms.backends.compression`);
the extras then travel in a float32 collective of their own, so they stay exact.

Example (one process: nothing is distributed, so the reducer declines to arm):

>>> import torch
>>> from keras_mwms.backends.torch.overlap import OverlappedGradients
>>> class Alone:
...     distributed = False
...     bucket_bytes = 1 << 20
>>> weights = [torch.nn.Parameter(torch.ones(3))]
>>> reducer = OverlappedGradients(Alone(), weights)
>>> reducer.arm(rows=4)
False
>>> reducer.close()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from keras_mwms.backends.compression import WIRE, wire_dtype
from keras_mwms.backends.keras_api import attributes
from keras_mwms.diagnostics import LEDGER

if TYPE_CHECKING:
    from keras_mwms.backends.torch.engine import TorchEngine

FIRST_BUCKET_BYTES = 1 << 20


def plan_buckets(sizes: Sequence[int], dtypes: Sequence, first_bytes: int, bytes_per_pack: int
                 ) -> list[list[int]]:
    """Groups parameter positions into launch buckets, last parameter first.

    As DDP's reducer: a bucket closes once it holds at least its limit (or the next parameter
    has another dtype), so the first bucket reaches the first large layer. Cutting before that
    layer instead would leave it, and all the layers before it, for the end of backward.

    Example:

    >>> plan_buckets([10, 10, 10, 10], ["f"] * 4, first_bytes=10, bytes_per_pack=30)
    [[3], [2, 1, 0]]
    >>> plan_buckets([1, 8, 1, 8], ["f"] * 4, first_bytes=4, bytes_per_pack=30)
    [[3], [2, 1, 0]]
    >>> plan_buckets([4, 4, 4], ["f", "h", "h"], first_bytes=100, bytes_per_pack=100)
    [[2, 1], [0]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for position in reversed(range(len(sizes))):
        if current and dtypes[position] != dtypes[current[0]]:
            buckets.append(current)
            current, size = [], 0
        current.append(position)
        size += sizes[position]
        if size >= (first_bytes if not buckets else bytes_per_pack):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class OverlappedGradients:
    """All-reduces the gradients of `parameters` bucket by bucket as backward produces them.

    Args:
        backend: the `TorchEngine` (its process group, `bucket_bytes` and failure handling).
        parameters: the model's trainable torch parameters, in `model.trainable_weights` order.
    """

    def __init__(self, backend: TorchEngine, parameters: Sequence[torch.nn.Parameter]):
        self.backend = backend
        self.parameters = list(parameters)
        self.positions = {id(parameter): position for position, parameter in enumerate(self.parameters)}
        self.buckets = plan_buckets(
            [parameter.numel() * parameter.element_size() for parameter in self.parameters],
            [parameter.dtype for parameter in self.parameters],
            min(FIRST_BUCKET_BYTES, backend.bucket_bytes), backend.bucket_bytes)
        self.bucket_of = {position: number for number, bucket in enumerate(self.buckets)
                          for position in bucket}
        # Per bucket: its gradients' element counts, in bucket order (`finish` splits by them).
        self.sizes = [[self.parameters[position].numel() for position in bucket]
                      for bucket in self.buckets]
        self.summed_gradients: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.armed = False
        self._handles = [
            parameter.register_post_accumulate_grad_hook(self._make_hook(position))
            for position, parameter in enumerate(self.parameters)]
        self._reset(rows=0)

    def _make_hook(self, position: int):
        def on_gradient_ready(parameter):
            if self.armed:
                self._ready(position)

        return on_gradient_ready

    def _reset(self, rows: int, extras=None) -> None:
        self.rows = rows
        self.extras = extras
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.works: list = [None] * len(self.buckets)
        self.launched = 0
        # Extras: the tensors `extras()` returned, and per flat collective the extra positions
        # it carries: (flat, work, offset into flat, positions).
        self.extra_tensors: list[torch.Tensor] = []
        self.extra_parts: list = []

    def arm(self, rows: int, extras=None) -> bool:
        """Starts a step on `rows` local rows; False (and stays idle) when not distributed.

        `extras`, if given, is called once when the last bucket launches and returns tensors
        to sum across workers along with the gradients (their sums come back from `finish`).
        """
        self._reset(rows, extras)
        self.armed = bool(self.backend.distributed) and bool(self.parameters)
        return self.armed

    def disarm(self) -> None:
        """Ends the step: the hooks go idle and the step's `extras` are let go."""
        self.armed = False
        self.extras = None

    def covers(self, variables: Sequence) -> bool:
        """Whether `variables` (Keras variables) are exactly the hooked parameters, in order."""
        return (len(variables) == len(self.parameters)
                and all(attributes.variable_value(variable) is parameter
                        for variable, parameter in zip(variables, self.parameters)))

    def _ready(self, position: int) -> None:
        bucket = self.bucket_of[position]
        self.waiting[bucket] -= 1
        # In bucket order only: every worker must issue the same collectives in the same order.
        while self.launched < len(self.buckets) and self.waiting[self.launched] == 0:
            self._launch(self.launched)

    def _launch(self, number: int) -> None:
        pieces = []
        for position in self.buckets[number]:
            parameter = self.parameters[position]
            grad = parameter.grad
            if grad is None or self.rows == 0:
                # An unused parameter, or an empty shard's dummy step: contribute nothing.
                pieces.append(torch.zeros(parameter.numel(), dtype=parameter.dtype,
                                          device=parameter.device))
            else:
                pieces.append(grad.reshape(-1))
        last = number == len(self.buckets) - 1
        extras = self._collect_extras() if last else []
        dtype = self.parameters[self.buckets[number][0]].dtype
        wire = wire_dtype(self.backend.options.compression, dtype)
        # Compressed buckets carry gradients only: the extras must stay exact.
        riding = [] if wire else [i for i, tensor in enumerate(extras) if tensor.dtype == dtype]
        with torch.no_grad():
            flat = self._packed(number, pieces + [extras[i] for i in riding])
            if wire:
                flat = flat.to(getattr(torch, wire))
        with self.backend.guarded("gradient all-reduce"):
            self.works[number] = dist.all_reduce(flat, async_op=True)
            self.flats[number] = flat
            if riding:
                self.extra_parts.append((flat, self.works[number], flat.numel() - sum(
                    extras[i].numel() for i in riding), riding))
            # Extras of another dtype than the bucket: one more flat per dtype, launched now.
            by_dtype: dict = {}
            for i, tensor in enumerate(extras):
                if i not in riding:
                    by_dtype.setdefault(tensor.dtype, []).append(i)
            for positions in by_dtype.values():
                with torch.no_grad():
                    other = torch.cat([extras[i] for i in positions])
                self.extra_parts.append((other, dist.all_reduce(other, async_op=True), 0,
                                         positions))
        self.launched = number + 1

    def _packed(self, number: int, pieces: list[torch.Tensor]) -> torch.Tensor:
        """`pieces` concatenated into bucket `number`'s flat buffer, allocated once and reused
        every step (the sums `finish` hands out are read before the next step's backward)."""
        size = sum(piece.numel() for piece in pieces)
        buffer = self.buffers[number]
        if buffer is None or buffer.numel() != size:
            buffer = self.buffers[number] = torch.empty(size, dtype=pieces[0].dtype,
                                                        device=pieces[0].device)
        return torch.cat(pieces, out=buffer)

    def _collect_extras(self) -> list[torch.Tensor]:
        if self.extras is None:
            return []
        with torch.no_grad():
            self.extra_tensors = [torch.as_tensor(tensor).detach() for tensor in self.extras()]
        return [tensor.reshape(-1) for tensor in self.extra_tensors]

    def finish(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Launches what backward left and waits for every bucket.

        Returns the summed gradients, in parameter order, and the summed extras, in the order
        `extras()` returned them (empty when the step had none). The gradients are views of the
        step's flat buffers: `divide_` divides them all, one operation per bucket.
        """
        self.armed = False
        while self.launched < len(self.buckets):
            self._launch(self.launched)
        summed: list[torch.Tensor | None] = [None] * len(self.parameters)
        extras: list[torch.Tensor | None] = [None] * len(self.extra_tensors)
        nbytes = sum(flat.numel() * flat.element_size() for flat in self.flats if flat is not None)
        buckets = {id(flat) for flat in self.flats}
        WIRE.add(nbytes + sum(flat.numel() * flat.element_size()
                              for flat, *_ in self.extra_parts if id(flat) not in buckets))
        regions = []
        with LEDGER.collective("gradient all-reduce (overlapped buckets)", nbytes), \
                self.backend.guarded("gradient all-reduce"):
            for number, bucket in enumerate(self.buckets):
                self.works[number].wait()
                flat, sizes = self.flats[number], self.sizes[number]
                dtype = self.parameters[bucket[0]].dtype
                if flat.dtype != dtype:   # compressed: back to the gradients' own type
                    flat = flat.to(dtype)
                region = flat[:sum(sizes)]
                regions.append(region)
                for position, piece in zip(bucket, region.split(sizes)):
                    summed[position] = piece.view(self.parameters[position].shape)
            for flat, work, offset, positions in self.extra_parts:
                work.wait()
                for i in positions:
                    size = self.extra_tensors[i].numel()
                    extras[i] = flat[offset:offset + size].view_as(self.extra_tensors[i])
                    offset += size
        self._reset(rows=0)
        self.summed_gradients = regions
        return summed, extras  # type: ignore[return-value]

    def divide_(self, total) -> None:
        """Divides, in place, every gradient the last `finish` returned by `total` (the step's
        global weight): one division per bucket, the same quotients as one per gradient."""
        regions, self.summed_gradients = self.summed_gradients, []
        for region in regions:
            region.div_(total)

    def close(self) -> None:
        """Removes the hooks (a new plan is made when the trainable weights change)."""
        self.armed = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
