"""The layering holds: read from the source, without importing any backend.

- no import circle anywhere in the package (function-level imports count: they are circles
  that merely happen later);
- nothing under `keras_mwms/backends/` imports the facade (`keras_mwms.strategy`) or the
  package root back: the facade hands a backend what it needs, `keras_mwms.active` says who is
  active;
- backend adapters never import each other, only the neutral core;
- the benchmark (`keras_mwms/benchmark/`) uses only the public API and the core, like a user:
  it never imports a backend adapter (`keras_mwms.backends.tensorflow|jax|torch`) or the Keras
  firewall (`keras_mwms.backends.keras_api`);
- no class in `keras_mwms/backends/` is longer than 300 lines;
- no `_keras_mwms_*` attribute is set on Keras objects (per-object state lives in `ObjectState`);
- every exception class derives from `keras_mwms.errors.KerasMwmsError`, is defined in
  `errors.py` and is listed in the base's docstring (a `SystemExit`, an exit rather than an
  error, is exempt);
- `KERAS_MWMS_*` environment variables are read in `keras_mwms/settings.py` only;
- library code says things through the "keras_mwms" logger (`keras_mwms.log`) or
  `warnings.warn`, never `print` or `sys.stdout/stderr.write`: those are for the programs
  (launcher, CLI, demo, benchmark), whose output is their job;
- only the Keras firewall (`keras_mwms/backends/keras_api/`) names `keras.src`;
- no function anywhere in the package is longer than 100 lines (nested ones included): a
  feature interaction gets a function of its own that can be tested alone;
- lost workers have one home: every backend subpackage has a `faults.py` with one `Faults`
  hook, and only the flow in `keras_mwms/backends/faults.py` reports a lost worker (the message
  and the bounded exit are the policy's, called from there alone).
- every backend subpackage has the same modules for the same concepts (`SHARED_BACKEND_MODULES`),
  so a change to one backend's step or patches has an obvious twin in the others;
- the package root stays readable at a glance: at most `MAX_ROOT_MODULES` modules besides
  `__init__.py`; a new concept goes into the subpackage of its layer (ARCHITECTURE.md).
- module-level state registers with `keras_mwms.active` (a strategy's `close()` resets it) or
  says why it lives as long as the process (`PROCESS_LIFETIME`).
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "keras_mwms"
ADAPTERS = ("tensorflow", "jax", "torch")
MAX_CLASS_LINES = 300
# The programs, whose output is their job, and the logger's default handler (stderr).
PRINTERS = ("keras_mwms.launch", "keras_mwms.cli", "keras_mwms.demo", "keras_mwms.benchmark", "keras_mwms.log")
MAX_FUNCTION_LINES = 100
LONG_FUNCTIONS_ALLOWED: set[str] = set()
# engine: the Backend subclass and its collective port; patches: patch_table(backend); data: how
# inputs reach this worker's step; step: the train step and its gradient all-reduce.
SHARED_BACKEND_MODULES = ("engine", "patches", "data", "step", "faults")
MAX_ROOT_MODULES = 13


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


def benchmark_reaches_into_adapters(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Benchmark module → the adapter or firewall modules it imports (none allowed)."""
    firewall = "keras_mwms.backends.keras_api"
    found = {module: sorted(target for target in targets
                            if adapter_of(target) or target == firewall or target.startswith(firewall + "."))
             for module, targets in graph.items() if module.startswith("keras_mwms.benchmark")}
    return {module: targets for module, targets in found.items() if targets}


def test_the_benchmark_uses_only_the_public_api_and_the_core():
    """What the benchmark needs from a backend it asks through the strategy or the core
    (`keras_mwms.backends.backend_class`, `PatchTable`), so it measures what a user can run."""
    assert benchmark_reaches_into_adapters(import_graph()) == {}


def test_the_benchmark_rule_finds_an_adapter_import():
    graph = {"keras_mwms.benchmark.peers": {"keras_mwms.backends.jax.patches", "keras_mwms.backends.base"},
             "keras_mwms.benchmark.fit": {"keras_mwms.backends.keras_api.targets"},
             "keras_mwms.benchmark.worker": {"keras_mwms.backends", "keras_mwms.diagnostics"},
             "keras_mwms.strategy": {"keras_mwms.backends.jax"}}
    assert benchmark_reaches_into_adapters(graph) == {
        "keras_mwms.benchmark.fit": ["keras_mwms.backends.keras_api.targets"],
        "keras_mwms.benchmark.peers": ["keras_mwms.backends.jax.patches"]}


def test_no_backend_class_over_300_lines():
    long_classes = []
    for path in (PACKAGE / "backends").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long_classes.append(f"{path.relative_to(PACKAGE)}:{node.name} ({lines} lines)")
    assert long_classes == []


def function_lengths(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Qualified name (`Class.method.inner`) → lines from `def` to its end, nested functions included."""
    lengths = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                lengths[name] = node.end_lineno - node.lineno + 1
            lengths.update(function_lengths(node, name + "."))
        else:
            lengths.update(function_lengths(node, prefix))
    return lengths


def test_no_function_over_100_lines():
    long_functions = {}
    for path in PACKAGE.rglob("*.py"):
        for name, lines in function_lengths(ast.parse(path.read_text())).items():
            if lines > MAX_FUNCTION_LINES:
                long_functions[f"{path.relative_to(PACKAGE).as_posix()}:{name}"] = lines
    assert {name: lines for name, lines in long_functions.items() if name not in LONG_FUNCTIONS_ALLOWED} == {}


def test_function_lengths_count_nested_functions_and_methods():
    source = "def outer():\n    def inner():\n        pass\n\n\nclass A:\n    def method(self):\n        if 1:\n" \
             "            def deep():\n                pass\n"
    assert function_lengths(ast.parse(source)) == {"outer": 3, "outer.inner": 2, "A.method": 4, "A.method.deep": 2}


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


def exception_classes(package: Path = PACKAGE) -> dict[str, tuple[str, list[str]]]:
    """Exception class name → (file, base names), found from the source by their bases."""
    classes: dict[str, tuple[str, list[str]]] = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in node.bases]
                classes[node.name] = (str(path.relative_to(package)), bases)
    builtin = {name for name, value in vars(builtins).items()
               if isinstance(value, type) and issubclass(value, BaseException)}
    exceptions: dict[str, tuple[str, list[str]]] = {}
    grew = True
    while grew:
        grew = False
        for name, (where, bases) in classes.items():
            if name not in exceptions and any(base in builtin or base in exceptions for base in bases):
                exceptions[name] = (where, bases)
                grew = True
    return exceptions


def ancestors(name: str, exceptions: dict[str, tuple[str, list[str]]]) -> set[str]:
    found: set[str] = set()
    for base in exceptions.get(name, ("", []))[1]:
        found |= {base} | ancestors(base, exceptions)
    return found


def test_every_exception_derives_from_the_one_base_in_errors_py():
    from keras_mwms.errors import KerasMwmsError

    exceptions = exception_classes()
    errors = {name: found for name, found in exceptions.items()
              if name != "KerasMwmsError" and "SystemExit" not in ancestors(name, exceptions)}
    assert len(errors) >= 10
    outside = [f"{where}:{name}" for name, (where, _) in errors.items()
               if "KerasMwmsError" not in ancestors(name, exceptions) or where != "errors.py"]
    assert outside == [], "derive every error from keras_mwms.errors.KerasMwmsError, in errors.py"
    unlisted = [name for name in errors if name not in KerasMwmsError.__doc__]
    assert unlisted == [], "list every subclass in KerasMwmsError's docstring"


ENVIRONMENT_NAME = re.compile(r"KERAS_MWMS_[A-Z0-9_]+")


def environment_constants(package: Path = PACKAGE) -> set[str]:
    """Names bound to a KERAS_MWMS_* variable's name: `X = "KERAS_MWMS_..."` or `X = settings.Y.name`."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and (_is_literal_name(node.value) or _is_setting_name(node.value)):
                names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _is_literal_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(ENVIRONMENT_NAME.fullmatch(node.value))


def _is_setting_name(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "settings")


def _names_a_variable(node: ast.AST, constants: set[str]) -> bool:
    return any(_is_literal_name(part) or _is_setting_name(part)
               or (isinstance(part, ast.Name) and part.id in constants)
               or (isinstance(part, ast.Attribute) and part.attr in constants) for part in ast.walk(node))


def environment_reads(package: Path = PACKAGE) -> list[str]:
    """Where a module other than settings.py reads a KERAS_MWMS_* variable itself.

    A read is a KERAS_MWMS_ name (a literal, a constant bound to one, or `settings.X.name`) as the
    key of `.get(...)`, `.pop(...)`, `.setdefault(...)`, `getenv(...)`, a subscript that loads, or an
    `in` test. Writing one for a child process is not a read: a subscript that stores, a dict
    display's key or a keyword argument (`env[settings.X.name] = ...`, `{NAME: value}`,
    `env.update(NAME=value)`).
    """
    constants = environment_constants(package)
    found = []
    for path in package.rglob("*.py"):
        if path == package / "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Call) and node.args and (
                    getattr(node.func, "attr", None) in ("get", "pop", "setdefault", "getenv")
                    or getattr(node.func, "id", None) == "getenv"):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = node.slice
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                key = node.left
            if key is not None and _names_a_variable(key, constants):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    return found


def test_keras_mwms_variables_are_read_in_settings_only():
    assert environment_reads() == [], "read KERAS_MWMS_* variables through keras_mwms.settings (Setting.read)"


def test_the_read_finder_finds_reads_and_lets_writes_pass(tmp_path):
    (tmp_path / "reads.py").write_text(
        "import os\nNAME = 'KERAS_MWMS_X'\n"
        "a = os.environ.get('KERAS_MWMS_Y')\nb = os.getenv(NAME)\nc = NAME in os.environ\n"
        "d = os.environ[settings.LEDGER.name]\n")
    (tmp_path / "writes.py").write_text(
        "import os\nenv = {'KERAS_MWMS_Z': '1'}\nenv[settings.LEDGER.name] = '0'\n"
        "os.environ['KERAS_MWMS_Y'] = '1'\nenv.update(KERAS_MWMS_W='2')\n")
    assert environment_reads(tmp_path) == ["reads.py:3", "reads.py:4", "reads.py:5", "reads.py:6"]
def may_print(module: str) -> bool:
    return any(module == printer or module.startswith(printer + ".") for printer in PRINTERS)


def test_library_code_does_not_print():
    printers = []
    for name, path in module_files().items():
        if may_print(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            function = node.func
            prints = isinstance(function, ast.Name) and function.id == "print"
            writes = (isinstance(function, ast.Attribute) and function.attr == "write"
                      and isinstance(function.value, ast.Attribute) and function.value.attr in ("stdout", "stderr")
                      and isinstance(function.value.value, ast.Name) and function.value.value.id == "sys")
            if prints or writes:
                printers.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert printers == [], "use the keras_mwms logger (keras_mwms.log.get_logger(__name__)) instead"


def test_print_finder_finds_a_print(tmp_path, monkeypatch):
    (tmp_path / "chatty.py").write_text("import sys\nprint('hi')\nsys.stderr.write('x')\n")
    monkeypatch.setattr(sys.modules[__name__], "module_files", lambda: {"keras_mwms.chatty": tmp_path / "chatty.py"})
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    try:
        test_library_code_does_not_print()
    except AssertionError as error:
        assert "chatty.py:2" in str(error) and "chatty.py:3" in str(error)
    else:
        raise AssertionError("the print was not found")
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


def _top_level(path: Path) -> tuple[set[str], set[str]]:
    """Names of the functions, and the bases of the classes, defined at the top of `path`."""
    tree = ast.parse(path.read_text())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    bases = {getattr(base, "attr", getattr(base, "id", "")) for node in tree.body
             if isinstance(node, ast.ClassDef) for base in node.bases}
    return functions, bases


def test_each_backend_names_its_patch_table_alike_and_supplies_one_fit_hooks():
    """`<backend>/patches.py:patch_table(backend)`; the fit-call policy is `fit_call`'s, each
    backend only subclasses `FitHooks` once."""
    for adapter in ADAPTERS:
        functions, _ = _top_level(PACKAGE / "backends" / adapter / "patches.py")
        assert "patch_table" in functions, adapter
        hooks = [path.name for path in (PACKAGE / "backends" / adapter).glob("*.py")
                 if "FitHooks" in _top_level(path)[1]]
        assert len(hooks) == 1, (adapter, hooks)


# Who may call each step of the lost-worker report: the flow in `backends/faults.py` calls the
# port's `worker_lost`, `base.Backend.worker_lost` the policy, the policy its message and exit.
LOST_WORKER_CALLERS = {
    "worker_lost": {"keras_mwms.backends.faults"},
    "raise_worker_lost": {"keras_mwms.backends.base"},
    "lost_worker_message": {"keras_mwms.backends.policy"},
    "start_exit_watchdog": {"keras_mwms.backends.policy", "keras_mwms.backends.faults"},
}


def lost_worker_calls(modules: dict[str, Path]) -> list[str]:
    """`path:line name` of every call of a lost-worker report step outside its one caller."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if called in LOST_WORKER_CALLERS and name not in LOST_WORKER_CALLERS[called]:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {called}")
    return found


def test_lost_workers_have_one_home_and_a_hook_per_backend():
    """`backends/faults.py` owns the lost-worker flow (the check-in round, the one message, the
    bounded exit); each backend's `faults.py` subclasses its `Faults` once, with the hook."""
    for adapter in ADAPTERS:
        path = PACKAGE / "backends" / adapter / "faults.py"
        assert path.exists(), f"backends/{adapter} has no faults.py"
        hooks = [node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)
                 and any(getattr(base, "id", "") == "Faults" for base in node.bases)]
        assert len(hooks) == 1, (adapter, hooks)
    assert lost_worker_calls(module_files()) == [], "a backend supplies a Faults hook; the flow reports"


def test_the_lost_worker_call_finder_finds_a_stray_report(tmp_path, monkeypatch):
    (tmp_path / "stray.py").write_text("backend.worker_lost('x', None, [1])\npolicy.start_exit_watchdog(3)\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    assert lost_worker_calls({"keras_mwms.backends.faults": tmp_path / "stray.py"}) == []
    assert lost_worker_calls({"keras_mwms.backends.jax.engine": tmp_path / "stray.py"}) == [
        "stray.py:1 worker_lost", "stray.py:2 start_exit_watchdog"]


def test_the_backend_subpackages_share_their_module_names():
    """The same concept has the same module name in every backend (`SHARED_BACKEND_MODULES`)."""
    missing = [f"backends/{adapter}/{name}.py" for adapter in ADAPTERS for name in SHARED_BACKEND_MODULES
               if not (PACKAGE / "backends" / adapter / f"{name}.py").exists()]
    assert missing == []


def test_at_most_a_few_modules_at_the_package_root():
    """Start-up, devices, resume, diagnostics, ... live in subpackages; the root holds the user
    surface, the registry, the core's few shared modules and the programs."""
    root = sorted(path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py")
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at keras_mwms/: {root}; move one into its layer's subpackage"


# Private names of Keras' trainers, optimizers, layers, variables and callbacks that
# keras_mwms does not use today: naming one outside the firewall fails like naming an owned one.
KNOWN_KERAS_PRIVATE_NAMES = (
    "_tracker", "_trainable_variables_indices", "_var_key", "_jit_compile", "_steps_per_execution",
    "_eval_epoch_iterator", "_compile_loss", "_compile_config", "_run_eagerly", "_layers",
    "_inbound_nodes", "_outbound_nodes", "_build_shapes_dict", "_seed_generators",
    "_non_trainable_variables", "_dtype_policy", "_auto_track_sub_layers", "_overwrite_with_gradient",
    "_model_variables_moving_average", "_learning_rate", "_loss_scale_factor", "_epoch_iterator",
    "_steps_seen", "_current_iterator", "_initialize_ddp", "_maybe_symbolic_build",
    "_backend_apply_gradients", "_parallel_update_step", "_moments", "_get_iterator", "_predict_epoch_iterator",
    "_make_function", "_loss_ids", "_post_build",
)


def _own_attributes(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, class-level names, `self.<name> = ...`."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for part in ast.walk(target):
                    if isinstance(part, ast.Name):
                        own.add(part.id)
                    elif isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) \
                            and part.value.id in ("self", "cls"):
                        own.add(part.attr)
    return own


def _package_modules_imported(tree: ast.AST) -> set[str]:
    """Local names bound to keras_mwms modules (`from keras_mwms.backends.tensorflow import
    patches`): `patches._maybe_symbolic_build` is keras_mwms' own function, not Keras'."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras_mwms"):
            bound.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            bound.update(alias.asname for alias in node.names if alias.name.startswith("keras_mwms") and alias.asname)
    return bound


def private_keras_names_used(names: set[str], package: Path = PACKAGE) -> list[str]:
    """`path:line .name` wherever a module outside the firewall names one of `names`: as an
    attribute (`optimizer._iterations`) or a string (`getattr(model, "_iterations")`, a keyword
    `kwargs["_use_cached_eval_dataset"]`). `self.<name>` of a name the module defines itself
    (its own attribute, which happens to share a Keras name) is not counted."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if FIREWALL in path.parents or path.parent.name == "keras_api":
            continue
        tree = ast.parse(path.read_text())
        own = _own_attributes(tree)
        our_modules = _package_modules_imported(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in names:
                on = node.value.id if isinstance(node.value, ast.Name) else None
                if not (on in ("self", "cls") and node.attr in own) and on not in our_modules:
                    found.append(f"{path.relative_to(package)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(package)}:{node.lineno} {node.value!r}")
    return found


def test_only_the_keras_firewall_names_private_keras_attributes():
    """Every private attribute of a Keras object (model, optimizer, layer, variable, data
    adapter, callback) that keras_mwms reads, calls or sets has a named accessor in
    `keras_mwms/backends/keras_api/` (`attributes.PRIVATE_NAMES` lists them), and only the
    firewall names them; so does a list of other Keras private names, lest one creep in."""
    from keras_mwms.backends.keras_api import attributes

    assert private_keras_names_used({*attributes.PRIVATE_NAMES, *KNOWN_KERAS_PRIVATE_NAMES}) == []


def test_private_attribute_finder_finds_one(tmp_path):
    (tmp_path / "sneaky.py").write_text(
        "class Own:\n    def __init__(self):\n        self._iterations = 0\n    def step(self):\n"
        "        return self._iterations\n"                    # its own attribute: fine
        "from keras_mwms import ours\n"
        "def peek(optimizer, kwargs):\n    optimizer._iterations += ours._iterations\n"
        "    return getattr(optimizer, '_momentums'), kwargs.get('_use_cached_eval_dataset')\n")
    found = private_keras_names_used({"_iterations", "_momentums", "_use_cached_eval_dataset"}, tmp_path)
    assert found == ["sneaky.py:8 ._iterations", "sneaky.py:9 '_momentums'", "sneaky.py:9 '_use_cached_eval_dataset'"]


# -- process-wide state: reset by close(), or living as long as the process for a reason --------

STATE_FACTORIES = {"dict", "list", "set", "local", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary",
                   "defaultdict", "deque", "Counter", "OrderedDict", "ObjectState"}
# Package classes whose module-level instances are declarations, fixed after import.
DECLARATIONS = {"Patch", "PatchTable", "Setting", "Target", "Anchor", "KerasHas"}
PROCESS_LIFETIME = {
    "keras_mwms.active._REGISTRY": "the registry of process state itself, filled at import",
    "keras_mwms.active._session": "the open strategy's session, which close() ends",
    "keras_mwms.settings.SETTINGS": "the KERAS_MWMS_* declarations, filled at import",
    "keras_mwms.backends.patches._warned": "the untested-Keras warning is said once per process",
    "keras_mwms.backends.policy._warned_idle": "the idle-replicas warning is said once per process",
    "keras_mwms.backends.torch.metrics._warned_custom_logs": "the custom-logs warning is said once per process",
    "keras_mwms.backends.torch.recompile_limit.WATCH": "a logging filter on TorchDynamo's logger, installed once per process; it warns once, and only inside a strategy's train step",
    "keras_mwms.backends.torch.recompile_limit._warned": "the recompile-limit warning is said once per process",
    "keras_mwms.backends.forked_children._installed": "os.register_at_fork has no unregister: the after-fork hook is registered once per process",
    "keras_mwms.launch._GIVEN": "ports this process handed out, kept 15 minutes so two gangs started at once never share one; a strategy's close() must not forget them",
    "keras_mwms.devices._assignments": "the GPU assignment, fixed once the process saw its GPUs",
    "keras_mwms.resume.resumable_inputs._stream_class": "a class made once, when Keras is first needed",
    "keras_mwms.backends.jax.sharded_step._TRACING": "a trace-time stack, pushed and popped around one sharded step's tracing",
    "keras_mwms.callbacks.worker_aware._twin_class": "a class made once per Keras callback class",
    "keras_mwms.backends.jax.patches._HOOKS": "a FitHooks, with no state of its own",
    "keras_mwms.backends.tensorflow.patches._HOOKS": "a FitHooks, with no state of its own",
    "keras_mwms.backends.torch.patches._HOOKS": "a FitHooks, with no state of its own",
}


def _called_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def module_state(tree: ast.Module, package_classes: set[str]) -> set[str]:
    """Names a module keeps that can change while the process runs: rebound by a `global`
    statement, bound to a container (an empty one, or one whose name is not a CONSTANT), to a
    weak or thread-local table, to an `ObjectState` or to an instance of a package class that
    is not a declaration, and functions with a cache."""
    found = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if any(_called_name(getattr(decorator, "func", decorator)) in ("cache", "lru_cache")
                   for decorator in node.decorator_list):
                found.add(node.name)
            continue
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for name in (target.id for target in targets if isinstance(target, ast.Name)):
            if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
                empty = not (getattr(value, "elts", None) or getattr(value, "keys", None)
                             or isinstance(value, (ast.ListComp, ast.DictComp, ast.SetComp)))
                if empty or not name.lstrip("_").isupper():
                    found.add(name)
            elif isinstance(value, ast.Call):
                called = _called_name(value.func)
                if called in STATE_FACTORIES or (called in package_classes and called not in DECLARATIONS):
                    found.add(name)
    return {name for name in found if not name.startswith("__")}


def registered_names(tree: ast.Module) -> set[str]:
    """The names a module registers with `keras_mwms.active.register(__name__, "name", ...)`."""
    return {node.args[1].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _called_name(node.func) == "register" and len(node.args) >= 2
            and getattr(node.args[0], "id", "") == "__name__" and isinstance(node.args[1], ast.Constant)}


def test_process_state_is_reset_by_close_or_says_why_it_lives_longer():
    """Every piece of module-level state registers with `keras_mwms.active` (a strategy's
    `close()` resets it whole; tests/test_user_scripts.py checks that it did) or is listed in
    `PROCESS_LIFETIME` with the reason it outlives a strategy."""
    trees = {module: ast.parse(path.read_text()) for module, path in module_files().items()}
    package_classes = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found, registered = set(), set()
    for module, tree in trees.items():
        found |= {f"{module}.{name}" for name in module_state(tree, package_classes)}
        registered |= {f"{module}.{name}" for name in registered_names(tree)}
    unexplained = sorted(found - registered - set(PROCESS_LIFETIME))
    assert unexplained == [], (
        f"module-level state {unexplained} is neither reset by a strategy's close() nor explained: "
        "register it next to its definition with keras_mwms.active.register(__name__, name, reset, "
        "state), or list it in PROCESS_LIFETIME with the reason it lives as long as the process.")
    assert sorted((registered | set(PROCESS_LIFETIME)) - found) == [], "stale: no such module-level state"


def test_the_state_finder_finds_state_and_lets_constants_pass():
    source = ("import threading\nCONSTANTS = {'a': 1}\n_cache = {}\n_seen = set()\n_local = threading.local()\n"
              "WIRE = WireBytes()\nROW = Patch('x')\n_flag = False\n"
              "def flip():\n    global _flag\n    _flag = True\n"
              "@functools.cache\ndef twin(klass):\n    return klass\n"
              "register(__name__, '_cache', _cache.clear, dict)\n")
    tree = ast.parse(source)
    assert module_state(tree, {"WireBytes", "Patch"}) == {"_cache", "_seen", "_local", "WIRE", "_flag", "twin"}
    assert registered_names(tree) == {"_cache"}


# `StepRows`' writers: only the torch step begins a step's rows, a fit's, or weighs the loss;
# the gradient all-reduce only reads it and takes the weight (`keras_mwms.backends.rows`).
STEP_ROWS_WRITERS = ("begin", "begin_fit", "weigh_loss")


def step_rows_writes(torch_package: Path) -> list[str]:
    """Where a torch module other than step.py writes this step's rows: calls `X.rows.begin*(`
    or `X.rows.weigh_loss(`, or assigns an attribute of `X.rows` (`backend.rows.local = 3`)."""
    found = []
    for path in sorted(torch_package.glob("*.py")):
        if path.name == "step.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            written = [target.value for target in targets if isinstance(target, ast.Attribute)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in STEP_ROWS_WRITERS:
                written.append(node.func.value)
            if any(isinstance(value, ast.Attribute) and value.attr == "rows" for value in written):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_torch_step_writes_this_steps_rows():
    assert step_rows_writes(PACKAGE / "backends" / "torch") == [], \
        "begin or weigh StepRows in backends/torch/step.py; elsewhere read it (take_loss_weight)"


def test_the_step_rows_finder_finds_writes(tmp_path):
    (tmp_path / "gradients.py").write_text(
        "backend.rows.local = 0\nbackend.rows.weigh_loss(False, sum)\nrows = backend.rows.local\n"
        "backend.rows.take_loss_weight()\n")
    (tmp_path / "step.py").write_text("backend.rows.begin(3)\n")
    assert step_rows_writes(tmp_path) == ["gradients.py:1", "gradients.py:2"]
