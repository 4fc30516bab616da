"""The options keras_mwms compiles a model's torch train step with: comparison masks are
recomputed in backward, not saved from forward (CPU).

Keras' torch trainer compiles its step with a bare `torch.compile(one_step_on_data)`. For a
ReLU, autograd's backward needs `relu(x) <= 0`; AOTAutograd's min-cut partitioner saves that
mask from the forward graph as a `bool` tensor (a quarter of the float's bytes). On CPU,
Inductor (torch 2.13, AVX-512) stores a vectorized comparison into `bool` memory through a slow
conversion (`VecMask::store(bool*)`): 590k elements cost ~6 ms of CPU, against 0.1 ms for the
float ReLU itself and 0.9 ms eagerly. On the benchmark's conv net (two 3×3 convolutions with
ReLU, global average pooling, 128 rows) the two saved masks were 10 of the compiled step's
~26 ms, and compiling made the step 2× slower than eager.

`RecomputeMasks`, an Inductor joint-graph pass, tags every comparison as `MUST_RECOMPUTE`
(the tag selective activation checkpointing uses): the partitioner then saves the comparison's
float input, and backward recomputes the mask inside the kernel that uses it, never storing it.
The values are the same comparisons of the same floats; only kernel fusion (and so the
summation order inside a fused reduction) can change. Measured at 128 rows, one thread: the
conv step from 27.1 to 9.5 ms of CPU (eager: 13.5), the MLP unchanged (10.8 → 10.5).

`recompile` gives a model's fresh compiled train function these options (`OPTIONS`, passed as
`torch.compile(..., options=)`, so nothing global changes and `torch.compile` elsewhere in the
process is untouched); it is applied on CPU only, where the `bool` store is slow. Used for
models built in `strategy.scope()` (the `torch-train-function` row of
`keras_mwms.backends.torch.patches`).

Example:

>>> import torch
>>> step = torch.compile(lambda x: torch.relu(x).sum())
>>> recompiled = with_options(step)
>>> recompiled is not step and compiled_with_options(recompiled), compiled_with_options(step)
(True, False)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from keras_mwms.backends.torch.state import STATE

_aten = torch.ops.aten
COMPARISONS = frozenset(
    getattr(getattr(_aten, name), overload)
    for name in ("eq", "ne", "le", "lt", "ge", "gt")
    for overload in ("Scalar", "Tensor"))


class RecomputeMasks(CustomGraphPass):
    """An Inductor joint-graph pass: every comparison is recomputed in backward, never saved.

    Example:

    >>> import torch.fx
    >>> graph = torch.fx.Graph()
    >>> x = graph.placeholder("x")
    >>> mask = graph.call_function(torch.ops.aten.le.Scalar, (x, 0))
    >>> _ = graph.output(mask)
    >>> RecomputeMasks()(graph)
    >>> mask.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    True
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and node.target in COMPARISONS:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    def uuid(self) -> str:
        """The key of this pass in Inductor's FX graph cache (change it with the pass)."""
        return "keras_mwms.recompute_masks.v1"


OPTIONS = {"joint_custom_post_pass": RecomputeMasks()}
_MARK = "_keras_mwms_compile_options"


def compiled_with_options(function: Callable) -> bool:
    """Whether `function` is a train function `with_options` made."""
    return getattr(function, _MARK, False)


def with_options(compiled: Callable) -> Callable:
    """The function `compiled` (a `torch.compile` result) wraps, compiled again with `OPTIONS`.

    Raises `TypeError` if `compiled` did not come from `torch.compile`.
    """
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    if original is None:
        raise TypeError(f"with_options expects a function made by torch.compile; got {compiled!r}. "
                        "Pass the model's train_function right after Keras' make_train_function.")
    recompiled = torch.compile(original, options=OPTIONS)
    setattr(recompiled, _MARK, True)
    return recompiled


def recompile(model) -> None:
    """Gives `model`'s fresh compiled train function `OPTIONS`, on CPU (else leaves it alone)."""
    function = model.train_function
    if (function is None or compiled_with_options(function)
            or getattr(function, "_torchdynamo_orig_callable", None) is None):
        return                                         # eager, already done, or wrapped
    if all(variable.value.device.type == "cpu" for variable in model.trainable_variables):
        model.train_function = with_options(function)
        STATE.of(model).compile_options = True
