"""The supported releases: declared once, honoured by every patch row, pyproject, the README and docs/compatibility.md.

`keras_mwms.backends.patches` declares the range (`SUPPORTED_KERAS`, `SUPPORTED_BACKENDS`);
these tests hold everything else to it without any gang or ML framework at work (Keras and the
backends are stood in for by modules with another `__version__` where a release outside the
range is needed). The other releases are run by `scripts/version_smoke.py` (`make version-smoke`, part of
`make test`); the installed release's cell of its table runs here, in the shared warm gangs.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
import warnings
from pathlib import Path

import keras
import pytest

from keras_mwms.backends import patches
from keras_mwms.backends.keras_api import anchors, targets
from keras_mwms.backends.keras_api.anchors import Target
from keras_mwms.backends.patches import (
    ALLOW_UNTESTED_ENV,
    ANY_KERAS,
    SUPPORTED_BACKENDS,
    SUPPORTED_KERAS,
    TESTED_KERAS,
    KerasHas,
    Patch,
    PatchTable,
    release_series,
)
from tests.shared_gangs import PLAIN, SHARED, Runner, gang

REPO = Path(__file__).resolve().parent.parent


def _next(series: str) -> str:
    major, minor = series.split(".")
    return f"{major}.{int(minor) + 1}"


NEXT = _next(SUPPORTED_KERAS[-1])                         # the first Keras series not supported
RANGE = f"{SUPPORTED_KERAS[0]}–{SUPPORTED_KERAS[-1]}"


def all_tables() -> list[PatchTable]:
    """Every patch table keras_mwms installs (the TensorFlow one is built per joined backend)."""
    from keras_mwms.backends import callback_list, model_scope, resume
    from keras_mwms.backends.jax import patches as jax_patches
    from keras_mwms.backends.tensorflow import patches as tensorflow_patches
    from keras_mwms.backends.tensorflow.step import RowWeighting
    from keras_mwms.backends.torch import patches as torch_patches
    from keras_mwms.diagnostics.patches import PATCHES as diagnostics_table

    backend = types.SimpleNamespace(strategy=object(), row_weighting=RowWeighting(None))
    return [resume.PATCHES, model_scope.PATCHES, callback_list.PATCHES, diagnostics_table,
            *(module.patch_table(backend) for module in (tensorflow_patches, jax_patches, torch_patches))]


@pytest.fixture
def installed(monkeypatch):
    """`installed(keras="3.11.3", torch="2.9.1")`: those releases stand in for the real ones."""
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(patches, "_warned", set())

    def install(**versions: str) -> None:
        for package, version in versions.items():
            monkeypatch.setitem(sys.modules, package, types.SimpleNamespace(__version__=version))

    return install


def example_table(name: str = "example", **row_options) -> tuple[PatchTable, types.SimpleNamespace]:
    holder = types.SimpleNamespace(step=lambda: "keras")
    row = Patch("shout", holder, lambda original: lambda: original().upper(), "an example",
                attribute="step", **row_options)
    return PatchTable(name, [row]), holder


# -- every row declares the releases it serves --------------------------------------------------

def test_every_row_declares_supported_releases_and_private_keras_rows_name_them():
    for table in all_tables():
        for row in table:
            assert row.keras_versions, f"{table.name}:{row.name} declares no release"
            if row.keras_versions == ANY_KERAS:
                assert not isinstance(row.target, Target), (
                    f"{table.name}:{row.name} patches private Keras ({row.location()}) for any release")
                continue
            assert set(row.keras_versions) <= set(SUPPORTED_KERAS), (table.name, row.name, row.keras_versions)
            assert list(row.keras_versions) == sorted(row.keras_versions, key=SUPPORTED_KERAS.index)


def test_rows_sharing_a_target_serve_different_releases_or_features():
    for table in all_tables():
        seen: dict[str, list[Patch]] = {}
        for row in table:
            for other in seen.setdefault(row.location(), []):
                overlap = set(row.keras_versions) & set(other.keras_versions)
                assert not overlap or (row.applies is not None and other.applies is not None), (
                    f"{table.name}: {other.name} and {row.name} both patch {row.location()} on {overlap}")
            seen[row.location()].append(row)


def test_every_row_for_the_installed_keras_finds_its_target():
    for table in all_tables():
        for row in table:
            if isinstance(row.target, Target) and keras.backend.backend() not in row.target.needed_by:
                continue                                 # another backend's row: its anchor finds this one's
            if isinstance(row.target, (str, Target)) and row.serves_installed_keras():   # (not the stand-in strategy)
                owner, attribute = row.resolve()
                assert hasattr(owner, attribute), f"{row.name}: {row.location()} is missing"


def test_every_private_keras_row_names_a_firewall_target():
    declared = set(targets.ALL)
    for table in all_tables():
        for row in table:
            if isinstance(row.target, str):
                assert not row.target.startswith("keras"), f"{table.name}:{row.name} names Keras by a path"
            elif isinstance(row.target, Target):
                assert row.target in declared, f"{table.name}:{row.name}: {row.target} is not in keras_api.targets"


def test_the_patch_tables_read_the_same_on_every_keras_release():
    """Targets are written by anchor (`trainer.fit`), never by the class Keras gives them."""
    for table in all_tables():
        for line in table.markdown().splitlines()[2:]:
            assert "TensorFlowTrainer" not in line and "JAXTrainer" not in line and "TorchTrainer" not in line
    text = (REPO / "ARCHITECTURE.md").read_text()
    assert anchors.markdown() in text, "ARCHITECTURE.md lacks the anchors' table (keras_api.anchors.markdown())"


def test_the_patch_table_in_architecture_md_shows_every_rows_releases():
    text = (REPO / "ARCHITECTURE.md").read_text()
    for table in all_tables():
        for line in table.markdown().splitlines()[2:]:
            name, releases = line.split(" | ")[0].strip("| "), line.rsplit(" | ", 1)[1].rstrip(" |")
            row = next((row for row in text.splitlines() if row.startswith(f"| {name} |")), None)
            assert row is not None, f"ARCHITECTURE.md's patch table lacks {name}"
            assert row.rstrip().endswith(f"| {releases} |"), f"{name}: ARCHITECTURE.md says {row!r}"


# -- inside the range: silent; outside: a clear error, or one warning with the override ----------

@pytest.mark.parametrize("version", [f"{series}.{patch}" for series in SUPPORTED_KERAS for patch in (0, 9)])
def test_a_supported_keras_installs_without_a_word(installed, version):
    installed(keras=version)
    table, holder = example_table()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table.install()
    assert holder.step() == "KERAS"
    table.uninstall()


@pytest.mark.parametrize("version", ["3.11.3", f"{NEXT}.0", f"{NEXT}.0.dev2026120104", "4.0.0"])
def test_an_unsupported_keras_is_a_clear_error_naming_both_releases_and_the_override(installed, version):
    installed(keras=version)
    table, holder = example_table()
    with pytest.raises(RuntimeError) as error:
        table.install()
    message = str(error.value)
    assert f"Keras {version}" in message and RANGE in message and ALLOW_UNTESTED_ENV in message
    assert f"keras>={SUPPORTED_KERAS[0]},<{NEXT}" in message and TESTED_KERAS[-1] in message
    assert holder.step() == "keras" and not table.installed      # nothing was changed


def test_the_override_warns_once_per_process_whichever_tables_ask(installed, monkeypatch):
    installed(keras=f"{NEXT}.0.dev2026120104")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    tables = [example_table(name)[0] for name in ("model-scope", "tensorflow", "jax", "callbacks")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for table in tables:
            table.install()
    for table in tables:
        table.uninstall()
    said = [str(warning.message) for warning in caught if ALLOW_UNTESTED_ENV in str(warning.message)]
    assert len(said) == 1, said


def test_the_override_tries_an_unsupported_keras_with_one_warning(installed, monkeypatch):
    installed(keras=f"{NEXT}.0.dev2026120104")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    first, holder = example_table()
    with pytest.warns(UserWarning, match=re.escape(f"Keras {NEXT}.0.dev2026120104 (supported: {RANGE})")):
        first.install()
    assert holder.step() == "KERAS"
    second, _ = example_table()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second.install()                                 # said once per release, not per table
    second.uninstall()
    first.uninstall()


@pytest.mark.parametrize("backend,version,supported", [
    ("tensorflow", "2.16.1", "2.19–2.21"), ("jax", "0.8.3", "0.9–0.10"), ("torch", "2.9.1", "2.10–2.14")])
def test_a_backend_table_also_checks_the_backend_release(installed, backend, version, supported):
    installed(keras=TESTED_KERAS[-1], **{backend: version})
    table, _ = example_table(name=backend)
    with pytest.raises(RuntimeError, match=re.escape(f"{backend} {version} (supported: {supported})")):
        table.install()
    installed(**{backend: f"{SUPPORTED_BACKENDS[backend][-1]}.0"})
    table.install()
    table.uninstall()


def test_public_api_rows_check_no_release(installed):
    installed(keras="2.15.0")
    table, holder = example_table(keras_versions=ANY_KERAS)
    table.install()
    assert holder.step() == "KERAS"
    table.uninstall()


# -- a row per behaviour, picked by feature detection, else by the releases it serves -----------

def test_a_row_whose_feature_is_missing_is_skipped_not_an_error(installed):
    installed(keras="3.12.4")
    holder = types.SimpleNamespace(apply=lambda: "old")
    table = PatchTable("example", [
        Patch("new-internal", "keras_mwms.no_such_module:Thing.apply", lambda original: original,
              "an internal only newer releases have", applies=KerasHas("keras_mwms.no_such_module:Thing")),
        Patch("either", holder, lambda original: lambda: "patched", "present everywhere", attribute="apply",
              applies=KerasHas("keras_mwms.backends.patches:PatchTable.install")),
    ])
    table.install()
    assert holder.apply() == "patched"
    table.uninstall()
    assert "where `keras_mwms.no_such_module:Thing` exists" in table.markdown()


def test_a_row_serves_only_its_releases_and_the_newest_ones_are_tried_outside_the_range(installed, monkeypatch):
    table, holder = example_table(keras_versions=SUPPORTED_KERAS[-1:])
    installed(keras="3.13.2")
    table.install()
    assert holder.step() == "keras"                      # a newest-only row: nothing to patch on 3.13
    table.uninstall()
    installed(keras=f"{NEXT}.0")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning):
        table.install()
    assert holder.step() == "KERAS"
    table.uninstall()


def test_release_series():
    assert [release_series(v) for v in ("3.12.4", "2.13.0+cpu", "0.9.0.1", "2.21.0", "3.16.0rc1")] == [
        "3.12", "2.13", "0.9", "2.21", "3.16"]


def test_a_pre_release_counts_as_the_series_it_leads_to(installed):
    installed(keras=f"{SUPPORTED_KERAS[-1]}.0.dev2026102704")      # a nightly of a supported series
    table, holder = example_table()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table.install()
    assert holder.step() == "KERAS"
    table.uninstall()
    installed(keras=f"{_next(SUPPORTED_KERAS[-1])}.0.dev2026102704")   # the next series' nightly
    with pytest.raises(RuntimeError, match="Keras"):
        table.install()


# -- declared once: pyproject, constraints, README and docs agree with the table ---------------------

def test_pyproject_declares_the_same_range():
    text = (REPO / "pyproject.toml").read_text()
    requirements = dict(re.findall(r'^([\w-]+) = \["([^"]+)"', text, flags=re.MULTILINE))
    assert f'"keras>={SUPPORTED_KERAS[0]},<{_next(SUPPORTED_KERAS[-1])}"' in text
    for extra, module in [("tensorflow", "tensorflow"), ("tensorflow-cpu", "tensorflow"), ("jax", "jax"),
                          ("torch", "torch")]:
        series = SUPPORTED_BACKENDS[module]
        assert requirements[extra].endswith(f">={series[0]},<{_next(series[-1])}"), (extra, requirements[extra])


def test_the_pins_are_inside_the_range_and_the_readme_table_shows_every_tested_release():
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    # The suite runs on the newest final release; the newest series, while unreleased, on the
    # keras-nightly pin (the version smoke's `pinned-nightly` row).
    assert pins["keras"] == [release for release in TESTED_KERAS if ".dev" not in release][-1]
    if ".dev" in TESTED_KERAS[-1]:
        assert pins["keras-nightly"] == TESTED_KERAS[-1]
        assert re.search(r"^KERAS_SMOKE \?=.* pinned-nightly", (REPO / "Makefile").read_text(), re.MULTILINE)
    for distribution, module in [("tensorflow-cpu", "tensorflow"), ("jax", "jax"), ("torch", "torch")]:
        assert release_series(pins[distribution]) in SUPPORTED_BACKENDS[module], distribution
    page = (REPO / "docs" / "compatibility.md").read_text()
    for release in TESTED_KERAS:
        assert f"| {release} " in page, f"docs/compatibility.md's table lacks Keras {release}"
    readme = (REPO / "README.md").read_text()
    line = f"Keras {TESTED_KERAS[0].rsplit('.', 1)[0]} – {release_series(TESTED_KERAS[-1])}"
    assert line in readme, f"README's compatibility line does not say {line!r}"


# -- refused before the rendezvous, on a real Keras outside the range ----------------------------

REFUSED_RELEASE = "3.11.3"


def test_a_keras_outside_the_range_is_refused_before_the_rendezvous(tmp_path):
    """Worker 0 of a 2-worker TF_CONFIG, alone, on a real Keras 3.11.3 overlay: the strategy
    fails at once naming the release, with no wait for worker 1 at the rendezvous (whose
    timeout is 120 s here). Importing Keras and JAX comes first and is timed apart: it alone
    takes 2-25 s on a loaded 2-core machine."""
    import json
    import os
    import subprocess

    from keras_mwms.launch import find_free_ports

    overlay = REPO / "build" / "keras-overlays" / f"keras-{REFUSED_RELEASE}"
    if not (overlay / "keras").is_dir():
        installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                                    str(overlay), f"keras=={REFUSED_RELEASE}"], capture_output=True, timeout=120)
        if installed.returncode != 0:
            pytest.skip(f"keras=={REFUSED_RELEASE} cannot be installed here: {installed.stderr[-300:]!r}")
    ports = find_free_ports(2)
    tf_config = {"cluster": {"worker": [f"localhost:{port}" for port in ports]}, "task": {"type": "worker", "index": 0}}
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(REPO)]), "KERAS_BACKEND": "jax",
                   "TF_CONFIG": json.dumps(tf_config), "KERAS_MWMS_RENDEZVOUS_TIMEOUT": "120"}
    environment.pop(ALLOW_UNTESTED_ENV, None)
    script = ("import sys, time, keras, keras_mwms\n"
              "started = time.monotonic()\n"
              "try:\n    keras_mwms.MultiWorkerMirroredStrategy()\n"
              "finally:\n    print(f'constructor {time.monotonic() - started:.2f}', file=sys.stderr)\n")
    finished = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                              timeout=110, cwd=tmp_path)
    assert finished.returncode != 0
    assert "KerasVersionError" in finished.stderr and f"Keras {REFUSED_RELEASE}" in finished.stderr, finished.stderr[-2000:]
    assert ALLOW_UNTESTED_ENV in finished.stderr
    elapsed = float(re.search(r"constructor ([0-9.]+)", finished.stderr).group(1))
    assert elapsed < 10, f"refused {elapsed:.1f} s into MultiWorkerMirroredStrategy()"


def test_a_missing_private_name_is_refused_naming_it_and_the_release(monkeypatch):
    from keras_mwms.backends.keras_api import usability
    from keras_mwms.errors import KerasVersionError

    gone = Target(anchors.TRAINER, "no_such_method")
    monkeypatch.setattr(targets, "ALL", (*targets.ALL, gone))
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.raises(KerasVersionError) as error:
        usability.require_usable(keras.backend.backend())
    message = str(error.value)
    assert "trainer.no_such_method (class of keras.Model defining make_train_function)" in message
    assert f"Keras {keras.__version__}" in message and f"{ALLOW_UNTESTED_ENV}=1 cannot help" in message


# The installed release's cell of the compatibility table (`scripts/version_smoke.py`, which
# `make test` runs for the other releases): 2 workers and one process of plain Keras, each backend,
# in the suite's shared warm gangs, judged by the smoke's own checks.
for _backend in ("tensorflow", "jax", "torch"):
    SHARED.add(__name__, gang(_backend, 2), "installed_cell", "version_smoke", ["--out", "{out}"], seconds=60)
    SHARED.add(__name__, Runner(_backend, PLAIN), "installed_cell", "version_smoke",
               ["--out", "{out}", "--reference"], seconds=60)


def _version_smoke():
    spec = importlib.util.spec_from_file_location("version_smoke_script", REPO / "scripts" / "version_smoke.py")
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_the_installed_release_trains_like_one_process_of_plain_keras(backend, shared_runs):
    smoke = _version_smoke()
    cell = smoke.Cell(keras.__version__, backend)
    smoke.judge(cell, Path(shared_runs.folder(gang(backend, 2), __name__, "installed_cell")),
                Path(shared_runs.folder(Runner(backend, PLAIN), __name__, "installed_cell")))
    assert cell.ok, f"Keras {keras.__version__} on {backend}: {'; '.join(cell.problems)}"
    if backend == "torch":
        assert cell.collectives_per_step == smoke.TORCH_COLLECTIVES_PER_STEP
