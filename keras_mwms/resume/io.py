"""Crash-safe file writes for checkpoints: nothing half-written is ever visible.

A writer produces the file (or directory) under a temporary name in the same directory, syncs
it to disk, then renames it into place with `os.replace` — atomic on POSIX file systems — so a
process killed mid-write leaves the previous version intact and at worst a `.tmp-*` entry that
the next write cleans up.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

TEMP_PREFIX = ".tmp-keras_mwms-"


def _fsync_directory(path: str) -> None:
    with contextlib.suppress(OSError):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def temporary_sibling(path: str, keep_suffix: str = "") -> str:
    """A unique temporary path next to `path`, ending with `keep_suffix` (e.g. `.keras`).

    Example:

    >>> temporary_sibling("/ckpt/best.keras", ".keras").startswith("/ckpt/.tmp-keras_mwms-")
    True
    """
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.join(directory, f"{TEMP_PREFIX}{uuid.uuid4().hex}{keep_suffix}")


@contextlib.contextmanager
def atomic_path(path: str, keep_suffix: str = "") -> Iterator[str]:
    """Yields a temporary path to write; on success it replaces `path` atomically.

    On an exception the temporary file or directory is removed and `path` is untouched.

    Example:

    >>> import tempfile, os
    >>> target = os.path.join(tempfile.mkdtemp(), "state.json")
    >>> with atomic_path(target) as temporary:
    ...     _ = open(temporary, "w").write("{}")
    >>> open(target).read()
    '{}'
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = temporary_sibling(path, keep_suffix)
    try:
        yield temporary
        if os.path.isfile(temporary):
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
        _fsync_directory(directory)
    finally:
        remove(temporary)


def write_json_atomically(path: str, payload: Any) -> None:
    """Writes `payload` as JSON to `path` so readers see the old or the new file, never half.

    Example:

    >>> import tempfile, os
    >>> target = os.path.join(tempfile.mkdtemp(), "meta.json")
    >>> write_json_atomically(target, {"epoch": 3})
    >>> read_json(target)
    {'epoch': 3}
    """
    with atomic_path(path, ".json") as temporary:
        with open(temporary, "w") as handle:
            json.dump(payload, handle, indent=1, sort_keys=True)


def read_json(path: str) -> Any:
    """Reads a JSON file."""
    with open(path) as handle:
        return json.load(handle)


def remove(path: str) -> None:
    """Removes a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def remove_stale_temporaries(directory: str) -> None:
    """Deletes `.tmp-keras_mwms-*` leftovers of writers that were killed mid-write."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.startswith(TEMP_PREFIX):
                remove(os.path.join(directory, name))
