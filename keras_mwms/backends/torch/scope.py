"""`strategy.scope()` on torch: variables created inside take the chief's values at its exit.

Creating a variable enters no collective, so one worker may build or load a model alone
(`keras.models.load_model`, `model.save` on the chief). The variables created inside the block
are broadcast from the chief in one collective at the exit of the outermost scope, which every
worker reaches, so `model.get_weights()` agrees everywhere right after the block even when the
workers seeded differently. Every worker must therefore run the same `with strategy.scope():`
blocks, as with TensorFlow's MultiWorkerMirroredStrategy; a block that differs is a clear
error on every worker, not a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
from collections.abc import Iterator
from typing import Any

from keras_mwms.backends import policy
from keras_mwms.backends.keras_api import attributes


class ScopeVariables:
    """The variables created in the current (outermost) scope, agreed on when it is left.

    Example (one worker: nothing to agree on):

    >>> from types import SimpleNamespace as Object
    >>> variables = ScopeVariables(Object(distributed=False))
    >>> with variables.scope():
    ...     variables.active
    True
    >>> variables.active
    False

    Args:
        engine: the `TorchEngine` (its store, its broadcast and the collective timeout).
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self._depth = 0
        self._lock = threading.Lock()
        self._created: dict[int, Any] = {}
        self._exits = 0

    @property
    def active(self) -> bool:
        """Whether a `scope()` block is open."""
        return self._depth > 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[Any]:
        with self._lock:
            self._depth += 1
        try:
            yield self.engine
        finally:
            with self._lock:
                self._depth -= 1
                created = list(self._created.values()) if self._depth == 0 else []
                if self._depth == 0:
                    self._created.clear()
        # Reached only when the block did not raise: a worker whose block failed joins nothing.
        self._agree(created)

    def note(self, variable: Any) -> None:
        """Remembers a new Keras variable when it is created inside the scope."""
        if self._depth and self.engine.distributed:
            self._created[id(variable)] = variable

    def _agree(self, variables: list) -> None:
        """The chief's values for `variables` on every worker, checked first through the store.

        Each worker posts the shapes and dtypes it created and reads everyone's, so all workers
        decide alike: the same list everywhere is one broadcast per dtype; a different list, or
        a worker that never leaves a scope (a block run on one worker alone), is a `ValueError`
        naming the workers and the fix, raised without entering any collective.
        """
        variables = [variable for variable in variables
                     if attributes.variable_value(variable) is not None
                     and attributes.variable_value(variable).device.type != "meta"]
        engine = self.engine
        if not variables or not engine.distributed:
            return
        import torch.distributed as dist

        self._exits += 1
        prefix = f"keras_mwms/scope-variables/{self._exits}/"
        keys = [f"{prefix}{rank}" for rank in range(engine.num_workers)]
        signature = [[list(variable.shape), str(variable.dtype)] for variable in variables]
        store = dist.distributed_c10d._get_default_store()
        store.set(keys[engine.worker_index], json.dumps(signature))
        try:
            store.wait(keys, datetime.timedelta(seconds=engine.timeout_seconds))
        except Exception as error:
            absent = [rank for rank, key in enumerate(keys) if not _has_key(store, key)]
            raise ValueError(
                f"keras_mwms worker {engine.worker_index}: "
                f"{', '.join(policy.worker_label(engine.resolver, rank) for rank in absent) or 'a worker'} "
                f"did not leave `strategy.scope()` block #{self._exits} within "
                f"{engine.timeout_seconds:.0f} s ({error}). Every worker must run the same "
                "`with strategy.scope():` blocks, creating the same models and optimizers in the "
                "same order; build or load what one worker needs alone (under `if "
                "strategy.is_chief:`) outside the scope."
            ) from error
        signatures = [json.loads(store.get(key)) for key in keys]
        differing = [rank for rank in range(1, engine.num_workers) if signatures[rank] != signatures[0]]
        if differing:
            raise ValueError(
                f"keras_mwms worker {engine.worker_index}: the variables created in "
                f"`strategy.scope()` block #{self._exits} differ between workers: "
                f"{len(signatures[0])} on the chief, "
                + ", ".join(f"{len(signatures[rank])} on worker {rank}" for rank in differing)
                + f" (first shapes and dtypes on the chief {signatures[0][:3]}, on worker "
                f"{differing[0]} {signatures[differing[0]][:3]}). Every worker must run the same "
                "`with strategy.scope():` blocks, creating the same models and optimizers in the "
                "same order; build what one worker needs alone outside the scope.")
        engine.broadcast_tensors([variable.value.data for variable in variables],
                                 what="broadcast of the chief's values at the end of strategy.scope()")


def _has_key(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False
