"""One `fit` / `evaluate` / `predict` / `*_on_batch` call of Keras, made multi-worker: the policy, once.

Every backend patches these Keras methods with `fit_call.replacement(method, hooks)`. The
replacement binds the call's arguments once (`FitCall`: by name, Keras' defaults filled in,
editable) and runs one policy, in one order, on every backend:

1. **who trains the model** — `fit`/`train_on_batch` of a model created outside
   `strategy.scope()` stops every worker with the fix (`model_scope.require_created_in_scope`),
   before any collective;
2. **TF_CONFIG unchanged** since the strategy was created (`Backend.check_tf_config_unchanged`);
3. **fit's validation pass** (`_use_cached_eval_dataset`) belongs to its `fit`: Keras' own;
4. **a model of no strategy** (created outside the scope) runs on this worker alone, as plain
   Keras, with a warning on several workers (`FitHooks.alone`), entering no collective;
5. **progress on the chief** only (the logs are global: N copies would interleave);
6. **fit's inputs** — every worker takes the chief's random states (`FitHooks.align_shuffles`),
   one row check (`policy.check_same_rows`: equal lengths, and the first batch of a tf.data
   input), validation data's rows too, `validation_split` and array `class_weight` as Keras
   does them (split first, so validation rows carry no class weights), then a resumable fit's
   ordered stream (`resumable_inputs.prepare_fit`); `evaluate`: the row check;
7. **the feed** — what is backend-specific: how the inputs reach the step (`FitHooks.feed`);
   an input that already is this worker's part (`FitHooks.fed`) skips 6 and 7;
8. **Keras' loop** inside the backend's context (`FitHooks.loop`); `predict` and
   `predict_on_batch` on this worker alone (`FitHooks.predict`); a `fit` ends with the
   workers-agree check (`Backend.check_workers_agree`);
9. **a lost peer** anywhere in 6-8 becomes `keras_mwms.WorkerLostError` (`FitHooks.guard`).

A backend supplies only `FitHooks` (steps 4 and 6-9); everything else is here.

Example (one worker, a backend with the default hooks: Keras' own call, its arguments bound once):

>>> from types import SimpleNamespace as Object
>>> backend = Object(num_workers=1, worker_index=0, is_chief=True, uses=lambda model: True,
...                  check_tf_config_unchanged=lambda stacklevel: None,
...                  broadcast_object=lambda value, root=0: value)
>>> def predict(self, x, batch_size=None, verbose="auto"):
...     return (x, batch_size)
>>> run(FitCall("predict", predict, Object(), backend, (3,), {}), FitHooks())
(3, None)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

from keras_mwms import active
from keras_mwms.backends import loss_reduction, model_scope, policy
from keras_mwms.backends.keras_api import attributes, internals
from keras_mwms.data import first_batch_digest
from keras_mwms.resume import resumable_inputs

TRAINING = ("fit", "train_on_batch")           # these change the weights: refused outside the scope
ON_THIS_WORKER = ("predict", "predict_on_batch")   # no collective: one worker may call them alone
# The arguments the policy reads, by method (each backend's patch rows check Keras still has them).
PARAMETERS = {
    "fit": ("x", "y", "batch_size", "verbose", "sample_weight", "class_weight", "validation_split",
            "validation_data", "validation_batch_size", "validation_steps", "shuffle", "callbacks",
            "steps_per_epoch"),
    "evaluate": ("x", "y", "batch_size", "verbose", "sample_weight", "steps"),
    "predict": ("x", "batch_size", "verbose", "steps"),
    "predict_on_batch": ("x",),
}


class FitCall:
    """One call of a Keras training method: its arguments bound once, by name, editable.

    `arguments` holds every parameter of Keras' method (defaults filled in) except the model;
    a hook changes the call by changing them. `keras()` calls Keras' original with them.
    """

    def __init__(self, method: str, original: Callable, model: Any, backend: Any, args: tuple, kwargs: dict):
        self.method, self.original, self.model, self.backend = method, original, model, backend
        self.bound = inspect.signature(original).bind(model, *args, **kwargs)
        self.bound.apply_defaults()
        self.arguments = self.bound.arguments
        self.state: dict[str, Any] = {}   # what a backend's hooks hand each other during the call

    @property
    def where(self) -> str:
        """How messages name the call: `model.fit()`."""
        return f"model.{self.method}()"

    @property
    def in_fit(self) -> bool:
        """Whether this is `fit`'s own validation pass (Keras' `_use_cached_eval_dataset`)."""
        return attributes.is_fit_validation(self.arguments.get("kwargs") or {})

    def keras(self) -> Any:
        """Keras' original method with the (possibly changed) arguments."""
        return self.original(*self.bound.args, **self.bound.kwargs)


class FitHooks:
    """What one backend does differently in a call; the defaults are Keras' own behaviour.

    Subclass per backend and override what differs. Each hook gets the `FitCall`; `feed`
    changes `call.arguments` in place, the context managers wrap what the policy runs inside.
    """

    def alone(self, call: FitCall) -> Any:
        """A model of no strategy: Keras' own call on this worker, entering no collective."""
        return call.keras()

    def fed(self, x: Any) -> bool:
        """Whether `x` is already this worker's part of the data: fed as it is, unchecked."""
        return False

    def align_shuffles(self, call: FitCall) -> None:
        """`fit`: every worker takes the chief's random states the input's shuffle draws from."""

    def feed(self, call: FitCall) -> None:
        """Replaces the call's inputs with what this backend's loop consumes (a shard, an adapter)."""

    def loop(self, call: FitCall) -> contextlib.AbstractContextManager:
        """The context Keras' loop of a `fit`/`evaluate` runs in."""
        return contextlib.nullcontext()

    def predict(self, call: FitCall) -> Any:
        """`predict`/`predict_on_batch` on this worker alone, with no collective."""
        return call.keras()

    def guard(self, call: FitCall) -> contextlib.AbstractContextManager:
        """Turns a lost peer's error in the call into `keras_mwms.WorkerLostError`."""
        return contextlib.nullcontext()


def replacement(method: str, hooks: FitHooks) -> Callable[[Callable], Callable]:
    """The patch replacement factory for Keras' `<Trainer>.<method>`, keeping its signature.

    With no keras_mwms strategy active the wrapper calls Keras' original unchanged.

    Example:

    >>> def fit(self, x=None, y=None, verbose="auto"):
    ...     return verbose
    >>> wrapped = replacement("fit", FitHooks())(fit)
    >>> inspect.signature(wrapped) == inspect.signature(fit), wrapped.__wrapped__ is fit
    (True, True)
    """
    def wrap(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(model, *args, **kwargs):
            backend = active.active_backend()
            if backend is None:
                return original(model, *args, **kwargs)
            return run(FitCall(method, original, model, backend, args, kwargs), hooks)

        return wrapper

    return wrap


def run(call: FitCall, hooks: FitHooks) -> Any:
    """Runs one call by the policy of the module docstring."""
    backend, model, arguments = call.backend, call.model, call.arguments
    if call.method in TRAINING:
        model_scope.require_created_in_scope(backend, model, call.method)
    backend.check_tf_config_unchanged(stacklevel=3)
    if call.in_fit:
        return call.keras()
    if not backend.uses(model):
        if backend.num_workers > 1:
            warnings.warn(
                f"{call.where} runs on this worker alone: the model was not created inside "
                "keras_mwms strategy.scope(). Create the model (and compile it) under "
                "`with strategy.scope():` to train on all workers.", stacklevel=3)
        return hooks.alone(call)
    if call.method not in ON_THIS_WORKER:
        loss_reduction.require_mean_reduced(backend, model, call.where)
    if not backend.is_chief and "verbose" in arguments:
        arguments["verbose"] = 0
    with hooks.guard(call):
        if not hooks.fed(arguments.get("x")):
            if call.method == "fit":
                _fit_inputs(call, hooks)
            elif call.method == "evaluate":
                policy.check_same_rows(backend, arguments["x"], call.where, stacklevel=4)
            hooks.feed(call)
        if call.method in ON_THIS_WORKER:
            return hooks.predict(call)
        with hooks.loop(call):
            result = call.keras()
        if call.method == "fit":
            backend.check_workers_agree(model, call.where)
        return result


def _fit_inputs(call: FitCall, hooks: FitHooks) -> None:
    """Step 6 of the module docstring: agreed shuffles, row checks, Keras' own input rules."""
    backend, arguments = call.backend, call.arguments
    hooks.align_shuffles(call)
    x = arguments["x"]
    # The digest reads a tf.data input's shuffle seeds or first batch: only where it is compared.
    compared = backend.num_workers > 1 and not shard_policy_is_off(x)
    policy.check_same_rows(backend, x, call.where, digest=first_batch_digest(x) if compared else None,
                           stacklevel=5, batch_size=arguments["batch_size"])
    if arguments["validation_data"] is not None:
        policy.check_same_rows(backend, arguments["validation_data"], f"{call.where}'s validation_data",
                               stacklevel=5)
    split_validation(arguments)
    class_weights_as_sample_weights(arguments)
    resumable_inputs.prepare_fit(backend, call.model, arguments)


def split_validation(arguments: dict) -> None:
    """`validation_split` as Keras' `fit` does it: the last rows, before any shuffle or weights.

    Example:

    >>> import numpy as np
    >>> arguments = {"x": np.arange(4), "y": np.arange(4), "sample_weight": None,
    ...              "validation_split": 0.25, "validation_data": None}
    >>> split_validation(arguments)
    >>> arguments["x"].tolist(), [part.tolist() for part in arguments["validation_data"][:2]]
    ([0, 1, 2], [[3], [3]])
    """
    if not arguments["validation_split"] or arguments["validation_data"] is not None:
        return
    (arguments["x"], arguments["y"], arguments["sample_weight"]), arguments["validation_data"] = (
        internals.train_validation_split(
            (arguments["x"], arguments["y"], arguments["sample_weight"]), arguments["validation_split"]))
    arguments["validation_split"] = 0.0


def class_weights_as_sample_weights(arguments: dict) -> None:
    """Array inputs: `class_weight` becomes the sample weights Keras' array adapter makes of it.

    Other inputs keep `class_weight` for the backend's feed (Keras' adapters apply it, or say
    why they cannot).

    Example:

    >>> import numpy as np
    >>> arguments = {"x": np.zeros((3, 1)), "y": np.array([0, 1, 1]), "sample_weight": None,
    ...              "class_weight": {1: 2.0}}
    >>> class_weights_as_sample_weights(arguments)
    >>> arguments["sample_weight"].tolist(), arguments["class_weight"]
    ([1.0, 2.0, 2.0], None)
    """
    class_weight, y = arguments["class_weight"], arguments["y"]
    if class_weight is None or not is_arrays(arguments["x"], y, arguments["sample_weight"]):
        return
    from keras import tree

    if arguments["sample_weight"] is not None:
        raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")
    if tree.is_nested(y):
        raise ValueError("`class_weight` is only supported for Models with a single output.")
    arguments["sample_weight"] = internals.class_weight_to_sample_weights(y, class_weight)
    arguments["class_weight"] = None


def is_arrays(x: Any, y: Any = None, sample_weight: Any = None) -> bool:
    """Whether `(x, y, sample_weight)` are in-memory arrays (NumPy, any backend's tensors).

    Example:

    >>> import numpy as np
    >>> is_arrays(np.zeros((2, 1)), np.zeros(2)), is_arrays(iter([]))
    (True, False)
    """
    return x is not None and internals.can_convert_arrays((x, y, sample_weight))


def shard_policy_is_off(x: Any) -> bool:
    """True for a tf.data dataset with `AutoShardPolicy.OFF`: each worker's data by intent.

    Example:

    >>> shard_policy_is_off([1, 2, 3])
    False
    """
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(x, tf.data.Dataset):
        return False
    return x.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF
