"""Slurm's compact host lists and task counts, expanded in Python (no `scontrol`).

`SLURM_STEP_NODELIST` packs node names into ranges: `node[01-04,07],gpu-a[1-2]` is
node01..node04, node07, gpu-a1, gpu-a2 (zero padding kept from the lower bound, order kept, no
deduplication, several bracket groups in one name allowed: `r[1-2]n[1-2]`).
`SLURM_STEP_TASKS_PER_NODE` packs counts: `2(x3),1` is 2, 2, 2, 1. The results agree with
TensorFlow's `expand_hostlist` and `expand_tasks_per_node` wherever those accept the input.
"""

from __future__ import annotations

import itertools
import re

from keras_mwms.resolvers.environment import environment_error

_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?$")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?$")


def _split_outside_brackets(text: str, variable: str) -> list[str]:
    parts, current, depth = [], "", 0
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise environment_error(variable, text, "nests '[' inside a range",
                                        "Write ranges like node[01-04,07], one level deep.")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise environment_error(variable, text, "has a ']' without its '['",
                                        "Write ranges like node[01-04,07].")
        elif char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += char
    if depth:
        raise environment_error(variable, text, "has a '[' that is never closed",
                                "Write ranges like node[01-04,07].")
    parts.append(current)
    return parts


def _expand_range(expression: str, text: str, variable: str) -> list[str]:
    values = []
    for part in expression.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise environment_error(variable, text, f"has the range item {part!r}, which is not N or N-M",
                                    "Use node[1-4,7]: numbers and dashes inside brackets.")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise environment_error(variable, text, f"has the decreasing range {part!r}",
                                    f"Write it as {high}-{low}.")
        values += [str(number).zfill(len(low_text)) for number in range(low, high + 1)]
    return values


def expand_hostlist(text: str, variable: str = "SLURM_STEP_NODELIST") -> list[str]:
    """The node names of a Slurm host list, in order.

    Raises `ClusterEnvironmentError` naming `variable` for a malformed list.

    Example:

    >>> expand_hostlist("node[01-03,07],gpu-a[1-2],login")
    ['node01', 'node02', 'node03', 'node07', 'gpu-a1', 'gpu-a2', 'login']
    >>> expand_hostlist("r[1-2]n[8-9]")
    ['r1n8', 'r1n9', 'r2n8', 'r2n9']
    """
    if not isinstance(text, str) or not text.strip():
        raise environment_error(variable, text, "is empty", "It must name the nodes, e.g. node[01-04].")
    hosts: list[str] = []
    for part in _split_outside_brackets(text.strip(), variable):
        if not part or any(char.isspace() for char in part):
            raise environment_error(variable, text, f"has the empty or blank node name {part!r}",
                                    "Separate node names with single commas, e.g. node1,node2.")
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[piece] if index % 2 == 0 else _expand_range(piece, text, variable)
                   for index, piece in enumerate(pieces)]
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    return hosts


def expand_tasks_per_node(text: str, variable: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Per-node task counts of a Slurm `2(x3),1`-style list, in node order.

    Example:

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    if not isinstance(text, str) or not text.strip():
        raise environment_error(variable, text, "is empty", "It must count tasks per node, e.g. 2(x3),1.")
    counts: list[int] = []
    for part in text.strip().split(","):
        match = _TASKS.match(part.strip())
        if not match:
            raise environment_error(variable, text, f"has the item {part!r}, which is not N or N(xR)",
                                    "Counts look like 2(x3),1: two tasks on each of three nodes, then one.")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count == 0 or repeat == 0:
            raise environment_error(variable, text, f"has the zero item {part!r}",
                                    "Every node of a job step runs at least one task.")
        counts += [count] * repeat
    return counts


def given_hosts(hosts: str | list[str] | None, environ, setting) -> tuple[str, list[str] | None]:
    """The job's nodes in rank order and where they came from: the `hosts` argument, else the
    variable `setting` reads (`keras_mwms.settings.HOSTS`), expanded like Slurm's lists; None
    when neither is given.

    Example:

    >>> import types
    >>> unset = types.SimpleNamespace(name="HOSTS", read=lambda environ: environ.get("HOSTS"))
    >>> given_hosts("node[1-2]", {}, unset), given_hosts(None, {"HOSTS": "a,b"}, unset)
    (('hosts', ['node1', 'node2']), ('HOSTS', ['a', 'b']))
    """
    if hosts is None:
        text = setting.read(environ)
        return (setting.name, expand_hostlist(text, setting.name)) if text is not None else ("hosts", None)
    return "hosts", expand_hostlist(hosts, "hosts") if isinstance(hosts, str) else list(hosts)


def nodes_share(hosts: list[str], size: int, variable: str, unit: str) -> int:
    """How many of the job's `size` processes run on each of `hosts`; an error naming `variable`
    unless every node runs the same number.

    Example:

    >>> nodes_share(["a", "b"], 4, "hosts", "ranks")
    2
    """
    if not hosts or size % len(hosts):
        raise environment_error(variable, ",".join(hosts),
                                f"names {len(hosts)} node(s), which do not share {size} {unit} evenly",
                                f"List each node once, every node running the same number of {unit}.")
    return size // len(hosts)
