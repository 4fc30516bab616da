"""Graph breaks TorchDynamo recorded while a block ran: where a `torch.compile`d step splits.

`jit_compile=True` on torch hands Keras' train step to `torch.compile`. Each *graph break* ends
one compiled graph and starts another, with eager Python in between: the step then runs as
several graphs, and nothing can be scheduled across a break (no all-reduce overlapping the
backward of the same graph, no fusion of the optimizer update with the all-reduce).
`GraphBreaks` reads TorchDynamo's own counter (`torch._dynamo.utils.counters["graph_break"]`,
one entry per reason, counted each time a frame is traced) before and after a block.

Where keras_mwms' compiled step breaks today (torch 2.13, Keras 3.15.1):

* `loss.backward()` in Keras' `train_step`, the one break left: Dynamo traces it only with
  `torch._dynamo.config.trace_autograd_ops=True`, which fails on Keras' layers in torch 2.13
  (Keras' `CallContext` is taken for a tensor: `AttributeError: 'Tensor' object has no
  attribute 'set_value'` in `Layer.__call__`, reported through Keras' traceback filter as
  `'self' not in cell_and_freevars`), so it stays off. `compiled_autograd` compiles the
  backward but keeps this break. DDP + torch.compile breaks at its own `backward()` too.

Gone: Keras' torch SGD update (`_foreach_add_(..., alpha=-learning_rate)` read a tensor as a
number, "Data dependent operator", in plain Keras too) is one custom op in the graph
(`keras_mwms.backends.torch.compiled_sgd`); the gradient all-reduce, in its plain form
(`jit_compile=True`, no accumulation, no LossScaleOptimizer, no per-worker BatchNormalization
statistics), is in the graph through torch's functional collectives
(`keras_mwms.backends.torch.gradients.averaged_in_graph`); otherwise it runs eagerly
(`torch.compiler.disable`), one more break.

The fit scenario of `tests/test_backend_torch.py` (SGD, 2 workers) and the benchmark's MLP
(Adam, 2 workers) record `loss.backward()` alone, 3 events (SGD: 9 events and 2 reasons
before `compiled_sgd`), as many as DDP + torch.compile.

Example:

>>> import torch
>>> with GraphBreaks() as breaks:
...     torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1)).tolist()
[2.0]
>>> breaks.count, breaks.reasons
(0, [])
"""

from __future__ import annotations

from collections import Counter


def _graph_break_counter() -> Counter:
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


class GraphBreaks:
    """Context: the graph breaks TorchDynamo recorded inside it.

    `count`: break events (a reason counts once per frame traced, recompilations included);
    `reasons`: the distinct reasons, each reduced to its first line, sorted.
    """

    def __init__(self) -> None:
        self.count = 0
        self.reasons: list[str] = []

    def __enter__(self) -> GraphBreaks:
        self._before = _graph_break_counter()
        return self

    def __exit__(self, *exc) -> bool:
        new = _graph_break_counter() - self._before
        self.count = sum(new.values())
        self.reasons = sorted({reason.splitlines()[0].strip() for reason in new})
        return False
