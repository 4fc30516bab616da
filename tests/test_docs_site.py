"""The documentation site builds with `mkdocs build --strict`, and its API reference is there.

Strict means every warning fails: a broken link or anchor between pages, a page left out of the
nav, a docstring whose `Args:` name a parameter the signature lacks, a public name without an API
entry (docs/hooks.py), a missing snippet file. So a docstring, a renamed section or a new public
name that would break the site breaks this test instead. The build also runs the site's generated
text (guides as pages, the environment-variable table, the launcher's --help), so the pages shown
are the ones the code makes. The docs extra is installed by `make install`; the build takes about
10 s here (54 s beside a full `make test`).
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from keras_mwms import settings

REPO = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_SECONDS = 300   # > 5x the slowest build measured: 54 s beside a full make test (load ≈ 10)


def test_strict_build_has_the_api_reference(tmp_path):
    site = tmp_path / "site"
    # The theme prints a banner about MkDocs 2 (its variable's name says WARNING); not the build's.
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output

    strategy_page = (site / "api" / "strategy" / "index.html").read_text(encoding="utf-8")
    assert 'id="keras_mwms.MultiWorkerMirroredStrategy"' in strategy_page
    signature = strategy_page.split('class="doc-signature', 1)[1].split("</code>", 1)[0]
    signature = html.unescape(re.sub(r"<[^>]+>", "", signature))
    assert "MultiWorkerMirroredStrategy(" in signature, signature
    assert "cluster_resolver: ClusterResolver | None = None" in signature, signature

    # The generated text is in: the table of variables (docs/messages.md holds only its marker,
    # tests/test_settings.py) and the launcher's --help.
    messages_page = (site / "messages" / "index.html").read_text(encoding="utf-8")
    assert all(f"<code>{name}</code>" in messages_page for name in settings.SETTINGS)
    launch_page = (site / "api" / "launch" / "index.html").read_text(encoding="utf-8")
    assert "--max-restarts" in launch_page and "&lt;!-- launch-help --&gt;" not in launch_page

    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    assert any("BackupAndRestore" in entry["title"] + entry["text"] for entry in index["docs"])
