"""A healthy run prints what one plain-Keras process prints, plus a line or two (issue 34, item 3).

Per backend, the README's Quick start with data defined (`tests/workers/quickstart.py`, 3
epochs, Keras' progress bar on) runs once as one process of plain Keras and once on 2 workers
through the launcher, both with the user's environment (no `TF_CPP_MIN_LOG_LEVEL`). The rule,
on non-empty lines:

- the chief prints Keras' "Epoch i/N" lines as plain Keras does, and besides Keras' progress
  output (whose number of timed updates varies) at most the plain process's other lines + 2
  (today: "keras_mwms: cluster of 2 workers from TF_CONFIG", and JAX's gloo "Rank 0 is
  connected" line);
- worker 1 shows no progress and prints at most the plain process's lines other than Keras'
  progress output + 2 (the same TensorFlow start-up lines a plain process prints);
- the launcher says two lines: the start and the success;
- no straggler table naming nobody, no time table: those appear when they say something (a
  straggler, a hang, a failure) or on request (`--report`, `tests/test_straggler.py`).

Before (issue 34): TF 60 lines, JAX 28, torch 26 for the 2-worker run.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.multiworker import WORKERS_DIR, python_worker, run_launcher, worker_env

BACKENDS = [pytest.param(name, marks=getattr(pytest.mark, name)) for name in ("tensorflow", "jax", "torch")]
TIMEOUT = 300


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _is_progress(line: str) -> bool:
    """Keras' own progress output: "Epoch i/N" and its progress bar."""
    return line.startswith("Epoch ") or "━" in line or "/step" in line


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_healthy_two_worker_run_prints_what_plain_keras_prints(backend, monkeypatch):
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG", "KERAS_MWMS_REPORT"):   # the user's environment
        monkeypatch.delenv(name, raising=False)
    env = {key: value for key, value in worker_env(backend).items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    plain = subprocess.run(python_worker("quickstart.py", "--plain"), env={**os.environ, **env},
                           capture_output=True, text=True, timeout=TIMEOUT)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    plain_lines = _lines(plain.stdout + plain.stderr)
    result = run_launcher(["--workers", "2"], [str(WORKERS_DIR / "quickstart.py")], timeout=TIMEOUT, env=env,
                          preload=False)   # first-run output: every worker a fresh start
    shown = f"--- plain\n{chr(10).join(plain_lines)}\n--- launcher\n{result.launcher_log}\n--- workers\n{result.output}"
    assert result.returncode == 0, shown
    # (Text-mode pipes turn the progress bar's "\r" redraws into lines of their own, without the
    # prefix: they are Keras' progress either way, and the prefix alone is no line of text.)
    workers = {index: [line[len(f"[worker {index}] "):] for line in _lines(result.output)
                       if line.startswith(f"[worker {index}] ") and line[len(f"[worker {index}] "):].strip()]
               for index in (0, 1)}
    print(f"{backend}: plain {len(plain_lines)} lines; chief {len(workers[0])}, worker 1 "
          f"{len(workers[1])}, launcher {len(_lines(result.launcher_log))}")
    plain_other = [line for line in plain_lines if not _is_progress(line)]
    chief_other = [line for line in workers[0] if not _is_progress(line)]
    # Keras' progress bar prints a varying number of updates (it is timed): count the rest.
    assert len(chief_other) <= len(plain_other) + 2, shown
    epochs = [line for line in workers[0] if line.startswith("Epoch ")]
    assert epochs == [line for line in plain_lines if line.startswith("Epoch ")], shown
    assert not any(map(_is_progress, workers[1])), shown
    assert len(workers[1]) <= len(plain_other) + 2, shown
    assert len(_lines(result.launcher_log)) <= 2, shown
    everything = result.output + result.launcher_log
    assert "keras_mwms epoch" not in everything and "where each worker's time went" not in everything, shown
