"""What one flat-path step sends: its values packed into one vector per dtype, and read back.

The flat train step (`keras_mwms.backends.jax.step`) all-reduces ONE vector per dtype per
step. This module holds the pure pieces of that traffic, each usable (and tested) alone, with
no Keras model in sight:

* `FlatLayout` — which values travel where: the exact vectors' dtypes (float32 always, its last
  word the row count), the 16-bit wire dtype of each compressed gradient dtype, which
  BatchNormalization statistics and metric states ride along, the loss share and the float16
  overflow flags under a LossScaleOptimizer, the gradient accumulation steps;
* `pack` / `PayloadReader` — the local step's vectors, and the all-reduced sums read back in
  the same order (divided by the global row count where they were weighted by rows);
* `to_wire` / `from_wire` — 16-bit compression: fp16 is summed by `psum` in fp16; bf16 travels
  as its bits in an all-gather and is summed in float32 in worker order;
* `mark_float16_overflow`, `accumulated_payload`, `unflatten` — loss scaling and accumulation;
* `gather_and_reduce` — max/min/first metric states, combined from one all-gather on the host;
* `MicroStepCounter` — the optimizer's micro-step count without a device read per step.

Example (one worker, so the "all-reduced" sums are the packed vectors themselves):

>>> import jax.numpy as jnp
>>> layout = FlatLayout(dtypes=["float32"])
>>> sums = pack(layout, [jnp.array([1.0, 2.0])], [], [], jnp.float32(2))
>>> PayloadReader(layout, sums).take(jnp.zeros(2), gradient=True).tolist()   # (1, 2)·2 rows / 2 rows
[1.0, 2.0]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keras_mwms.backends import policy


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Which of a step's values travel in which flat vector (see the module docstring).

    Args:
        dtypes: the exact vectors' dtypes, in order (`vector_dtypes`); "float32" carries the row
            count as its last word.
        wires: gradient dtype → the 16-bit dtype it travels in (`CommunicationOptions.compression`);
            each is a vector of its own after the exact ones.
        statistics: indices into `model.non_trainable_variables` of the BatchNormalization moving
            statistics, averaged across workers weighted by rows.
        reductions: per metric state variable, "sum", "max", "min" or "first".
        share: the fraction of its shard's mean loss a worker differentiates (1 / workers under a
            LossScaleOptimizer, else 1.0).
        float16: per trainable variable, whether one process computes its gradient in float16.
        accumulating: `gradient_accumulation_steps` (0: none).
    """

    dtypes: list[str]
    wires: dict[str, str] = dataclasses.field(default_factory=dict)
    statistics: list[int] = dataclasses.field(default_factory=list)
    reductions: list[str] = dataclasses.field(default_factory=list)
    share: float = 1.0
    float16: list[bool] = dataclasses.field(default_factory=list)
    accumulating: int = 0

    @functools.cached_property
    def summed(self) -> list[int]:
        """Metric state indices summed in the exact vectors (computed once: read every step)."""
        return [i for i, op in enumerate(self.reductions) if op == "sum"]

    @functools.cached_property
    def gathered(self) -> list[int]:
        """Metric state indices combined from one all-gather (max/min/first)."""
        return [i for i, op in enumerate(self.reductions) if op != "sum"]


def vector_dtypes(gradient_dtypes: Sequence[str], metric_dtypes: Sequence[str]) -> list[str]:
    """The exact vectors' dtypes: each dtype once, in first-seen order, float32 always (rows).

    Example:

    >>> vector_dtypes(["float16", "float32", "float16"], ["float64"]), vector_dtypes([], [])
    (['float16', 'float32', 'float64'], ['float32'])
    """
    dtypes = list(dict.fromkeys(list(gradient_dtypes) + list(metric_dtypes)))
    if "float32" not in dtypes:
        dtypes.append("float32")  # carries the row count
    return dtypes


def to_wire(flat: Any, wire: str) -> Any:
    """`flat` in its 16-bit wire dtype; bf16 as its uint16 bits (XLA on CPU would widen a bf16
    all-reduce to float32 and send float32 bytes, so bf16 travels in an all-gather).

    Example:

    >>> import jax.numpy as jnp
    >>> [str(to_wire(jnp.ones(2), wire).dtype) for wire in ("float16", "bfloat16")]
    ['float16', 'uint16']
    """
    import jax
    import jax.numpy as jnp

    flat = flat.astype(wire)
    return jax.lax.bitcast_convert_type(flat, jnp.uint16) if wire == "bfloat16" else flat


def from_wire(reduced: Any, dtype: str, wire: str) -> Any:
    """The reduced wire vector back in `dtype`: fp16 was summed by the all-reduce; bf16 came as
    every worker's bits `(workers, size)`, summed here in float32 in worker order (the same bits
    on every worker).

    Example:

    >>> import jax.numpy as jnp
    >>> gathered = jnp.stack([to_wire(jnp.array([1.0, 2.0]), "bfloat16")] * 3)
    >>> from_wire(gathered, "float32", "bfloat16").tolist()
    [3.0, 6.0]
    """
    import jax
    import jax.numpy as jnp

    if wire != "bfloat16":
        return reduced.astype(dtype)
    parts = jax.lax.bitcast_convert_type(reduced, jnp.bfloat16).astype(jnp.float32)
    total = parts[0]
    for part in parts[1:]:   # in worker order: the same bits on every worker
        total = total + part
    return total.astype(dtype)


def pack(layout: FlatLayout, gradients: Sequence[Any], statistics: Sequence[Any], summed_metrics: Sequence[Any],
         rows: Any) -> tuple:
    """A local step's vectors: one per `layout.dtypes`, then one per compressed gradient dtype.

    Gradients (of the shard's mean loss) and statistics are weighted by this worker's `rows`
    (a float32 scalar), so the sum over workers divided by the global rows is the global mean;
    gradients are also divided by `layout.share`. Summed metric states go as they are; `rows`
    is the float32 vector's last word.

    Example:

    >>> import jax.numpy as jnp
    >>> layout = FlatLayout(dtypes=["float32"], wires={"float32": "float16"})
    >>> exact, wire = pack(layout, [jnp.array([0.5])], [jnp.array([1.0])], [], jnp.float32(4))
    >>> exact.tolist(), wire.tolist(), str(wire.dtype)
    ([4.0, 4.0], [2.0], 'float16')
    """
    import jax.numpy as jnp

    pieces: dict[str, list] = {dtype: [] for dtype in layout.dtypes}
    wire_pieces: dict[str, list] = {dtype: [] for dtype in layout.wires}
    for gradient in gradients:
        (wire_pieces if str(gradient.dtype) in layout.wires else pieces)[str(gradient.dtype)].append(
            (gradient * (rows / layout.share).astype(gradient.dtype)).ravel())
    for value in statistics:
        pieces[str(value.dtype)].append((value * rows.astype(value.dtype)).ravel())
    for value in summed_metrics:
        pieces[str(value.dtype)].append(jnp.ravel(value))
    pieces["float32"].append(rows.reshape(1))
    payloads = tuple(jnp.concatenate(pieces[dtype]) for dtype in layout.dtypes)
    compressed = tuple(to_wire(jnp.concatenate(wire_pieces[dtype]), wire) for dtype, wire in layout.wires.items())
    return payloads + compressed


class PayloadReader:
    """Reads the all-reduced vectors of `pack` back, value by value, in the order they were packed.

    Example:

    >>> import jax.numpy as jnp
    >>> layout = FlatLayout(dtypes=["float32"])
    >>> reader = PayloadReader(layout, pack(layout, [], [jnp.array([3.0])], [jnp.array(7.0)], jnp.float32(2)))
    >>> reader.take(jnp.zeros(1)).tolist(), reader.take(jnp.zeros(()), scale=False).tolist(), float(reader.total_rows)
    ([3.0], 7.0, 2.0)
    """

    def __init__(self, layout: FlatLayout, sums: Sequence[Any]):
        self._wires = layout.wires
        self._vectors: dict[Any, Any] = dict(zip(layout.dtypes, sums))
        # The compressed gradients, back in their own dtype, under ("gradients", dtype).
        self._vectors.update({("gradients", dtype): from_wire(reduced, dtype, wire)
                              for (dtype, wire), reduced in zip(layout.wires.items(), sums[len(layout.dtypes):])})
        self.total_rows = self._vectors["float32"][-1]
        self._offsets = dict.fromkeys(self._vectors, 0)

    def take(self, like: Any, scale: bool = True, gradient: bool = False) -> Any:
        """The next value shaped like `like`; `scale`: divided by the global row count;
        `gradient`: from the compressed vector if `like`'s dtype was compressed."""
        dtype = str(like.dtype)
        if gradient and dtype in self._wires:
            dtype = ("gradients", dtype)
        start = self._offsets[dtype]
        self._offsets[dtype] = start + like.size
        flat = self._vectors[dtype][start:start + like.size]
        if scale:
            flat = flat / self.total_rows.astype(flat.dtype)
        return flat.reshape(like.shape)


def mark_float16_overflow(gradients: Sequence[Any], float16: Sequence[bool]) -> list:
    """Flagged gradients at or beyond float16's range become inf, where one process's float16
    gradient overflows (so a LossScaleOptimizer skips the step as one process's does).

    Example:

    >>> import jax.numpy as jnp
    >>> [g.tolist() for g in mark_float16_overflow([jnp.array([1.0, 7e4])] * 2, [True, False])]
    [[1.0, inf], [1.0, 70000.0]]
    """
    import jax.numpy as jnp

    return [jnp.where(jnp.abs(gradient) >= policy.FLOAT16_OVERFLOW, jnp.inf, gradient) if flagged else gradient
            for gradient, flagged in zip(gradients, float16)]


def accumulated_payload(local_gradients: Sequence[Any], accumulators: Sequence[Any], total_rows: Any) -> list:
    """This worker's accumulators plus its share `rows · g / R` of the last micro-step, one vector
    per dtype (`local_gradients` are already times this worker's rows; `total_rows` is R).

    Example:

    >>> import jax.numpy as jnp
    >>> accumulated_payload([jnp.array([4.0, 8.0])], [jnp.array([1.0, 1.0])], jnp.float32(4))[0].tolist()
    [2.0, 3.0]
    """
    import jax.numpy as jnp

    flat: dict[str, list] = {}
    for gradient, accumulator in zip(local_gradients, accumulators):
        total = gradient / total_rows.astype(gradient.dtype) + accumulator
        flat.setdefault(str(gradient.dtype), []).append(total.ravel())
    return [jnp.concatenate(pieces) for pieces in flat.values()]


def unflatten(vectors: Sequence[Any], like: Sequence[Any]) -> list:
    """One vector per dtype cut into arrays shaped like `like`, each dtype's in order.

    Example:

    >>> import jax.numpy as jnp
    >>> [a.tolist() for a in unflatten([jnp.arange(3.0)], [jnp.zeros(1), jnp.zeros(2)])]
    [[0.0], [1.0, 2.0]]
    """
    offsets = {str(vector.dtype): [vector, 0] for vector in vectors}
    out = []
    for variable in like:
        slot = offsets[str(variable.dtype)]
        out.append(slot[0][slot[1]:slot[1] + variable.size].reshape(variable.shape))
        slot[1] += variable.size
    return out


def gather_and_reduce(values: Sequence[Any], operations: Sequence[str],
                      all_gather: Callable[[np.ndarray], np.ndarray]) -> list[np.ndarray]:
    """Every worker's `values` in ONE all-gather (float64 on the host), each combined by its
    operation ("sum", "max", "min", "first") in worker order, as a flat array.

    Example (two workers, faked):

    >>> two_workers = lambda flat: np.stack([flat, flat * 3])
    >>> [v.tolist() for v in gather_and_reduce([np.array([1.0, 2.0]), np.array(5.0)], ["max", "first"], two_workers)]
    [[3.0, 6.0], [5.0]]
    """
    flat = np.concatenate([np.asarray(value, np.float64).ravel() for value in values])
    parts = all_gather(flat)
    out, offset = [], 0
    for operation, value in zip(operations, values):
        size = int(np.size(value))
        out.append(policy.reduce_gathered(parts[:, offset:offset + size], operation))
        offset += size
    return out


class MicroStepCounter:
    """The optimizer's micro-step count, read from the device only when the state did not come
    from this step's last apply (a new fit, a restored or assigned optimizer): no sync per step.

    Example:

    >>> import jax.numpy as jnp
    >>> counter, state = MicroStepCounter(position=0), [jnp.array(5)]
    >>> counter.current(state), counter.advanced(after=[jnp.array(6)]), counter.current([jnp.array(9)])
    (5, None, 9)
    """

    def __init__(self, position: int | None):
        self._position = position
        self._array: Any = None
        self._value = 0

    def current(self, optimizer_variables: Sequence[Any]) -> int:
        """The count in `optimizer_variables` (from memory if they are the last apply's)."""
        current = optimizer_variables[self._position]
        if current is not self._array:
            self._array, self._value = current, int(current)
        return self._value

    def advanced(self, after: Sequence[Any]) -> None:
        """Keras' apply counted one micro-step; `after` is the optimizer state it returned."""
        self._array, self._value = after[self._position], self._value + 1
