"""Every runnable guide runs top to bottom (smoke mode) on every backend and asserts its claim.

The guides run three at a time (`tests.multiworker.concurrently`): each starts its gangs and
its one-process comparison one after the other, so a lone process or a restart leaves a core idle.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.multiworker import (
    REPO,
    ProcessesResult,
    Spawn,
    concurrently,
    launcher_preload_env,
    run_processes,
    selected_params,
    worker_env,
)

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


def _run_guide(guide: str, backend: str, tmp_path) -> ProcessesResult:
    # The guides run the launcher: with KERAS_MWMS_PRELOAD=1 it forks their workers (--preload).
    env = {**worker_env(backend), **launcher_preload_env(), "KERAS_MWMS_GUIDE_SMOKE": "1", "TMPDIR": str(tmp_path)}
    return run_processes([Spawn([sys.executable, str(REPO / "guides" / guide)], env)], timeout=900)


@pytest.fixture(scope="module")
def guide_runs(request, tmp_path_factory) -> dict:
    """Every selected (guide, backend) run, three at a time, each in its own TMPDIR."""
    jobs = selected_params(request, "guide", "backend")
    folders = {job: tmp_path_factory.mktemp(f"{job[0][:-3]}-{job[1]}") for job in jobs}
    return concurrently(lambda job: _run_guide(*job, folders[job]), jobs)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("guide", GUIDES)
def test_guide_runs(guide, backend, guide_runs):
    ran = guide_runs[(guide, backend)]
    assert ran.codes == [0], ran.log(12000)
