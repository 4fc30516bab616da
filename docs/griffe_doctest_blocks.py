"""Griffe extension of the docs site (mkdocs.yml, mkdocstrings' `extensions`): doctest blocks as code.

The package's docstrings write examples as `Example:`, a blank line, then unindented `>>>`
lines (doctest runs them: tests/test_docstrings.py). Google-style parsing does not take that as
an Examples section, and Markdown reads `>>>` as nested block quotes; so every such run of `>>>` /
`...` lines and their expected output (a doctest block ends at a blank line) is wrapped in a
```pycon fence before the docstring is parsed. Blocks already in a fence are left alone.
"""

from __future__ import annotations

import re

import griffe

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")


def fence_doctest_blocks(text: str) -> str:
    """Wraps each top-level doctest block of a docstring in a ```pycon fence.

    A block is a run of non-blank lines starting with `>>>` at the left margin (doctest's own
    rule: a blank line ends the expected output). Indented blocks are left alone: inside an
    indented `Examples:` section Griffe renders them itself, elsewhere Markdown shows them as code.
    """
    lines = text.split("\n")
    out: list[str] = []
    fence: str | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
        elif line.startswith(">>>"):
            block = []
            while index < len(lines) and lines[index].strip():
                block.append(lines[index])
                index += 1
            if out and out[-1].strip():
                out.append("")
            out.extend(["```pycon", *block, "```"])
            continue
        out.append(line)
        index += 1
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the doctest blocks of every loaded object's docstring."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctest_blocks(obj.docstring.value)
