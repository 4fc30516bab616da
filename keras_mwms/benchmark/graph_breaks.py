"""Graph breaks TorchDynamo recorded while a block ran: where a `torch.compile`d step splits.

`jit_compile=True` on torch hands Keras' train step to `torch.compile`. Each *graph break* ends
one compiled graph and starts another, with eager Python in between: the step then runs as
several graphs, and nothing can be scheduled across a break (no all-reduce overlapping the
backward of the same graph, no fusion of the optimizer update with the all-reduce).
`GraphBreaks` reads TorchDynamo's own counter (`torch._dynamo.utils.counters["graph_break"]`,
one entry per reason, counted each time a frame is traced) before and after a block.

Where keras_mwms' compiled step breaks today (torch 2.13, Keras 3.15.1): nowhere, for a model
with Keras' own train step and its all-reduce in the graph, BatchNormalization layers included.

* `loss.backward()` in Keras' `train_step` ("Unsupported Tensor.backward() call", 3 events per
  fit; DDP + torch.compile breaks at its own `backward()` too) is gone: keras_mwms runs the same
  step with `torch.autograd.grad`, traced with `trace_autograd_ops=True`
  (`keras_mwms.backends.torch.compiled_step`). Dynamo's own tracing of `backward()` under that
  flag assigns gradients to the wrong weights on Keras models ("attempting to assign a gradient
  of size '[10]' to a tensor of size '[64, 10]'"), so it stays off for custom train steps,
  which keep this break.
* Keras' torch SGD update (`_foreach_add_(..., alpha=-learning_rate)` read a tensor as a number,
  "Data dependent operator", in plain Keras too) is one custom op in the graph
  (`keras_mwms.backends.torch.compiled_sgd`).
* The gradient all-reduce, in its plain form (`jit_compile=True`, no accumulation, no
  LossScaleOptimizer; per-worker BatchNormalization statistics ride in it), is in the graph through
  torch's functional collectives (`keras_mwms.backends.torch.gradients.averaged_in_graph`);
  otherwise it runs eagerly (`torch.compiler.disable`), one more break, and Keras' `backward()`
  stays.
* BatchNormalization's global moments are summed in the graph beside it (a functional
  all-reduce whose backward all-reduces the moments' gradient,
  `keras_mwms.backends.torch.gradients.synchronized_moments`); with an eager gradient
  all-reduce they stay eager too, one more break.

`GraphBreaks` also counts the block's hits of TorchDynamo's `recompile_limit`
(`recompile_limit_hits`): a function that hit it stops being compiled, and the rest of the block
runs it eagerly. Keras' torch step guards on the identity of the model and its layers, so the
5th compiled model of a process hits it unless TorchDynamo's cache is reset in between
(`keras_mwms.benchmark.torch_variants.fresh_dynamo_cache`). The count reads the warning torch
logs at each hit (`keras_mwms.diagnostics.recompile_limit.RecompileHits`), with a
`logging.Filter` present only inside the block: nothing is added per step.

The fit scenario of `tests/test_backend_torch.py` (SGD, 2 workers) records no break (3 events
with `loss.backward()`, 9 and 2 reasons before `compiled_sgd`).

Example:

>>> import torch
>>> with GraphBreaks() as breaks:
...     torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1)).tolist()
[2.0]
>>> breaks.count, breaks.reasons, breaks.recompile_limit_hits
(0, [], 0)
"""

from __future__ import annotations

from collections import Counter

from keras_mwms.diagnostics.recompile_limit import RecompileHits


def _graph_break_counter() -> Counter:
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


class GraphBreaks:
    """Context: the graph breaks TorchDynamo recorded inside it.

    `count`: break events (a reason counts once per frame traced, recompilations included);
    `reasons`: the distinct reasons, each reduced to its first line, sorted;
    `recompile_limit_hits`: functions TorchDynamo stopped compiling inside it (module docstring).
    """

    def __init__(self) -> None:
        self.count = 0
        self.reasons: list[str] = []
        self.recompile_limit_hits = 0
        self._hits = RecompileHits()

    def __enter__(self) -> GraphBreaks:
        self._before = _graph_break_counter()
        self._hits.install()
        return self

    def __exit__(self, *exc) -> bool:
        self._hits.remove()
        self.recompile_limit_hits = self._hits.count
        new = _graph_break_counter() - self._before
        self.count = sum(new.values())
        self.reasons = sorted({reason.splitlines()[0].strip() for reason in new})
        return False
