"""Every runnable guide runs top to bottom (smoke mode) on every backend and asserts its claim."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.multiworker import REPO, worker_env

GUIDES = sorted(path for path in os.listdir(REPO / "guides") if path.endswith(".py"))
BACKENDS = ["tensorflow", "jax", "torch"]


def test_every_guide_has_the_keras_io_header():
    assert GUIDES, f"no runnable guide found in {REPO / 'guides'}"
    for name in os.listdir(REPO / "guides"):
        text = (REPO / "guides" / name).read_text()
        for field in ("Title:", "Author:", "Date created:", "Last modified:", "Description:"):
            assert field in text[:1500], f"{name} lacks {field}"


def test_readme_links_every_guide():
    readme = (REPO / "README.md").read_text()
    for name in os.listdir(REPO / "guides"):
        assert f"guides/{name}" in readme, f"README does not link {name}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("guide", GUIDES)
def test_guide_runs(guide, backend, tmp_path):
    env = {**os.environ, **worker_env(backend), "KERAS_MWMS_GUIDE_SMOKE": "1", "TMPDIR": str(tmp_path)}
    env.pop("TF_CONFIG", None)
    completed = subprocess.run([sys.executable, str(REPO / "guides" / guide)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-6000:] + completed.stderr[-6000:]
