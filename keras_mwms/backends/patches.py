"""The declarative table of private-Keras patches, and the one way to install and remove them.

Every change keras_mwms makes to Keras internals is a `Patch` row: its name, the target
(`"module:Owner.attribute"`), a factory that turns the original into the replacement, the
upstream issue or Keras behaviour it works around, the Keras releases it is written for and
the parameters the target must still accept. A backend's rows form a `PatchTable`; the
strategy installs it when the backend joins and `MultiWorkerMirroredStrategy.close()`
uninstalls it, restoring every original exactly.

Before a row is applied the table checks, loudly and before anything is changed:

- the Keras release (rows name the releases they were tested on; set
  `KERAS_MWMS_ALLOW_UNTESTED_KERAS=1` to try others, with a warning);
- the target exists and still accepts the parameters the replacement relies on.

Replacements that wrap the original forward `*args, **kwargs`, so a Keras release that adds a
parameter keeps working; per-object state lives in `ObjectState`, never in attributes set on
Keras objects.

Example:

>>> import types
>>> holder = types.SimpleNamespace(greet=lambda name: f"hello {name}")
>>> table = PatchTable("example", [Patch(
...     name="shout", target=holder, attribute="greet",
...     replacement=lambda original: lambda *args, **kwargs: original(*args, **kwargs).upper(),
...     works_around="an example", keras_versions=ANY_KERAS, parameters=("name",))])
>>> table.install(); holder.greet("keras")
'HELLO KERAS'
>>> table.uninstall(); holder.greet("keras")
'hello keras'
"""

from __future__ import annotations

import importlib
import inspect
import os
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

TESTED_KERAS_VERSIONS = ("3.15.1",)
ANY_KERAS = ("*",)
ALLOW_UNTESTED_ENV = "KERAS_MWMS_ALLOW_UNTESTED_KERAS"


def require_tested_keras(patch_name: str, versions: tuple[str, ...] = TESTED_KERAS_VERSIONS) -> None:
    """Fails loudly before a private-Keras patch is applied to a Keras release it was not tested on.

    Set `KERAS_MWMS_ALLOW_UNTESTED_KERAS=1` to try anyway (a warning says so).

    Example:

    >>> require_tested_keras("example", ANY_KERAS)   # a row that fits every release
    """
    if versions == ANY_KERAS:
        return
    import keras

    if keras.__version__ in versions:
        return
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(f"keras_mwms patch {patch_name!r} applied to untested Keras {keras.__version__}.",
                      stacklevel=3)
        return
    raise RuntimeError(
        f"keras_mwms patch {patch_name!r} patches private Keras internals and is tested only with "
        f"Keras {', '.join(versions)}; this is Keras {keras.__version__}. Install a tested Keras "
        f"(pip install keras=={versions[-1]}) or set {ALLOW_UNTESTED_ENV}=1 to try."
    )


@dataclass(frozen=True)
class Patch:
    """One private-Keras patch: where it goes, what replaces the original, and why.

    Example:

    >>> row = Patch(name="example", target="json:dumps", attribute=None,
    ...             replacement=lambda original: original, works_around="nothing")
    >>> row.location()
    'json:dumps'

    Args:
        name: a short unique name, used in errors and in ARCHITECTURE.md's table.
        target: `"module:Owner.attribute"` (or `"module:function"`), or the owner object itself
            when `attribute` is given.
        attribute: the attribute of an owner object given as `target`; None when `target` is a
            string naming the attribute last.
        replacement: `original -> replacement`; wrappers forward `*args, **kwargs`.
        works_around: the upstream issue or the Keras behaviour the patch corrects.
        keras_versions: the Keras releases the patch was tested on (`ANY_KERAS`: public API only).
        parameters: parameter names the original must accept (checked before patching).
    """

    name: str
    target: Any
    replacement: Callable[[Callable], Callable]
    works_around: str
    attribute: str | None = None
    keras_versions: tuple[str, ...] = TESTED_KERAS_VERSIONS
    parameters: tuple[str, ...] = ()

    def location(self) -> str:
        """`module:Owner.attribute`, as written in the table."""
        if isinstance(self.target, str):
            return self.target
        if isinstance(self.target, (type, types.ModuleType)):
            owner = getattr(self.target, "__qualname__", self.target.__name__)
            return f"{getattr(self.target, '__module__', self.target.__name__)}:{owner}.{self.attribute}"
        kind = type(self.target)
        return f"{kind.__module__}:{kind.__qualname__} instance.{self.attribute}"

    def resolve(self) -> tuple[Any, str]:
        """The owner object and attribute name this row patches (imports the module)."""
        if not isinstance(self.target, str):
            return self.target, self.attribute
        module_name, _, path = self.target.partition(":")
        if not path:
            raise ValueError(f"keras_mwms patch {self.name!r}: target {self.target!r} must read "
                             "'module:Owner.attribute' or 'module:function'.")
        owner: Any = importlib.import_module(module_name)
        *owners, attribute = path.split(".")
        for part in owners:
            owner = getattr(owner, part)
        return owner, attribute


def _check_signature(row: Patch, original: Callable) -> None:
    if not row.parameters:
        return
    try:
        accepted = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return
    missing = [name for name in row.parameters if name not in accepted]
    if missing:
        raise RuntimeError(
            f"keras_mwms patch {row.name!r} expects {row.location()} to accept "
            f"{', '.join(row.parameters)}, but this Keras release's version lacks "
            f"{', '.join(missing)}. This Keras changed an internal keras_mwms relies on; install a "
            f"tested Keras ({', '.join(TESTED_KERAS_VERSIONS)}) and report the release you use."
        )


class PatchTable:
    """A backend's patch rows, installed and uninstalled together (idempotent both ways).

    Example:

    >>> import types
    >>> holder = types.SimpleNamespace(value=lambda: 1)
    >>> table = PatchTable("example", [Patch("plus-one", holder, lambda f: lambda: f() + 1,
    ...                                      "an example", attribute="value", keras_versions=ANY_KERAS)])
    >>> table.install(); table.install(); holder.value()
    2
    >>> [row.name for row in table], table.installed
    (['plus-one'], True)
    >>> table.uninstall(); holder.value(), table.installed
    (1, False)
    """

    def __init__(self, name: str, rows: Iterable[Patch]):
        self.name = name
        self.rows = list(rows)
        names = [row.name for row in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(f"patch table {name!r} has duplicate row names: {names}")
        self._originals: list[tuple[Any, str, Any]] = []

    def __iter__(self) -> Iterator[Patch]:
        return iter(self.rows)

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> None:
        """Checks every row (release, target, signature), then applies them all."""
        if self.installed:
            return
        planned = []
        for row in self.rows:
            require_tested_keras(row.name, row.keras_versions)
            owner, attribute = row.resolve()
            raw = _raw_attribute(owner, attribute)
            if raw is _MISSING:
                raise RuntimeError(f"keras_mwms patch {row.name!r}: {row.location()} does not exist "
                                   "in this Keras release; install a tested Keras "
                                   f"({', '.join(TESTED_KERAS_VERSIONS)}).")
            original = getattr(owner, attribute)
            _check_signature(row, original)
            planned.append((row, owner, attribute, raw, original))
        for row, owner, attribute, raw, original in planned:
            replacement = row.replacement(original)
            if isinstance(raw, staticmethod):
                replacement = staticmethod(replacement)
            elif isinstance(raw, classmethod):
                replacement = classmethod(replacement)
            own = not isinstance(owner, type) or attribute in vars(owner)
            setattr(owner, attribute, replacement)
            self._originals.append((owner, attribute, raw if own else _INHERITED))

    def uninstall(self) -> None:
        """Restores every original, last patched first."""
        while self._originals:
            owner, attribute, raw = self._originals.pop()
            if raw is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, raw)

    def markdown(self) -> str:
        """The table as Markdown rows (name, target, works around, Keras releases)."""
        lines = ["| patch | target | works around | Keras |", "|---|---|---|---|"]
        lines += [f"| `{row.name}` | `{row.location()}` | {row.works_around} | "
                  f"{', '.join(row.keras_versions)} |" for row in self.rows]
        return "\n".join(lines)


_MISSING = object()
_INHERITED = object()   # the class only inherited the attribute: uninstall deletes the patch


def _raw_attribute(owner: Any, attribute: str) -> Any:
    """The attribute as stored (a staticmethod stays one), looked up along the MRO for classes."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attribute in vars(klass):
                return vars(klass)[attribute]
        return _MISSING
    return getattr(owner, attribute, _MISSING)


class ObjectState:
    """keras_mwms' per-object state for Keras objects, kept beside them, never set on them.

    Entries disappear with their object (weak references keyed by identity, so objects that
    define `__eq__` or are unhashable still work).

    Example:

    >>> class Model: pass
    >>> state, model = ObjectState(), Model()
    >>> state.of(model).synced = True
    >>> state.of(model).synced, state.get(Model(), "synced", False)
    (True, False)
    >>> del model; len(state)
    0
    """

    def __init__(self):
        self._table: dict[int, tuple[weakref.ref, types.SimpleNamespace]] = {}

    def of(self, obj: Any) -> types.SimpleNamespace:
        """The state namespace of `obj` (created empty on first use)."""
        key = id(obj)
        entry = self._table.get(key)
        if entry is not None and entry[0]() is obj:
            return entry[1]
        namespace = types.SimpleNamespace()
        reference = weakref.ref(obj, lambda _, key=key: self._table.pop(key, None))
        self._table[key] = (reference, namespace)
        return namespace

    def get(self, obj: Any, name: str, default: Any = None) -> Any:
        """`of(obj).name` if set, else `default` (without creating an entry)."""
        entry = self._table.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return default
        return getattr(entry[1], name, default)

    def __len__(self) -> int:
        return len(self._table)
