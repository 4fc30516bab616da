"""Gradient compression for the all-reduce: the rules every backend follows, and a byte counter.

`CommunicationOptions(compression="bf16" | "fp16")` casts each float32 gradient to that 16-bit
type just before the gradient all-reduce and back to float32 right after it, so the gradients
cross the network in half the bytes (DDP's `bf16_compress_hook` / `fp16_compress_hook` do the
same). The division by the global row count runs in float32 after the cast back. Row counts,
loss weights, metric states and BatchNormalization statistics never travel in 16 bits: they are
summed exactly, in their own float32 collective (a few bytes, one more small collective per step).
Gradients already in a 16-bit type (mixed precision) travel as they are.

Where the 16-bit values are summed, per engine (checked on this machine: TF 2.21, jax 0.10.2,
torch 2.13, CPU):

| backend | bf16 | fp16 |
|---|---|---|
| TensorFlow (gRPC ring / NCCL) | summed in bf16 by the collective | summed in fp16 |
| JAX flat path (gloo / NCCL) | **all-gather** of the bf16 bits, summed in float32 in worker order (XLA on CPU widens a bf16 all-reduce to float32, which would send float32 bytes) | summed in fp16 by `psum` |
| torch (gloo / nccl) | summed in bf16 by `all_reduce` | summed in fp16 |

The JAX bf16 all-gather sends as many bytes as a 16-bit ring all-reduce with 2 workers (each
worker receives the other's half-size vector) and `n - 1` vectors with `n` workers, against a
ring's `2 (n - 1) / n`: it stays below float32's ring up to 4 workers. JAX's DataParallel path
(BatchNormalization, custom `train_step`, several devices per worker) compresses in
`keras_mwms.backends.jax.sharded_step`, the same way over the devices.

Error bound (what the tests use). Rounding a float32 to bf16 has relative error at most
`u = 2^-8` (8 significant bits, rounded to nearest), to fp16 `u = 2^-11` (11 bits, in its
normal range). A summed
gradient of 2 workers is rounded three times at most (each worker's cast, the sum's rounding):
its error is below `2u · (|g_0| + |g_1|)`. With SGD at learning rate `lr` every step moves a
weight by `lr · g`, so after `K` steps two runs differ by at most about
`2u · Σ_k lr · (|g_0| + |g_1|)_k` per weight, plus what later steps amplify (small for a few
SGD steps). fp16 also has a range: values beyond 65504 become inf and below 6e-8 vanish, as with
DDP's fp16 hook; bf16 has float32's range.

Example:

>>> wire_dtype("bf16", "float32"), wire_dtype("fp16", "float32"), wire_dtype(None, "float32")
('bfloat16', 'float16', None)
>>> wire_dtype("bf16", "float16") is None     # already 16-bit: sent as it is
True
>>> relative_rounding("bf16"), relative_rounding("fp16")
(0.00390625, 0.00048828125)
"""

from __future__ import annotations

from keras_mwms import active

WIRE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_SIGNIFICANT_BITS = {"bf16": 8, "fp16": 11}
COMPRESSIBLE = ("float32", "float64")


def wire_dtype(compression: str | None, dtype) -> str | None:
    """The dtype name a gradient of `dtype` crosses the network in, or None (sent as it is).

    Example:

    >>> wire_dtype("fp16", "float64")
    'float16'
    """
    if compression is None:
        return None
    if compression not in WIRE_DTYPES:
        raise ValueError(f"compression={compression!r} is not a gradient compression; use None, "
                         f"'bf16' or 'fp16'.")
    name = getattr(dtype, "name", None) or str(dtype).replace("torch.", "")
    return WIRE_DTYPES[compression] if name in COMPRESSIBLE else None


def relative_rounding(compression: str) -> float:
    """Unit roundoff `u` of the wire type: a cast's relative error is at most `u` (normal range).

    Example:

    >>> relative_rounding("bf16") == 2.0 ** -8
    True
    """
    return 2.0 ** -_SIGNIFICANT_BITS[compression]


class WireBytes:
    """Bytes this process hands its engine's collectives for the training step's gradients.

    torch and JAX add each gradient collective's bytes as they issue it (`add`); TensorFlow
    runs them inside a traced graph, so it records each collective's bytes when the step is
    traced (`trace`): the graph issues them on every step. `per_step(steps)` is the sum.
    The exact scalars of the step (row counts, metric states) are counted too.

    Example:

    >>> counter = WireBytes()
    >>> counter.add(800); counter.add(8); counter.trace("rows", 4)
    >>> counter.per_step(steps=2)
    408.0
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forgets every count (call before the steps you measure)."""
        self.total = 0
        self.traced: dict[str, int] = {}

    def add(self, nbytes: int) -> None:
        """Counts one collective issued now."""
        self.total += int(nbytes)

    def trace(self, kind: str, nbytes: int) -> None:
        """Records the bytes of a collective a traced step issues every time it runs."""
        self.traced[kind] = int(nbytes)

    def per_step(self, steps: int) -> float:
        """Bytes per training step over the last `steps` steps."""
        return self.total / max(1, steps) + sum(self.traced.values())


WIRE = WireBytes()
active.register(__name__, "WIRE", reset=WIRE.reset, state=lambda: (WIRE.total, dict(WIRE.traced)))
