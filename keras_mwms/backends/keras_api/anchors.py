"""Where keras_mwms finds Keras' private classes and modules: each from a public one.

An `Anchor` names one private Keras object by how it is found, not by its module path: "the
class in `keras.Model.__mro__` that defines `make_train_function`" is `TensorFlowTrainer`,
`JAXTrainer` or `TorchTrainer` on Keras 3.12–3.15 and `Trainer` in each backend on the 3.16
nightlies, and the anchor does not care. A `Target` is an attribute path below an anchor (what
a patch row replaces, or a private function keras_mwms calls). Only two anchors have no public
object to start from and keep a module path (`JAX_UTILS`, `TORCH_ADAM`); both are feature
tested like every other one (`keras_mwms.backends.keras_api.usability`).

Example:

>>> TRAINER.get().__name__ in ("TensorFlowTrainer", "JAXTrainer", "TorchTrainer", "Trainer")
True
>>> target = Target(TRAINER, "make_train_function")
>>> str(target), target.exists()
('trainer.make_train_function', True)
>>> Target(TRAINER, "no_such_method").exists()
False
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keras_mwms.errors import KerasNameMissing

ALL_BACKENDS = ("tensorflow", "jax", "torch")


@dataclass(frozen=True)
class Anchor:
    """One private Keras object, found from a public one (or, for `public=False`, by path).

    Args:
        name: the short name used in patch tables and errors (`"trainer"`).
        found_as: how it is found, in words (`"class of keras.Model defining make_train_function"`).
        find: returns the object, or None where this Keras lacks it.
        backends: the Keras backends that need it.
        public: whether `find` starts from public Keras API (False: a `keras.src` module path).
    """

    name: str
    found_as: str
    find: Callable[[], Any]
    backends: tuple[str, ...] = ALL_BACKENDS
    public: bool = True

    def get(self) -> Any:
        """The object; `KerasNameMissing` naming the anchor where this Keras lacks it."""
        try:
            found = self.find()
        except (ImportError, AttributeError):
            found = None
        if found is None:
            raise KerasNameMissing(f"{self.name} ({self.found_as})")
        return found


@dataclass(frozen=True)
class Target:
    """An attribute path below an anchor: `Target(TRAINER, "fit")` is the trainer's `fit`.

    Args:
        anchor: where the path starts.
        path: dotted attributes (`"py_dataset_adapter.PyDatasetAdapter.get_tf_dataset"`).
        backends: the Keras backends that need it (default: the anchor's).
    """

    anchor: Anchor
    path: str
    backends: tuple[str, ...] | None = None

    def __str__(self) -> str:
        return f"{self.anchor.name}.{self.path}"

    @property
    def needed_by(self) -> tuple[str, ...]:
        return self.backends if self.backends is not None else self.anchor.backends

    def resolve(self) -> tuple[Any, str]:
        """The owner object and the last attribute's name (the owner must exist)."""
        owner = self.anchor.get()
        *owners, attribute = self.path.split(".")
        for part in owners:
            found = getattr(owner, part, _MISSING)
            if found is _MISSING:
                raise KerasNameMissing(str(self))
            owner = found
        return owner, attribute

    def get(self) -> Any:
        """The object the path names; `KerasNameMissing` where this Keras lacks it."""
        owner, attribute = self.resolve()
        found = getattr(owner, attribute, _MISSING)
        if found is _MISSING:
            raise KerasNameMissing(str(self))
        return found

    def exists(self) -> bool:
        try:
            self.get()
        except KerasNameMissing:
            return False
        return True


_MISSING = object()


def defining(klass: type, attribute: str) -> type | None:
    """The first class in `klass.__mro__` whose own namespace defines `attribute`.

    Example:

    >>> class Base:
    ...     def step(self): pass
    >>> class Child(Base): pass
    >>> defining(Child, "step").__name__, defining(Child, "missing")
    ('Base', None)
    """
    return next((owner for owner in klass.__mro__ if attribute in vars(owner)), None)


def _keras():
    import keras

    return keras


def _module_of(klass: type | None):
    return None if klass is None else sys.modules.get(klass.__module__)


def _package_of(module) -> Any:
    return None if module is None else importlib.import_module(module.__name__.rpartition(".")[0])


def _optional_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


TRAINER = Anchor("trainer", "class of keras.Model defining make_train_function",
                 lambda: defining(_keras().Model, "make_train_function"))
BASE_TRAINER = Anchor("base_trainer", "class of keras.Model defining compile",
                      lambda: defining(_keras().Model, "compile"))
TRAINER_MODULE = Anchor("trainer_module", "module of the trainer class",
                        lambda: _module_of(TRAINER.get()))
VARIABLE = Anchor("variable", "class of keras.Variable defining _initialize",
                  lambda: defining(_keras().Variable, "_initialize"))
LOSS_MODULE = Anchor("loss_module", "module of keras.losses.Loss",
                     lambda: _module_of(_keras().losses.Loss))
BASE_OPTIMIZER = Anchor("base_optimizer", "class of keras.optimizers.Optimizer defining apply",
                        lambda: defining(_keras().optimizers.Optimizer, "apply"))
BACKEND_OPTIMIZER = Anchor("backend_optimizer",
                           "class of keras.optimizers.Optimizer defining _backend_apply_gradients",
                           lambda: defining(_keras().optimizers.Optimizer, "_backend_apply_gradients"))
LOSS_SCALE_OPTIMIZER = Anchor("LossScaleOptimizer", "keras.optimizers.LossScaleOptimizer",
                              lambda: _keras().optimizers.LossScaleOptimizer)
MULTI_OPTIMIZER = Anchor("MultiOptimizer", "keras.optimizers.MultiOptimizer (Keras 3.15 and newer)",
                         lambda: getattr(_keras().optimizers, "MultiOptimizer", None))
BATCH_NORMALIZATION = Anchor("BatchNormalization", "keras.layers.BatchNormalization",
                             lambda: _keras().layers.BatchNormalization)
CALLBACK_LIST = Anchor("CallbackList", "keras.callbacks.CallbackList",
                       lambda: _keras().callbacks.CallbackList)
MODEL_CHECKPOINT = Anchor("ModelCheckpoint", "keras.callbacks.ModelCheckpoint",
                          lambda: _keras().callbacks.ModelCheckpoint)
TENSORBOARD = Anchor("TensorBoard", "keras.callbacks.TensorBoard", lambda: _keras().callbacks.TensorBoard)
LAYER = Anchor("Layer", "keras.layers.Layer", lambda: _keras().layers.Layer)
METRIC = Anchor("Metric", "keras.metrics.Metric", lambda: _keras().metrics.Metric)
DATA_ADAPTERS = Anchor("data_adapters", "package of keras.utils.PyDataset's module",
                       lambda: _package_of(_module_of(_keras().utils.PyDataset)))
STATELESS_SCOPE_MODULE = Anchor("stateless_scope_module", "module of keras.StatelessScope",
                                lambda: _module_of(_keras().StatelessScope))
DISTRIBUTION_MODULE = Anchor("distribution_module", "module of keras.distribution.TensorLayout",
                             lambda: _module_of(_keras().distribution.TensorLayout))
OPS_PACKAGE = Anchor("ops_package", "package of keras.ops.cond's module",
                     lambda: _package_of(_module_of(_keras().ops.cond)))
JAX_UTILS = Anchor("jax_utils", "module keras.src.utils.jax_utils",
                   lambda: _optional_module("keras.src.utils.jax_utils"), backends=("jax",), public=False)
TORCH_ADAM = Anchor("torch_adam", "module keras.src.backend.torch.optimizers.torch_adam",
                    lambda: _optional_module("keras.src.backend.torch.optimizers.torch_adam"),
                    backends=("torch",), public=False)
TORCH_SGD = Anchor("torch_sgd", "module keras.src.backend.torch.optimizers.torch_sgd",
                   lambda: _optional_module("keras.src.backend.torch.optimizers.torch_sgd"),
                   backends=("torch",), public=False)

ANCHORS = (TRAINER, BASE_TRAINER, TRAINER_MODULE, VARIABLE, LOSS_MODULE, BASE_OPTIMIZER, BACKEND_OPTIMIZER,
           LOSS_SCALE_OPTIMIZER, MULTI_OPTIMIZER, LAYER, BATCH_NORMALIZATION, CALLBACK_LIST, MODEL_CHECKPOINT,
           TENSORBOARD, METRIC, DATA_ADAPTERS, STATELESS_SCOPE_MODULE, DISTRIBUTION_MODULE, OPS_PACKAGE, JAX_UTILS,
           TORCH_ADAM, TORCH_SGD)
"""Every anchor, in the order ARCHITECTURE.md lists them."""


def markdown() -> str:
    """The anchors as Markdown rows (name, how it is found, public or a module path), for
    ARCHITECTURE.md's legend of the patch tables' targets."""
    lines = ["| anchor | found as | from |", "|---|---|---|"]
    lines += [f"| `{anchor.name}` | {anchor.found_as} | {'public API' if anchor.public else 'module path'} |"
              for anchor in ANCHORS]
    return "\n".join(lines)
