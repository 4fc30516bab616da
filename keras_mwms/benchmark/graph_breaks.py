"""Graph breaks TorchDynamo recorded while a block ran: where a `torch.compile`d step splits.

`jit_compile=True` on torch hands Keras' train step to `torch.compile`. Each *graph break* ends
one compiled graph and starts another, with eager Python in between: the step then runs as
several graphs, and nothing can be scheduled across a break (no all-reduce overlapping the
backward of the same graph, no fusion of the optimizer update with the all-reduce).
`GraphBreaks` reads TorchDynamo's own counter (`torch._dynamo.utils.counters["graph_break"]`,
one entry per reason, counted each time a frame is traced) before and after a block.

Where keras_mwms' compiled step breaks today (torch 2.13, Keras 3.15.1):

* `loss.backward()` in Keras' `train_step`: Dynamo traces it only with
  `torch._dynamo.config.trace_autograd_ops=True`, which fails on Keras' layers in torch 2.13
  (`AssertionError: 'self' not in cell_and_freevars` in plain Keras, a wrongly sized gradient
  with the strategy), so it stays off;
* with SGD, Keras' own torch update (`_foreach_add_(..., alpha=-learning_rate)` reads a tensor
  as a number: "Data dependent operator"), inside Keras' `name_scope`, so Dynamo runs the rest
  of that `apply` eagerly. Adam has no such break.

The gradient all-reduce is no break in its plain form (`jit_compile=True`, no accumulation, no
LossScaleOptimizer, no per-worker BatchNormalization statistics): torch's functional
collectives put it in the graph (`keras_mwms.backends.torch.gradients.averaged_in_graph`);
otherwise it runs eagerly (`torch.compiler.disable`), one more break.

The fit scenario of `tests/test_backend_torch.py` (SGD, 2 workers) records 2 reasons, 9 events
(3 reasons, 8 events with the all-reduce outside the graph); the benchmark's MLP (Adam, 2
workers) 3 events, `loss.backward()` alone (5 before), as many as DDP + torch.compile.

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
