"""The on-disk backup of `keras_mwms.callbacks.BackupAndRestore` (pure numpy, no Keras).

Layout of `backup_dir`:

* `checkpoint-<ns>/state.npz` — every variable's value, in the model's variable order;
* `checkpoint-<ns>/metadata.json` — format, epoch, step, variable paths and shapes, writer;
* `latest.json` — `{"current": name, "previous": name | null}`, the only file readers trust.

A backup directory is complete before `latest.json` is switched to it (atomic rename), so a
kill at any moment leaves a loadable backup.
"""

from __future__ import annotations

import os
import time

import numpy as np

from keras_mwms.resume import io

POINTER_FILE = "latest.json"
STATE_FILE = "state.npz"
METADATA_FILE = "metadata.json"
FORMAT = "keras_mwms-backup/1"


def write_backup(backup_dir: str, metadata: dict, arrays: list, keep_previous: bool) -> str:
    """Writes one backup atomically and switches `latest.json` to it; returns its directory name.

    Example:

    >>> import tempfile, numpy as np
    >>> directory = tempfile.mkdtemp()
    >>> name = write_backup(directory, {"format": FORMAT, "epoch": 1, "step": 0}, [np.zeros(2)], False)
    >>> io.read_json(f"{directory}/latest.json")["current"] == name
    True
    """
    os.makedirs(backup_dir, exist_ok=True)
    io.remove_stale_temporaries(backup_dir)
    pointer_path = os.path.join(backup_dir, POINTER_FILE)
    old = io.read_json(pointer_path) if os.path.exists(pointer_path) else {}
    name = f"checkpoint-{time.time_ns()}"
    with io.atomic_path(os.path.join(backup_dir, name)) as temporary:
        os.makedirs(temporary)
        with open(os.path.join(temporary, STATE_FILE), "wb") as handle:
            np.savez(handle, **{f"a{i}": array for i, array in enumerate(arrays)})
            handle.flush()
            os.fsync(handle.fileno())
        io.write_json_atomically(os.path.join(temporary, METADATA_FILE), metadata)
    previous = old.get("current") if keep_previous else None
    try:
        io.write_json_atomically(pointer_path, {"current": name, "previous": previous})
    except BaseException:
        # The pointer still names the old backup, so the new one is unreachable: remove it
        # rather than leave a stray checkpoint that only holds space on a full disk.
        io.remove(os.path.join(backup_dir, name))
        raise
    keep = {name, previous}
    for entry in os.listdir(backup_dir):
        if entry.startswith("checkpoint-") and entry not in keep:
            io.remove(os.path.join(backup_dir, entry))
    return name



def read_checkpoint(directory: str) -> tuple[dict, list]:
    """`(metadata, arrays)` of one complete backup directory; `ValueError` if it is not one."""
    metadata = io.read_json(os.path.join(directory, METADATA_FILE))
    if metadata.get("format") != FORMAT:
        raise ValueError(f"unknown backup format {metadata.get('format')!r}")
    with np.load(os.path.join(directory, STATE_FILE)) as archive:
        arrays = [archive[f"a{i}"] for i in range(len(archive.files))]
    return metadata, arrays
