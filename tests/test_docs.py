"""Every code block of README.md, guides/*.md and the site's pages (docs/) runs as written, or says why it cannot.

A fenced block is one of:

* ```python: run in a process of its own (single worker, torch; forked after its imports,
  `tests/preloaded.py`), in an empty folder. A block right after `<!-- continues -->` runs in
  the same process after the python block before it, so a guide's *After* blocks run top to
  bottom as one script. A block starting `# train.py` is the file the bash blocks launch: the
  README's Quick start;
* ```bash: run by bash in a folder holding the Quick start's `train.py`, with this venv's
  `python` and `keras-mwms` first on PATH: the README's launch line on 2 local workers of every
  backend, the others on torch;
* ```json: parsed; a TF_CONFIG is validated by `TFConfigClusterResolver`;
* ```text: output shown to the reader, not code.

`<!-- not run: REASON -->` right before a block skips it (a cluster, GPUs, CI itself); its
syntax is still checked (python compiles, `bash -n`, json parses). The Quick start's data is
512 rows, so its three gangs cost about 15 s each here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_mwms.startup.cluster import TFConfigClusterResolver
from tests.multiworker import REPO, Spawn, concurrently, run_processes, selected_params, worker_env

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "guides").glob("*.md")), *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)
MARK = re.compile(r"<!-- (not run|continues)(?::\s*(.*?))? -->[ \t]*\n*$")
LANGUAGES = {"python", "bash", "json", "yaml", "text"}
RUN_TIMEOUT = 240
QUICK_START = "# train.py"


@dataclasses.dataclass
class Block:
    path: Path
    line: int
    language: str
    code: str
    not_run: str | None = None
    continues: bool = False

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()]
        mark = MARK.search(before[-300:])
        found.append(Block(path, before.count("\n") + 1, match.group(1), match.group(2),
                           not_run=(mark.group(2) or "") if mark and mark.group(1) == "not run" else None,
                           continues=bool(mark) and mark.group(1) == "continues"))
    return found


BLOCKS = [block for path in DOCUMENTS for block in blocks_of(path)]


def python_scripts() -> list[tuple[str, str]]:
    """(name, code) of every python script the documents hold, `continues` blocks joined."""
    scripts: list[list[Block]] = []
    for block in BLOCKS:
        if block.language != "python" or block.not_run is not None or block.code.startswith(QUICK_START):
            continue
        if block.continues:
            assert scripts and scripts[-1][0].path == block.path, f"{block.name} continues nothing"
            scripts[-1].append(block)
        else:
            scripts.append([block])
    return [(chain[0].name, "\n".join(block.code for block in chain)) for chain in scripts]


def quick_start() -> str:
    starts = [block.code for block in BLOCKS if block.path.name == "README.md" and block.code.startswith(QUICK_START)]
    assert len(starts) == 1, "README.md must hold exactly one '# train.py' block: the Quick start"
    return starts[0]


def bash_runs() -> list:
    runs = []
    for block in BLOCKS:
        if block.language == "bash" and block.not_run is None:
            readme_launch = block.path.name == "README.md"
            for backend in (("tensorflow", "jax", "torch") if readme_launch else ("torch",)):
                runs.append(pytest.param(block, backend, id=f"{block.name}-{backend}",
                                         marks=getattr(pytest.mark, backend)))
    return runs


def _run(command: list[str], backend: str, folder: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, **worker_env(backend))
    env.pop("TF_CONFIG", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)


def test_every_block_is_run_or_says_why():
    assert len(BLOCKS) > 20
    for block in BLOCKS:
        assert block.language in LANGUAGES, f"{block.name}: tag the block ({', '.join(sorted(LANGUAGES))})"
        if block.language == "yaml":
            assert block.not_run, f"{block.name}: a manifest needs its cluster: mark it '<!-- not run: ... -->'"
        if block.not_run is not None:
            assert block.not_run.strip(), f"{block.name}: say why the block is not run"
        if block.language == "python":
            compile(block.code, block.name, "exec")
        elif block.language == "bash":
            checked = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
            assert checked.returncode == 0, f"{block.name}: {checked.stderr}"
        elif block.language == "json":
            value = json.loads(block.code)
            if "cluster" in value and "task" in value:
                assert TFConfigClusterResolver(tf_config=block.code).num_workers == len(value["cluster"]["worker"])


@pytest.mark.torch
@pytest.mark.parametrize("name,code", python_scripts(), ids=[name for name, _ in python_scripts()])
def test_python_block_runs(name, code, tmp_path):
    # A process of its own (forked after the imports where it can be: tests/preloaded.py).
    ran = run_processes([Spawn([sys.executable, "-c", code], worker_env("torch"))], timeout=RUN_TIMEOUT, cwd=tmp_path)
    assert ran.codes == [0], f"{name}:\n{ran.log(8000)}"


@pytest.fixture(scope="module")
def bash_results(request, tmp_path_factory) -> dict:
    """Every selected bash run, three at a time (a launcher run leaves a core idle while its gang
    starts and meets): {(block name, backend): (CompletedProcess, folder)}."""
    blocks = {block.name: block for block in BLOCKS}
    jobs = [(block.name, backend) for block, backend in selected_params(request, "block", "backend")]
    folders = {job: tmp_path_factory.mktemp("bash") for job in jobs}

    def run(job):
        name, backend = job
        (folders[job] / "train.py").write_text(quick_start())
        return _run(["bash", "-e", "-c", blocks[name].code], backend, folders[job])

    return concurrently(run, jobs)


@pytest.mark.slow
@pytest.mark.parametrize("block,backend", bash_runs())
def test_bash_block_runs_with_the_quick_start(block, backend, bash_results):
    """The README's launch line trains the Quick start on 2 local workers of every backend."""
    ran = bash_results[(block.name, backend)]
    output = ran.stdout + ran.stderr
    assert ran.returncode == 0, f"{block.name} on {backend}:\n{output[-6000:]}"
    assert "all 2 worker(s) finished successfully" in output, output[-3000:]
    assert "Epoch 3/3" in output, output[-3000:]
    assert "Traceback" not in output, output[-6000:]
