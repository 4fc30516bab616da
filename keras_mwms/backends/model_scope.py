"""Which models train on every worker: those created inside `strategy.scope()`, on every backend.

A model trains across workers when it was created (its `Model.__init__` ran) inside
`with strategy.scope():` — TensorFlow's rule, kept on JAX and torch. Keras gives no hook when
a model is created, so the one row of `PATCHES` tags each model created while a keras_mwms
strategy is active with that strategy's backend (or with `None` outside its scope).
Backends read the tag (`backend_of`); `require_created_in_scope` is the one check at `fit`:
with several workers, a model created outside the scope, or before the strategy existed,
would train on each worker alone and end with different weights on each (TensorFlow's
variables are not mirrored, torch's not broadcast), so `fit` stops on every worker with an
error that says where the model was created and how to fix it. Every worker runs the same
script, so every worker stops there, before any collective: nothing hangs. With one worker
(no TF_CONFIG) any model trains, as in plain Keras.

Example:

>>> class Model: pass
>>> model = Model()
>>> backend_of(model) is None
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from keras_mwms import active
from keras_mwms.backends.keras_api import targets
from keras_mwms.backends.patches import ObjectState, Patch, PatchTable

_MODELS = ObjectState()   # model -> backend (its scope's), created_outside (a strategy was active)
active.register(__name__, "_MODELS", reset=_MODELS.clear, state=_MODELS.__len__)
_OUTSIDE = "outside strategy.scope()"
_BEFORE = "before keras_mwms.MultiWorkerMirroredStrategy() was created"


def backend_of(model: Any) -> Any:
    """The backend of the `strategy.scope()` `model` was created in; None for any other model."""
    return _MODELS.get(model, "backend")


def where_created(model: Any) -> str:
    """Where `model` was created, as the error says it: in the scope, outside it, or before the strategy.

    Example:

    >>> class Model: pass
    >>> where_created(Model())
    'before keras_mwms.MultiWorkerMirroredStrategy() was created'
    """
    if backend_of(model) is not None:
        return "inside strategy.scope()"
    return _OUTSIDE if _MODELS.get(model, "created_outside", False) else _BEFORE


def require_created_in_scope(backend: Any, model: Any, call: str) -> None:
    """Raises `ValueError` (on every worker) when `model.<call>` would train it on each worker alone.

    `backend.uses(model)` says whether the model belongs to this strategy; one worker trains
    any model, as plain Keras does.

    Example:

    >>> from types import SimpleNamespace as Object
    >>> class Model: pass
    >>> backend = Object(num_workers=2, worker_index=1, uses=lambda model: False)
    >>> try:
    ...     require_created_in_scope(backend, Model(), "fit")
    ... except ValueError as error:
    ...     print(str(error)[:95])
    keras_mwms worker 1: model.fit() on a model created before keras_mwms.MultiWorkerMirroredStrate
    """
    if backend.num_workers == 1 or backend.uses(model):
        return
    name = getattr(model, "name", type(model).__name__)
    raise ValueError(
        f"keras_mwms worker {backend.worker_index}: model.{call}() on a model created "
        f"{where_created(model)} (model {name!r}): it would train on each of the "
        f"{backend.num_workers} workers alone and end with different weights on each. Build and "
        "compile the model inside `with strategy.scope():`, after "
        "`strategy = keras_mwms.MultiWorkerMirroredStrategy()` (`keras.models.load_model` too). "
        "Every worker stopped here, before any collective.")


def _tag_models(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        backend = active.active_backend()
        if backend is not None:
            state = _MODELS.of(self)
            state.backend = backend if backend.in_scope else None
            state.created_outside = not backend.in_scope

    return __init__


PATCHES = PatchTable("model-scope", [Patch(
    name="tag-models-in-scope",
    target=targets.BASE_TRAINER_INIT,
    replacement=_tag_models,
    works_around="Keras has no hook when a model is created: models created in strategy.scope() "
                 "are tagged with its backend, those created outside it are noted (every backend)",
)])
