"""The version smoke: keras_mwms on other Keras releases, each overlaid on the same environment.

Keras is pure Python, so another release is one `pip install --no-deps --target
build/keras-overlays/keras-<version> keras==<version>` put first on the workers' PYTHONPATH;
TensorFlow, JAX and torch stay as installed. For each release and each backend one gang of
real processes — 2 workers and one process of plain Keras, started together on free ports —
trains `tests/workers/version_smoke.py` (SGD, then Adam, 2 epochs each) and must end with:

* the 2 workers bit-identical, and within 1e-5 of the one process (max |Δw| after SGD and
  after Adam, and the loss of a final `evaluate`);
* on torch, one all-reduce per training step and no other collective (counted by torch's
  profiler, whoever issues it: from Keras 3.16 on Keras has its own torch distribution, which
  keras_mwms must switch off rather than double);
* the Keras release asked for (the overlay took effect) and, inside the supported range, no
  warning about an untested release;

and on one backend (`--resume-backend`) a worker SIGKILLed mid-epoch, restarted by the launcher
(`--max-restarts 1`) and resumed by `BackupAndRestore` must end with the one process's
weights. Prints the compatibility table; exits 1 if a cell failed (unless `--report-only`).

    python scripts/version_smoke.py 3.12.4 3.13.2 3.14.1      # CI: `make version-smoke`
    python scripts/version_smoke.py nightly --callbacks --report-only   # `make keras-nightly`

`nightly` installs the newest `keras-nightly` the index serves (outside the supported range:
run with `KERAS_MWMS_ALLOW_UNTESTED_KERAS=1`); `installed` uses the environment's own Keras
(the suite runs that cell in its shared gangs, `tests/test_versions.py`, so `make test`
leaves it out);
`--callbacks` also runs `tests/test_callbacks.py` against the release.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from keras_mwms.launch import find_free_ports  # noqa: E402
from tests.multiworker import Spawn, python_worker, run_launcher, run_processes  # noqa: E402
from tests.workers.common import load_result, load_weights, max_weight_difference  # noqa: E402

OVERLAYS = REPO / "build" / "keras-overlays"
BACKENDS = ("tensorflow", "jax", "torch")
TOLERANCE = 1e-5
GANG_TIMEOUT = 300
UNTESTED_WARNING = "KERAS_MWMS_ALLOW_UNTESTED_KERAS=1"
# The smoke model's gradient is one bucket: one all-reduce per step carries it and the metrics.
TORCH_COLLECTIVES_PER_STEP = {"c10d::allreduce_": 1.0}


@dataclass
class Cell:
    """One release on one backend: the equivalence result, and the resume result if run."""

    keras: str
    backend: str
    ok: bool = False
    workers_delta: float | None = None
    reference_delta: float | None = None
    adam_delta: float | None = None
    collectives_per_step: dict[str, float] | None = None
    resume_delta: float | None = None
    resume_ok: bool | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    broken_rows: list[str] = field(default_factory=list)

    def verdict(self) -> str:
        if self.ok:
            return f"✅ {self.reference_delta:.1g}" if self.reference_delta else "✅ 0"
        return "❌ " + "; ".join(self.problems)[:300]


def install_overlay(release: str) -> tuple[Path | None, str]:
    """The overlay directory for `release` (installed if missing) and the Keras version in it."""
    if release == "installed":
        return None, _version_in(None)
    if release == "pinned-nightly":
        release = pinned_nightly()
    if release == "nightly":
        target = OVERLAYS / "keras-nightly"
        shutil.rmtree(target, ignore_errors=True)
        requirement = ["--pre", "keras-nightly"]
    elif ".dev" in release:
        target = OVERLAYS / f"keras-nightly-{release}"
        requirement = [f"keras-nightly=={release}"]
    else:
        target = OVERLAYS / f"keras-{release}"
        requirement = [f"keras=={release}"]
    if not (target / "keras").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                        str(target), *requirement], check=True)
    return target, _version_in(target)


def pinned_nightly() -> str:
    """The keras-nightly release constraints.txt pins (`keras-nightly==3.16.0.dev…`): CI's nightly row.

    Example:

    >>> ".dev" in pinned_nightly()
    True
    """
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.startswith("keras-nightly=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit("constraints.txt pins no keras-nightly (a line `keras-nightly==3.16.0.dev…`).")


def _version_in(overlay: Path | None) -> str:
    # Keras' numpy backend: the version without importing TensorFlow (Keras' default backend).
    code = "import keras; print(keras.__version__)"
    return subprocess.run([sys.executable, "-c", code], env=_environment(overlay, "numpy"), check=True,
                          capture_output=True, text=True).stdout.strip()


def _environment(overlay: Path | None, backend: str | None) -> dict[str, str]:
    paths = [str(overlay)] if overlay else []
    environment = {"PYTHONPATH": os.pathsep.join([*paths, str(REPO)]), "OMP_NUM_THREADS": "1",
                   "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_MWMS_RENDEZVOUS_TIMEOUT": "60"}
    if backend:
        environment["KERAS_BACKEND"] = backend
    return {**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, **environment}


def _tf_config(ports: list[int], index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"localhost:{port}" for port in ports]},
                       "task": {"type": "worker", "index": index}})


def equivalence(cell: Cell, overlay: Path | None, out: Path, in_range: bool) -> None:
    """2 workers and one plain-Keras process, started together; fills the cell."""
    environment = _environment(overlay, cell.backend)
    ports = find_free_ports(2)
    script = python_worker("version_smoke.py")
    spawns = [Spawn([*script, "--out", str(out / "workers")],
                    {**environment, "TF_CONFIG": _tf_config(ports, index)}) for index in range(2)]
    spawns.append(Spawn([*script, "--out", str(out / "reference"), "--reference"], environment))
    started = time.monotonic()
    try:
        result = run_processes(spawns, timeout=GANG_TIMEOUT, grace_after_failure=20)
    except AssertionError as error:
        cell.problems.append(f"timed out: {_last_error(str(error))}")
        return
    finally:
        cell.seconds = time.monotonic() - started
    for index, code in enumerate(result.codes):
        if code != 0:
            role = "one process" if index == 2 else f"worker {index}"
            cell.problems.append(f"{role} exit {code}: {_last_error(result.outputs[index])}")
    if cell.problems:
        return
    if in_range and any(UNTESTED_WARNING in output for output in result.outputs):
        cell.problems.append("warned about an untested release inside the supported range")
    judge(cell, out / "workers", out / "reference")


def judge(cell: Cell, workers: Path, reference: Path) -> None:
    """Fills `cell` from the results of 2 workers (`workers`) and one process (`reference`) of
    `tests/workers/version_smoke.py`; `cell.ok` when every check passes (the suite judges the
    installed release's cell, run in its shared gangs, the same way: `tests/test_versions.py`)."""
    versions = {load_result(workers, 0)["keras"], load_result(reference, 0)["keras"]}
    if versions != {cell.keras}:
        cell.problems.append(f"ran Keras {sorted(versions)}, not the overlay's {cell.keras}")
    one_process = load_weights(reference, 0)
    cell.workers_delta = max_weight_difference(load_weights(workers, 0), load_weights(workers, 1))
    cell.reference_delta = max_weight_difference(load_weights(workers, 0), one_process)
    if cell.workers_delta != 0.0:
        cell.problems.append(f"workers differ by {cell.workers_delta:.3g}")
    if not cell.reference_delta <= TOLERANCE:
        cell.problems.append(f"{cell.reference_delta:.3g} from one process (> {TOLERANCE:g})")
    adam = [load_weights(workers / "adam", index) for index in range(2)]
    cell.adam_delta = max_weight_difference(adam[0], load_weights(reference / "adam", 0))
    if max_weight_difference(adam[0], adam[1]) != 0.0:
        cell.problems.append("Adam: workers differ")
    if not cell.adam_delta <= TOLERANCE:
        cell.problems.append(f"Adam: {cell.adam_delta:.3g} from one process (> {TOLERANCE:g})")
    if cell.backend == "torch":
        cell.collectives_per_step = load_result(workers, 0)["collectives_per_step"]
        for index in range(2):
            counted = load_result(workers, index)["collectives_per_step"]
            if counted != TORCH_COLLECTIVES_PER_STEP:
                cell.problems.append(f"worker {index} issued {counted} collectives per step, not "
                                     f"{TORCH_COLLECTIVES_PER_STEP} (doubled by Keras' own distribution?)")
    losses = [load_result(workers, 0)["evaluate_loss"], load_result(reference, 0)["evaluate_loss"]]
    if not abs(losses[0] - losses[1]) <= TOLERANCE * max(1.0, abs(losses[1])):
        cell.problems.append(f"evaluate loss {losses[0]:.8g} vs one process {losses[1]:.8g}")
    cell.ok = not cell.problems


def resume(cell: Cell, overlay: Path | None, out: Path) -> None:
    """Worker 1 killed after step 11 (backups every 4 steps), the gang restarted once."""
    environment = _environment(overlay, cell.backend)
    result = run_launcher(
        ["--workers", "2", "--max-restarts", "1", "--grace-period", "3"],
        [str(REPO / "tests" / "workers" / "version_smoke.py"), "--out", str(out / "resume"),
         "--backup", str(out / "backup"), "--kill-at-step", "11"],
        timeout=GANG_TIMEOUT, env=environment, preload=False)   # the overlay: every worker fresh
    cell.resume_ok = False
    if result.returncode != 0:
        cell.problems.append(f"resume: launcher exit {result.returncode}: "
                             f"{_last_error(result.output + result.launcher_log)}")
    elif "restarting the gang" not in result.launcher_log:
        cell.problems.append("resume: the gang was never restarted (no kill?)")
    else:
        weights = load_weights(out / "resume", 0)
        cell.resume_delta = max_weight_difference(weights, load_weights(out / "reference", 0))
        if max_weight_difference(weights, load_weights(out / "resume", 1)) != 0.0:
            cell.problems.append("resume: workers differ")
        elif not cell.resume_delta <= TOLERANCE:
            cell.problems.append(f"resume: {cell.resume_delta:.3g} from one process")
        else:
            cell.resume_ok = True
    cell.ok = cell.ok and cell.resume_ok


def broken_rows(overlay: Path | None, backend: str) -> list[str]:
    """The patch rows this release breaks on `backend` (`tests/workers/version_smoke_rows.py`)."""
    process = subprocess.run(python_worker("version_smoke_rows.py"), env=_environment(overlay, backend),
                             capture_output=True, text=True, timeout=GANG_TIMEOUT)
    rows = [line[4:] for line in process.stdout.splitlines() if line.startswith("ROW ")]
    if process.returncode != 0:
        rows.append(f"(listing the rows failed: {_last_error(process.stdout + process.stderr)})")
    return rows


def _last_error(output: str) -> str:
    """The last line that names an error, else the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(Error|Exception|error:)", line)]
    return (errors or lines or ["(no output)"])[-1][-240:]


def callback_tests(overlay: Path | None) -> tuple[int, str]:
    """`pytest tests/test_callbacks.py` with the overlay first on every worker's PYTHONPATH."""
    environment = _environment(overlay, None)
    process = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/test_callbacks.py"], cwd=REPO, env=environment,
                             capture_output=True, text=True)
    lines = process.stdout.splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)),
                   "(no summary)")
    return process.returncode, "\n".join([*failed[:12], *(["..."] if len(failed) > 12 else []), summary])


def in_supported_range(version: str) -> bool:
    from keras_mwms.backends.patches import SUPPORTED_KERAS, release_series

    return release_series(version) in SUPPORTED_KERAS


def backend_versions() -> str:
    """`tensorflow 2.21.0, jax 0.10.2, torch 2.13.0` from the installed distributions."""
    found = []
    for module, distributions in [("tensorflow", ("tensorflow", "tensorflow-cpu")), ("jax", ("jax",)),
                                  ("torch", ("torch",))]:
        for distribution in distributions:
            try:
                found.append(f"{module} {importlib.metadata.version(distribution)}")
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return ", ".join(found)


def print_table(cells: list[Cell], resume_backend: str) -> None:
    print("\nkeras_mwms compatibility (2 workers vs one process of plain Keras, SGD and Adam, 2 epochs; "
          "✅ = workers bit-identical, max |Δw| after SGD vs one process shown):")
    print(f"backends as installed: {backend_versions()}; BackupAndRestore kill/resume on {resume_backend}")
    by_release: dict[str, dict[str, Cell]] = {}
    for cell in cells:
        by_release.setdefault(cell.keras, {})[cell.backend] = cell
    header = f"| Keras | {' | '.join(BACKENDS)} | resume ({resume_backend}) | seconds |"
    print(header)
    print("|---" * (len(BACKENDS) + 3) + "|")
    for keras_version, row in by_release.items():
        resumed = row.get(resume_backend)
        resume_text = ("-" if resumed is None or resumed.resume_ok is None else
                       f"✅ {resumed.resume_delta:.1g}" if resumed.resume_ok else "❌")
        seconds = sum(cell.seconds for cell in row.values())
        print(f"| {keras_version} | {' | '.join(row[b].verdict() if b in row else '-' for b in BACKENDS)}"
              f" | {resume_text} | {seconds:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="+", help="Keras versions, 'installed' or 'nightly'")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--resume-backend", default="torch", choices=[*BACKENDS, "none"])
    parser.add_argument("--callbacks", action="store_true", help="also run tests/test_callbacks.py")
    parser.add_argument("--report-only", action="store_true", help="exit 0 whatever failed")
    arguments = parser.parse_args(argv)
    started = time.monotonic()
    cells: list[Cell] = []
    callback_results: list[tuple[str, int, str]] = []
    with tempfile.TemporaryDirectory(prefix="keras-mwms-version-smoke-") as scratch:
        for release in arguments.releases:
            overlay, version = install_overlay(release)
            in_range = in_supported_range(version)
            print(f"== Keras {version} ({'overlay ' + str(overlay) if overlay else 'installed'})"
                  f"{'' if in_range else ', outside the supported range'}", flush=True)
            for backend in arguments.backends:
                cell = Cell(version, backend)
                out = Path(scratch) / f"{version}-{backend}"
                equivalence(cell, overlay, out, in_range)
                if backend == arguments.resume_backend and cell.ok:
                    resume(cell, overlay, out)
                if not cell.ok:
                    cell.broken_rows = broken_rows(overlay, backend)
                cells.append(cell)
                print(f"   {backend:<10} {cell.verdict()}"
                      f"{'' if cell.adam_delta is None else f', Adam {cell.adam_delta:.1g}'}"
                      f"{'' if cell.resume_ok is None else f', resume ✅ {cell.resume_delta:.1g}' if cell.resume_ok else ''}"
                      f"{'' if cell.collectives_per_step is None else f', per step {cell.collectives_per_step}'}"
                      f"  ({cell.seconds:.0f} s)", flush=True)
            if arguments.callbacks:
                code, summary = callback_tests(overlay)
                callback_results.append((version, code, summary))
                print(f"   tests/test_callbacks.py: exit {code}\n{summary}", flush=True)
    print_table(cells, arguments.resume_backend)
    for cell in cells:
        if cell.broken_rows:
            print(f"patch rows Keras {cell.keras} breaks on {cell.backend}:")
            print("\n".join(f"  {row}" for row in cell.broken_rows))
    for version, code, summary in callback_results:
        print(f"tests/test_callbacks.py on Keras {version}: {'✅ passed' if code == 0 else '❌'}; {summary}")
    print(f"version smoke: {time.monotonic() - started:.0f} s wall")
    failed = [cell for cell in cells if not cell.ok] or [result for result in callback_results if result[1]]
    return 0 if arguments.report_only or not failed else 1


if __name__ == "__main__":
    sys.exit(main())
