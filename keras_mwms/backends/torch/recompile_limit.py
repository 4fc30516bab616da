"""TorchDynamo's `recompile_limit`, hit in the compiled train step of a model in the scope: said once.

With `jit_compile=True` Keras' torch train step is one `torch.compile`d function for every model
of the process, and TorchDynamo guards it on the identity of the model and its layers: each
model compiled adds its own cache entries (2 for a plain `fit`). Once a function has
`torch._dynamo.config.recompile_limit` entries (8), TorchDynamo stops compiling it, so from
about the 5th compiled Keras model of a process on, `train_step` runs eagerly (with or without
keras_mwms), and torch says so only in one log line that names neither Keras nor the model.

The hits are read by `keras_mwms.diagnostics.recompile_limit.RecompileHits` (a
`logging.Filter` on torch's logger, run only when TorchDynamo compiles, never per step). A hit
inside the distributed train step of a model created in `strategy.scope()` warns once per
process (`warnings.warn`) with what happened and the way out. `watch()` installs it (once per
process), when a compiled model's train function is first wrapped
(`keras_mwms.backends.torch.step.wrap_train_function`).

Example (a real hit: a function compiled again for each integer, with a limit of 1, inside
a stand-in for a distributed train step):

>>> import types, torch, warnings
>>> from keras_mwms import active
>>> _ = active.begin("strategy", types.SimpleNamespace(in_train_step=True))
>>> step = torch.compile(lambda x, n: x + n, backend="eager")
>>> with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     hits_before = watch().count
...     [step(torch.zeros(1), n).item() for n in (1, 2)]
[1.0, 2.0]
>>> active.end("strategy")
>>> WATCH.count - hits_before, "torch._dynamo.reset()" in str(caught[-1].message)
(1, True)
"""

from __future__ import annotations

import warnings

from keras_mwms import active
from keras_mwms.diagnostics.recompile_limit import Hit, RecompileHits

_warned = False


def _warn_in_train_step(hit: Hit) -> None:
    """Warns at the first hit of the process that lands inside a distributed train step."""
    global _warned
    backend = active.active_backend()
    if _warned or backend is None or not getattr(backend, "in_train_step", False):
        return
    _warned = True
    warnings.warn(
        f"keras_mwms (torch): TorchDynamo hit torch._dynamo.config.{hit.limit} ({hit.value}) in the "
        f"compiled train step (function {hit.function}): from now on that part of the step runs "
        "without compilation, so jit_compile=True no longer speeds it up. Keras' torch step "
        "guards on the identity of the model and its layers, so every model compiled in one "
        "process adds cache entries (about 4 models fill the default limit). Call "
        "torch._dynamo.reset() before building the next model, or raise "
        f"torch._dynamo.config.{hit.limit}; TORCH_LOGS=recompiles shows every reason.",
        RuntimeWarning, stacklevel=2)


WATCH = RecompileHits(on_hit=_warn_in_train_step)


def watch() -> RecompileHits:
    """Installs `WATCH` on TorchDynamo's logger (once per process) and returns it."""
    return WATCH.install()
