"""MkDocs hooks of the documentation site (registered in mkdocs.yml under `hooks:`).

* The guides become pages: each `guides/<name>.py` (keras-io layout: a header docstring, then
  prose blocks and code cells) and each `guides/<name>.md` is generated as `guides/<name>.md`.
* Links to repository files that are not pages (`../keras_mwms/launch.py`, `../README.md`)
  point to the file on `repo_url` (plain inline code without one); links to a file that *is* a
  page (`../guides/fault_tolerance.py`, `../ARCHITECTURE.md`) become links to that page. Links
  between pages are left alone, so MkDocs validates them and their anchors.
* `--8<-- "FILE"` or `--8<-- "FILE:SECTION"` of a repository file outside docs/ is included
  here, before Markdown, so its links are resolved from the included file's folder
  (pymdownx.snippets includes the rest).
* Markers are replaced by generated text, so it cannot drift: `<!-- settings-table -->` by
  `keras_mwms.settings.markdown_table()`, `<!-- launch-help -->`, `<!-- cli-help -->` and
  `<!-- tf-config-help -->` by the commands' `--help`.
* Every public name needs a `::: identifier` entry on an API page (docs/api/), or the build fails.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import posixpath
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

GUIDES_DIR = "guides"
# Repository files shown as a page of their own: the snippet page that includes them.
INCLUDED_PAGES = {"ARCHITECTURE.md": "architecture.md"}
SETTINGS_MARKER = "<!-- settings-table -->"
API_DIR = "api/"
HELP_WIDTH = "100"   # the --help texts' $COLUMNS

# Where each generated page's source lives, relative to the repository root (its links' base).
_generated_bases: dict[str, str] = {}

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
_SNIPPET_LINE = re.compile(r'^[ \t]*--8<--[ \t]+"([^"]+)"[ \t]*$')
_LINK = re.compile(
    r"(?P<code>``[^`].*?``|`[^`\n]+`)"                               # code spans stay as they are
    r"|(?P<bang>!?)\[(?P<text>(?:[^\[\]\n]|\[[^\[\]\n]*\])*)\]"        # [text] or ![alt]
    r"\((?P<target><[^>\n]+>|[^)\s]+)(?P<title>\s+\"[^\"\n]*\")?\)"  # (target "title")
    r"|^(?P<refindent>[ ]{0,3})\[(?P<ref>[^\]\n]+)\]:[ \t]*(?P<reftarget>\S+)",  # [ref]: target
    re.M,
)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _repo_root(config) -> Path:
    """The folder holding mkdocs.yml: the repository root."""
    return Path(config.config_file_path).resolve().parent


def _docs_base(config) -> str:
    """docs_dir relative to the repository root, POSIX-style (`docs`)."""
    return Path(config.docs_dir).resolve().relative_to(_repo_root(config)).as_posix()


# --- guides as pages ------------------------------------------------------------------------


def guide_py_to_markdown(source: str, source_path: str, repo_url: str | None) -> str:
    """A keras-io style guide (`Title:` header docstring, prose strings, code) as Markdown.

    Module-level string statements are prose; everything between them is a ```python cell.
    The header's Title becomes the H1, its Description the first paragraph.
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    prose = [node for node in tree.body
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
             and isinstance(node.value.value, str)]
    header: dict[str, str] = {}
    if prose and tree.body[0] is prose[0]:
        for line in prose[0].value.value.strip().splitlines():
            key, _, value = line.partition(":")
            header[key.strip().lower()] = value.strip()
    title = header.get("title") or Path(source_path).stem.replace("_", " ").capitalize()
    if repo_url:
        origin = f"[`{source_path}`]({repo_url.rstrip('/')}/blob/main/{source_path})"
    else:
        origin = f"`{source_path}`"
    parts = [f"# {title}"]
    if header.get("description"):
        parts.append(header["description"])
    parts.append(f"*Runnable source: {origin}.*")
    position = prose[0].end_lineno if header else 0
    for node in prose[1 if header else 0:]:
        parts.append(_code_cell(lines[position:node.lineno - 1]))
        parts.append(textwrap.dedent(node.value.value).strip())
        position = node.end_lineno
    parts.append(_code_cell(lines[position:]))
    return "\n\n".join(part for part in parts if part) + "\n"


def _code_cell(lines: list[str]) -> str:
    """Source lines as a ```python fence (lint directives dropped), or "" when only blanks."""
    kept = [line for line in lines if not re.match(r"^\s*# ruff: noqa", line)]
    body = "\n".join(kept).strip("\n")
    return f"```python\n{body}\n```" if body.strip() else ""


def on_files(files, config):
    """Adds the guides (guides/*.py and guides/*.md of the repository) as generated pages."""
    root = _repo_root(config)
    _generated_bases.clear()
    for path in sorted((root / GUIDES_DIR).glob("*")):
        if path.suffix not in (".py", ".md"):
            continue
        source_path = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".py":
            text = guide_py_to_markdown(text, source_path, config.repo_url)
        uri = f"{GUIDES_DIR}/{path.stem}.md"
        if files.get_file_from_path(uri) is not None:
            raise PluginError(f"{source_path} would be the page {uri}, which exists already (in docs/ or from "
                              "a guide of the same name)")
        files.append(File.generated(config, uri, content=text))
        _generated_bases[uri] = GUIDES_DIR
    return files


# --- links to repository files ---------------------------------------------------------------


def _page_for_repo_path(path: str, config, files) -> str | None:
    """The src_uri of the page or docs file that shows repository file `path`, if any."""
    docs = _docs_base(config)
    if path.startswith(docs + "/"):
        inside = path[len(docs) + 1:]
        return inside if files.get_file_from_path(inside) is not None else None
    folder, name = posixpath.split(path)
    stem, suffix = posixpath.splitext(name)
    if folder == GUIDES_DIR and suffix in (".py", ".md"):
        uri = f"{GUIDES_DIR}/{stem}.md"
        return uri if uri in _generated_bases else None
    uri = INCLUDED_PAGES.get(path)
    return uri if uri and files.get_file_from_path(uri) is not None else None


def rewrite_target(target: str, base: str, page_uri: str, config, files) -> str | None:
    """The new target of a link written in repository folder `base` on page `page_uri`.

    None leaves it unchanged: a URL, an anchor, a link between docs files (MkDocs validates it),
    or a file that does not exist (MkDocs then reports it). A result starting with "`" is inline
    code text: no `repo_url` to link to.
    """
    if not target or target.startswith(("#", "/")) or _SCHEME.match(target):
        return None
    path, hash_, fragment = target.partition("#")
    root = _repo_root(config)
    resolved = posixpath.normpath(posixpath.join(base, path))
    if resolved.startswith("../") or resolved == "..":
        return None   # outside the repository: MkDocs reports it
    docs = _docs_base(config)
    shown_by = _page_for_repo_path(resolved, config, files)
    if shown_by is not None:
        new = posixpath.relpath(shown_by, posixpath.dirname(page_uri) or ".") + hash_ + fragment
        return None if new == target else new   # unchanged: an ordinary link between docs files
    if resolved == docs or resolved.startswith(docs + "/") or not (root / resolved).exists():
        return None   # a missing docs file or repository file: left for MkDocs to report
    if not config.repo_url:
        return "`" + resolved + "`"
    kind = "tree" if (root / resolved).is_dir() else "blob"
    return f"{config.repo_url.rstrip('/')}/{kind}/main/{resolved}" + hash_ + fragment


def rewrite_links(markdown: str, base: str, page_uri: str, config, files) -> str:
    """Rewrites the Markdown links of text written in repository folder `base` (not in code)."""

    def replace(match: re.Match) -> str:
        if match.group("code"):
            return match.group(0)
        if match.group("ref") is not None:
            new = rewrite_target(match.group("reftarget"), base, page_uri, config, files)
            if new is None:
                return match.group(0)
            if new.startswith("`"):   # a reference definition cannot be code: keep a dead-end anchor
                new = "#"
            return f"{match.group('refindent')}[{match.group('ref')}]: {new}"
        target = match.group("target").strip("<>")
        new = rewrite_target(target, base, page_uri, config, files)
        if new is None:
            return match.group(0)
        text = match.group("text")
        if new.startswith("`"):
            if text.strip("`") == new.strip("`"):
                return new
            return f"{text} ({new})"
        return f"{match.group('bang')}[{text}]({new}{match.group('title') or ''})"

    return _outside_fences(markdown, lambda chunk: _LINK.sub(replace, chunk))


def _outside_fences(markdown: str, transform, keep_fences: bool = True) -> str:
    """Applies `transform` to the text outside fenced code blocks (dropping them if not `keep_fences`)."""
    out: list[str] = []
    chunk: list[str] = []
    fence: str | None = None
    for line in markdown.splitlines(keepends=True):
        opening = _FENCE.match(line)
        if fence is None and opening:
            out.append(transform("".join(chunk)))
            chunk = []
            fence = opening.group(1)
            out.append(line if keep_fences else "")
        elif fence is not None:
            out.append(line if keep_fences else "")
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
        else:
            chunk.append(line)
    out.append(transform("".join(chunk)))
    return "".join(out)


def snippet_section(text: str, section: str, name: str) -> str:
    """The lines between `--8<-- [start:SECTION]` and `--8<-- [end:SECTION]` (pymdownx.snippets')."""
    start = re.search(rf"^.*--8<-- \[start:{section}\].*\n", text, re.M)
    end = re.search(rf"^.*--8<-- \[end:{section}\].*$", text, re.M)
    if not start or not end or end.start() < start.end():
        raise PluginError(f"{name} has no section {section!r} (--8<-- [start:{section}] ... [end:{section}])")
    return text[start.end():end.start()]


def include_repository_snippets(markdown: str, config, files, page_uri: str) -> str:
    """Includes `--8<-- "FILE"` lines naming a repository file outside docs/, links rewritten."""
    root = _repo_root(config)
    docs = _docs_base(config)

    def include(chunk: str) -> str:
        lines = []
        for line in chunk.splitlines(keepends=True):
            match = _SNIPPET_LINE.match(line)
            name, _, section = match.group(1).partition(":") if match else ("", "", "")
            name = posixpath.normpath(name) if name else name
            if (not match or name.startswith(("../", docs + "/")) or not (root / name).is_file()
                    or not re.fullmatch(r"[\w-]*", section)):
                lines.append(line)   # pymdownx.snippets includes it (or reports it)
                continue
            text = (root / name).read_text(encoding="utf-8")
            if section:
                text = snippet_section(text, section, name)
            lines.append(rewrite_links(text, posixpath.dirname(name), page_uri, config, files)
                         .rstrip("\n") + "\n")
        return "".join(lines)

    return _outside_fences(markdown, include)


# --- generated text --------------------------------------------------------------------------


@contextlib.contextmanager
def _fixed_width():
    """argparse wraps help to $COLUMNS: fixed while generating, so pages do not depend on a terminal."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous


def _help_of(parser: argparse.ArgumentParser) -> str:
    """A parser's --help at the fixed width."""
    with _fixed_width():
        return parser.format_help()


def _printed_by(main: Callable[[list[str]], object], argv: list[str]) -> str:
    """What a command's `main(argv)` prints on stdout (`--help` exits through SystemExit)."""
    buffer = io.StringIO()
    with _fixed_width(), contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
        main(argv)
    return buffer.getvalue()


def _text_block(text: str) -> str:
    """Program output as a ```text fence."""
    return "```text\n" + text.rstrip("\n") + "\n```"


def generated_blocks() -> dict[str, Callable[[], str]]:
    """Marker -> function producing its Markdown (imports nothing of an ML framework)."""

    def settings_table() -> str:
        from keras_mwms import settings

        return settings.markdown_table().rstrip("\n")

    def launch_help() -> str:
        from keras_mwms import launch

        return _text_block(_help_of(launch.build_parser()))

    def cli_help() -> str:
        from keras_mwms import cli

        return _text_block(_printed_by(cli.main, ["--help"]))

    def tf_config_help() -> str:
        from keras_mwms import cli

        return _text_block(_printed_by(cli.tf_config_main, ["--help"]))

    return {SETTINGS_MARKER: settings_table, "<!-- launch-help -->": launch_help,
            "<!-- cli-help -->": cli_help, "<!-- tf-config-help -->": tf_config_help}


def fill_markers(markdown: str) -> str:
    """Replaces each marker on a line of its own, not in code."""
    blocks = generated_blocks()

    def fill(chunk: str) -> str:
        for marker, make in blocks.items():
            line = re.compile(rf"^[ \t]*{re.escape(marker)}[ \t]*$", re.M)
            if line.search(chunk):
                text = make()
                chunk = line.sub(lambda match, text=text: text, chunk)
        return chunk

    return _outside_fences(markdown, fill)


def on_page_markdown(markdown, page, config, files):
    """Snippets of repository files, generated text, and links to repository files."""
    uri = page.file.src_uri
    docs = _docs_base(config)
    base = _generated_bases.get(uri) or posixpath.join(docs, posixpath.dirname(uri)).rstrip("/")
    markdown = include_repository_snippets(markdown, config, files, uri)
    markdown = fill_markers(markdown)
    return rewrite_links(markdown, base, uri, config, files)


# --- every public name documented ------------------------------------------------------------


def _all_of(path: Path) -> list[str]:
    """A module's `__all__`, read from its source without importing it."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "__all__"):
            return list(ast.literal_eval(node.value))
    raise PluginError(f"{path} has no __all__")


def required_api_entries(root: Path) -> list[str]:
    """The identifiers every API reference must document: the public names and the launcher."""
    package = root / "keras_mwms"
    names = [f"keras_mwms.{name}" for name in _all_of(package / "__init__.py")
             if name not in ("__version__", "callbacks")]
    names += [f"keras_mwms.callbacks.{name}" for name in _all_of(package / "callbacks" / "__init__.py")]
    names += ["keras_mwms.launch.Gang", "keras_mwms.launch.Launcher", "keras_mwms.launch.main"]
    return names


def documented_api_entries(files) -> set[str]:
    """The `::: identifier` entries of the API pages (docs/api/)."""
    entries = set()
    for file in files.documentation_pages():
        if file.src_uri.startswith(API_DIR):
            text = _outside_fences(file.content_string, lambda chunk: chunk, keep_fences=False)
            entries.update(re.findall(r"^:::[ \t]+([\w.]+)", text, re.M))
    return entries


def on_env(env, config, files):
    """Fails the build when a public name has no `::: identifier` entry on an API page."""
    missing = [name for name in required_api_entries(_repo_root(config))
               if name not in documented_api_entries(files)]
    if missing:
        raise PluginError("public names without an API entry (add `::: NAME` to a page under "
                          "docs/api/): " + ", ".join(missing))
    return env
