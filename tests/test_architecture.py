"""The layering holds: read from the source, without importing any backend.

- no import circle anywhere in the package (function-level imports count: they are circles
  that merely happen later);
- nothing under `keras_mwms/backends/` imports the facade (`keras_mwms.strategy`) or the
  package root back: the facade hands a backend what it needs, `keras_mwms.active` says who is
  active;
- backend adapters never import each other, only the neutral core;
- no class in `keras_mwms/backends/` is longer than 300 lines;
- no `_keras_mwms_*` attribute is set on Keras objects (per-object state lives in `ObjectState`);
- only the Keras firewall (`keras_mwms/backends/keras_api/`) names `keras.src`.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "keras_mwms"
ADAPTERS = ("tensorflow", "jax", "torch")
MAX_CLASS_LINES = 300


def module_files() -> dict[str, Path]:
    """Dotted module name → file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (absolute and relative)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                imported.add(submodule if submodule in modules else base)
    return {module for module in imported if module in modules and module != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def adapter_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "backends" and parts[2] in ADAPTERS:
        return parts[2]
    return None


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_backends_do_not_import_the_facade():
    offenders = {module: sorted(targets & {"keras_mwms", "keras_mwms.strategy"})
                 for module, targets in import_graph().items()
                 if module.startswith("keras_mwms.backends") and targets & {"keras_mwms", "keras_mwms.strategy"}}
    assert offenders == {}


def test_each_backend_is_one_subpackage_that_imports_no_other_backend():
    graph = import_graph()
    for adapter in ADAPTERS:
        assert f"keras_mwms.backends.{adapter}" in graph
        assert (PACKAGE / "backends" / adapter / "__init__.py").exists()
    crossings = [(module, target) for module, targets in graph.items() for target in targets
                 if adapter_of(module) and adapter_of(target) and adapter_of(module) != adapter_of(target)]
    assert crossings == []


def test_no_backend_class_over_300_lines():
    long_classes = []
    for path in (PACKAGE / "backends").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long_classes.append(f"{path.relative_to(PACKAGE)}:{node.name} ({lines} lines)")
    assert long_classes == []


def test_no_keras_mwms_attributes_set_on_keras_objects():
    setters = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "setattr", "__setattr__") and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and str(name.value).startswith("_keras_mwms"):
                    setters.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr.startswith(("_keras_mwms", "__keras_mwms")):
                        setters.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert setters == []


FIREWALL = PACKAGE / "backends" / "keras_api"


def test_only_the_keras_firewall_names_private_keras_modules():
    """`keras.src` (imports, patch targets, docstrings, comments) appears only in
    `keras_mwms/backends/keras_api/`: a Keras release that moves a private module changes
    the firewall alone, and its usability check sees every name."""
    offenders = [f"{path.relative_to(PACKAGE)}:{number}"
                 for path in PACKAGE.rglob("*.py") if FIREWALL not in path.parents
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if "keras.src" in line or "keras/src" in line]
    assert offenders == []
