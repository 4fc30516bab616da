"""The declarative table of private-Keras patches, and the one way to install and remove them.

Every change keras_mwms makes to Keras internals is a `Patch` row: its name, the target (a
`keras_mwms.backends.keras_api.targets` constant: an attribute below a private Keras class or
module found from a public one, so no private module path is written here), a factory that turns the original into the replacement, the
upstream issue or Keras behaviour it works around, the Keras releases it is written for and
the parameters the target must still accept. A backend's rows form a `PatchTable`; the
strategy installs it when the backend joins and `MultiWorkerMirroredStrategy.close()`
uninstalls it, restoring every original exactly.

The supported releases are declared once, here: `SUPPORTED_KERAS` (Keras minor releases,
each tested at its newest patch release) and `SUPPORTED_BACKENDS`; pyproject.toml and the
docs/compatibility.md say the same (`tests/test_versions.py` checks that they agree).
Every row declares the Keras releases it serves (`keras_versions`, the whole range unless a
release differs) and, where an internal differs between releases, a feature test (`applies`,
e.g. `KerasHas(target)`) picks the row that fits: one row per behaviour, selected by what
the installed Keras has rather than by its version string.

Before a row is applied the table checks, loudly and before anything is changed:

- the Keras release, and the backend's for a backend's table: inside the supported range
  nothing is said; outside it `install()` raises, naming the installed and supported releases
  and the override (`KERAS_MWMS_ALLOW_UNTESTED_KERAS=1`: try anyway, with one warning per
  process, with the rows written for the newest supported release). The strategy checks the
  same, and every private name, before the rendezvous (`keras_api.usability.require_usable`);
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
import re
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from keras_mwms import settings
from keras_mwms.backends.keras_api.anchors import Target
from keras_mwms.errors import KerasVersionError

SUPPORTED_KERAS = ("3.12", "3.13", "3.14", "3.15", "3.16")
"""The Keras minor releases keras_mwms supports; each was tested at its newest patch release
(3.16, not released yet, at the keras-nightly constraints.txt pins)."""
TESTED_KERAS = ("3.12.4", "3.13.2", "3.14.1", "3.15.1", "3.16.0.dev2026102704")
"""The releases the version smoke (`make version-smoke`) and the suite (3.15.1) run on."""
SUPPORTED_BACKENDS = {
    "tensorflow": ("2.19", "2.20", "2.21"),
    "jax": ("0.9", "0.10"),
    "torch": ("2.10", "2.11", "2.12", "2.13", "2.14"),
}
"""The backend minor releases keras_mwms supports, by module name."""
ANY_KERAS = ("*",)
ALLOW_UNTESTED_ENV = settings.ALLOW_UNTESTED_KERAS.name

# PEP 440: release numbers, then an optional pre-release (a, b, rc), post- and dev-release, local tag.
_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.\d+)*(?:[-_.]?(?:a|b|rc)\d*)?(?:[-_.]?post\d*)?"
                      r"(?:[-_.]?dev\d*)?(?:\+[\w.]+)?")
_warned: set[str] = set()


def release_series(version: str) -> str:
    """The minor release a version belongs to; a pre-release (dev, rc) belongs to the one it leads to.

    A keras-nightly `3.16.0.dev…` is a release candidate of Keras 3.16, so it counts as 3.16:
    refused while 3.16 is not supported, served by the 3.16 rows once it is. A version that is
    not PEP 440 stays a series of its own (never supported).

    Example:

    >>> release_series("3.14.1"), release_series("2.13.0+cpu"), release_series("0.9.0.1")
    ('3.14', '2.13', '0.9')
    >>> release_series("3.16.0.dev2026102704"), release_series("2.22.0rc0"), release_series("3.16.0rc1")
    ('3.16', '2.22', '3.16')
    >>> release_series("nightly")
    'nightly'
    """
    match = _RELEASE.fullmatch(version)
    return f"{match.group(1)}.{match.group(2)}" if match else version


def describe_releases(series: tuple[str, ...]) -> str:
    """`("3.12", "3.13", "3.14")` -> `"3.12–3.14"`; any other set is listed.

    Example:

    >>> describe_releases(SUPPORTED_KERAS), describe_releases(("3.15",)), describe_releases(ANY_KERAS)
    ('3.12–3.16', '3.15', 'any')
    """
    if series == ANY_KERAS:
        return "any"
    minors = [tuple(int(part) for part in name.split(".")) for name in series]
    consecutive = all(b == (a[0], a[1] + 1) for a, b in zip(minors, minors[1:]))
    if len(series) >= 2 and consecutive:
        return f"{series[0]}–{series[-1]}"
    return ", ".join(series)


def installed_version(package: str) -> str | None:
    """`package.__version__` if the module is already imported or importable, else None."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        return None
    return getattr(module, "__version__", None)


def unsupported_versions(backend: str | None = None) -> list[str]:
    """What is installed outside the supported range: `"Keras 3.17.0.dev… (supported: 3.12–3.16)"`.

    Checks Keras, and the backend module `backend` (`"tensorflow"`, `"jax"`, `"torch"`) if given.

    Example:

    >>> unsupported_versions()   # the installed Keras is a supported one
    []
    """
    found = []
    for package, series in [("keras", SUPPORTED_KERAS), *(
            [(backend, SUPPORTED_BACKENDS[backend])] if backend in SUPPORTED_BACKENDS else [])]:
        version = installed_version(package)
        if version is not None and release_series(version) not in series:
            label = "Keras" if package == "keras" else package
            found.append(f"{label} {version} (supported: {describe_releases(series)})")
    return found


def require_supported_versions(backend: str | None = None) -> None:
    """Fails loudly before a private-Keras patch is applied outside the supported releases.

    Inside the range it says nothing. Set `KERAS_MWMS_ALLOW_UNTESTED_KERAS=1` to try other
    releases anyway (one warning per release and process says so, whichever table asks first).

    Example:

    >>> require_supported_versions()   # the installed Keras is supported: silent
    """
    outside = unsupported_versions(backend)
    if not outside:
        return
    if settings.ALLOW_UNTESTED_KERAS.read():
        new = [text for text in outside if text not in _warned]
        _warned.update(new)
        if new:
            warnings.warn(f"keras_mwms patches private Keras internals; it is trying "
                          f"{'; '.join(new)} because {ALLOW_UNTESTED_ENV}=1.", stacklevel=3)
        return
    raise KerasVersionError(
        f"keras_mwms patches private Keras internals and supports Keras "
        f"{describe_releases(SUPPORTED_KERAS)} (tested: {', '.join(TESTED_KERAS)}) with TensorFlow "
        f"{describe_releases(SUPPORTED_BACKENDS['tensorflow'])}, JAX "
        f"{describe_releases(SUPPORTED_BACKENDS['jax'])} or torch "
        f"{describe_releases(SUPPORTED_BACKENDS['torch'])}; installed: {'; '.join(outside)}. "
        f"Install a supported release (pip install 'keras>={SUPPORTED_KERAS[0]},"
        f"<{next_minor(SUPPORTED_KERAS[-1])}') or set {ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


def next_minor(series: str) -> str:
    """`"3.15"` -> `"3.16"`: the first release outside a range ending at `series`."""
    major, minor = series.split(".")
    return f"{major}.{int(minor) + 1}"


def serves_installed_keras(keras_versions: tuple[str, ...]) -> bool:
    """Whether a row declared for `keras_versions` is meant for the installed Keras.

    Outside the supported range (only reached with the override) the rows written for the
    newest supported release are tried.

    Example:

    >>> serves_installed_keras(ANY_KERAS), serves_installed_keras(SUPPORTED_KERAS)
    (True, True)
    """
    if keras_versions == ANY_KERAS:
        return True
    import keras

    series = release_series(keras.__version__)
    if series not in SUPPORTED_KERAS:
        series = SUPPORTED_KERAS[-1]
    return series in keras_versions


class KerasHas:
    """A feature test for `Patch.applies`: does this Keras have the target (a `keras_api`
    `Target`, or `"module:Owner.attribute"` for other libraries)?

    Example:

    >>> from keras_mwms.backends.keras_api import targets
    >>> KerasHas(targets.EPOCH_ITERATOR_ENUMERATE)(), str(KerasHas(targets.TRAINER_FIT))
    (True, '`trainer.fit` exists')
    >>> KerasHas("json:no_such_function")(), str(KerasHas("json:dumps"))
    (False, '`json:dumps` exists')
    """

    def __init__(self, target: Target | str):
        self.target = target

    def __call__(self) -> bool:
        if isinstance(self.target, Target):
            return self.target.exists()
        module_name, _, path = self.target.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            return False
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                return False
        return True

    def __str__(self) -> str:
        return f"`{self.target}` exists"


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
        target: a `keras_api` `Target` (private Keras), `"module:Owner.attribute"` (or
            `"module:function"`, other libraries), or the owner object itself when `attribute`
            is given.
        attribute: the attribute of an owner object given as `target`; None when `target` is a
            `Target` or a string naming the attribute last.
        replacement: `original -> replacement`; wrappers forward `*args, **kwargs`.
        works_around: the upstream issue or the Keras behaviour the patch corrects.
        keras_versions: the Keras minor releases the row serves (default: all of
            `SUPPORTED_KERAS`; `ANY_KERAS`: public API only).
        parameters: parameter names the original must accept (checked before patching).
        applies: a feature test (e.g. `KerasHas("module:Owner")`) for an internal that differs
            between releases: the row is applied only where it returns True, so each behaviour
            has its own row. None: always (a missing target is then an error).
    """

    name: str
    target: Any
    replacement: Callable[[Callable], Callable]
    works_around: str
    attribute: str | None = None
    keras_versions: tuple[str, ...] = SUPPORTED_KERAS
    parameters: tuple[str, ...] = ()
    applies: Callable[[], bool] | None = None

    def serves_installed_keras(self) -> bool:
        """Whether this row is for the installed Keras: its releases, then its feature test."""
        return serves_installed_keras(self.keras_versions) and (self.applies is None or self.applies())

    def location(self) -> str:
        """`anchor.attribute` for a Keras target, else `module:Owner.attribute`, as written in
        the table (the same text on every Keras release)."""
        if isinstance(self.target, (str, Target)):
            return str(self.target)
        if isinstance(self.target, (type, types.ModuleType)):
            owner = getattr(self.target, "__qualname__", self.target.__name__)
            return f"{getattr(self.target, '__module__', self.target.__name__)}:{owner}.{self.attribute}"
        kind = type(self.target)
        return f"{kind.__module__}:{kind.__qualname__} instance.{self.attribute}"

    def resolve(self) -> tuple[Any, str]:
        """The owner object and attribute name this row patches (imports the module)."""
        if isinstance(self.target, Target):
            return self.target.resolve()
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
            f"tested Keras ({', '.join(TESTED_KERAS)}) and report the release you use."
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
    >>> table.install(); holder.value(), table.original("plus-one")()
    (2, 1)
    """

    def __init__(self, name: str, rows: Iterable[Patch]):
        self.name = name
        self.rows = list(rows)
        names = [row.name for row in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(f"patch table {name!r} has duplicate row names: {names}")
        self._originals: list[tuple[Any, str, Any]] = []
        self._replaced: dict[str, Any] = {}

    def __iter__(self) -> Iterator[Patch]:
        return iter(self.rows)

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> None:
        """Checks the releases, then every row that serves this Keras (target, signature),
        then applies them all."""
        if self.installed:
            return
        if any(row.keras_versions != ANY_KERAS for row in self.rows):
            require_supported_versions(self.name)
        planned = [(row, *_plan(row)) for row in self.rows if row.serves_installed_keras()]
        for row, owner, attribute, raw, original in planned:
            replacement = row.replacement(original)
            if isinstance(raw, staticmethod):
                replacement = staticmethod(replacement)
            elif isinstance(raw, classmethod):
                replacement = classmethod(replacement)
            own = not isinstance(owner, type) or attribute in vars(owner)
            setattr(owner, attribute, replacement)
            self._originals.append((owner, attribute, raw if own else _INHERITED))
            self._replaced[row.name] = original

    def check(self) -> list[str]:
        """Why rows that serve the installed Keras could not be applied (target, signature), one
        message per row, without changing anything; the releases are not checked. For trying a
        new Keras: `install()` stops at the first problem, this lists them all.

        Example:

        >>> PatchTable("example", [Patch("gone", "json:no_such_function", lambda f: f, "an example",
        ...                              keras_versions=ANY_KERAS)]).check()  # doctest: +ELLIPSIS
        ["keras_mwms patch 'gone': json:no_such_function does not exist in this Keras release..."]
        """
        problems = []
        for row in self.rows:
            try:
                if row.serves_installed_keras():
                    _plan(row)
            except RuntimeError as error:
                problems.append(str(error))
        return problems

    def original(self, name: str) -> Any:
        """What row `name` replaces, also while the table is installed: Keras' own attribute,
        for timing Keras unpatched beside keras_mwms (the benchmark's native peers)."""
        if name in self._replaced:
            return self._replaced[name]
        for row in self.rows:
            if row.name == name:
                return getattr(*row.resolve())
        raise ValueError(f"patch table {self.name!r} has no row {name!r}; its rows: "
                         f"{', '.join(row.name for row in self.rows)} (ARCHITECTURE.md lists them).")

    def originals(self) -> list[tuple[Any, str, Any]]:
        """What `uninstall()` puts back, in install order: `(owner, attribute, original)` with the
        original as stored, or None where the owner only inherited it (the patch is then deleted).

        Example:

        >>> import types
        >>> holder = types.SimpleNamespace(value=int)
        >>> table = PatchTable("example", [Patch("zero", holder, lambda f: lambda: 0, "an example",
        ...                                      attribute="value", keras_versions=ANY_KERAS)])
        >>> table.install(); table.originals() == [(holder, "value", int)]
        True
        >>> table.uninstall(); table.originals()
        []
        """
        return [(owner, attribute, None if raw is _INHERITED else raw)
                for owner, attribute, raw in self._originals]

    def uninstall(self) -> None:
        """Restores every original, last patched first."""
        self._replaced.clear()
        while self._originals:
            owner, attribute, raw = self._originals.pop()
            if raw is _INHERITED:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, raw)

    def markdown(self) -> str:
        """The table as Markdown rows (name, target, works around, Keras releases served)."""
        lines = ["| patch | target | works around | Keras |", "|---|---|---|---|"]
        lines += [f"| `{row.name}` | `{row.location()}` | {row.works_around} | "
                  f"{describe_releases(row.keras_versions)}"
                  f"{'' if row.applies is None else f', where {row.applies}'} |" for row in self.rows]
        return "\n".join(lines)


def _plan(row: Patch) -> tuple[Any, str, Any, Any]:
    """The owner, attribute, raw and bound original a row patches; RuntimeError if it cannot."""
    try:
        owner, attribute = row.resolve()
        raw = _raw_attribute(owner, attribute)
    except (ImportError, AttributeError):
        raw = _MISSING
    if raw is _MISSING:
        where = f"{row.location()} ({row.target.anchor.found_as})" if isinstance(row.target, Target) else row.location()
        raise RuntimeError(f"keras_mwms patch {row.name!r}: {where} does not exist in this "
                           f"Keras release ({installed_version('keras')}); install a tested Keras "
                           f"({', '.join(TESTED_KERAS)}).")
    original = getattr(owner, attribute)
    _check_signature(row, original)
    return owner, attribute, raw, original


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
    >>> state.of(Model).tagged = True; [vars(n) for n in state.namespaces()]
    [{'tagged': True}]
    >>> state.clear(); len(state)
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

    def namespaces(self) -> list[types.SimpleNamespace]:
        """The state of every object still alive."""
        return [namespace for reference, namespace in list(self._table.values()) if reference() is not None]

    def clear(self) -> None:
        """Forgets every object's state (a strategy's `close()`)."""
        self._table.clear()

    def __len__(self) -> int:
        return len(self._table)
