"""A safety net: workers whose variables silently differ become one loud error on every worker.

Synchronous training keeps every worker's model and optimizer bit-identical; when something
breaks that (a callback that writes a variable on one worker only, a variable created outside
`strategy.scope()`, a keras_mwms bug), the job would go on training N different models. So at
the end of every `fit` and at every checkpoint (`keras_mwms.callbacks.ModelCheckpoint`,
`BackupAndRestore`) each worker fingerprints every model weight and optimizer variable,
trainable or not (its shape and dtype, and the XOR and the sum of its 32-bit words, folded by
CRC-32: any changed word changes both; a pass costs about as much as reading the values once;
names are only for the message, Keras numbers them per process), and the workers compare:

- **healthy** — one all-gather of a five-number summary (variable count, a hash of the
  shapes and dtypes, a hash of the per-variable hashes) finds them equal; nothing else;
- **different** — every worker saw the same gathered summaries, so every worker takes the
  same branch: the chief broadcasts its per-variable list, each worker finds its first
  variable that differs from it, one more all-gather shares that, and every worker raises the
  same `keras_mwms.WorkersDifferError` naming the first differing variable and the workers.

Hashes travel as 16-bit pieces in float64, exact on every backend's collectives (JAX without
x64 carries float32). Seed-generator states and metric states are not compared: metric
states are per-worker by design (the logs are reduced), and seeds drive no variable value.
`KERAS_MWMS_CHECK_WORKERS_AGREE=0` turns the check off.

Example (one worker: nothing to compare, no collective):

>>> class One: num_workers, worker_index = 1, 0
>>> check_workers_agree(One(), [("dense/kernel", np.zeros((2, 2), np.float32))], "model.fit()")
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from keras_mwms import settings
from keras_mwms.backends.keras_api import optimizer_attributes
from keras_mwms.errors import WorkersDifferError

ENABLE_ENV = settings.CHECK_WORKERS_AGREE.name


def enabled() -> bool:
    """Whether the check runs (on unless `KERAS_MWMS_CHECK_WORKERS_AGREE` is 0, false or off).

    Example:

    >>> enabled() in (True, False)
    True
    """
    return settings.CHECK_WORKERS_AGREE.read()


def fingerprint(name: str, value: np.ndarray) -> tuple[str, str, int]:
    """`(name, layout, 32-bit fingerprint)` of one variable: the fingerprint covers its shape,
    dtype and values (the XOR and the sum of its bytes as 32-bit words, zero-padded to whole
    words), not its name: Keras numbers names per process, so a chief that built one more model
    (a reload) names the next ones differently from the other workers.

    Example:

    >>> name, layout, number = fingerprint("dense/bias", np.zeros(3, np.float32))
    >>> layout, number == fingerprint("dense_7/bias", np.zeros(3, np.float32))[2]
    ('shape (3,), float32', True)
    >>> number == fingerprint("dense/bias", np.array([0, 1e-3, 0], np.float32))[2]
    False
    """
    value = np.ascontiguousarray(value)
    layout = f"shape {tuple(value.shape)}, {value.dtype.name}"
    data = value.reshape(-1).view(np.uint8)
    if data.size % 4:
        data = np.concatenate([data, np.zeros(4 - data.size % 4, np.uint8)])
    words = data.view(np.uint32)
    folded = np.array([np.bitwise_xor.reduce(words) if words.size else 0,
                       words.sum(dtype=np.uint64) & 0xFFFFFFFF], np.uint32)
    return name, layout, zlib.crc32(folded.tobytes(), zlib.crc32(layout.encode()))


def _pieces(number: int) -> list[float]:
    return [float(number >> 16), float(number & 0xFFFF)]


def summary(entries: Sequence[tuple[str, str, int]]) -> np.ndarray:
    """Five exact numbers that are equal on two workers only if their `entries` are (names
    aside): the count, a hash of the layouts and a hash of the values, in 16-bit pieces.

    Example:

    >>> a = summary([fingerprint("w", np.ones(2))])
    >>> b = summary([fingerprint("w", np.ones(2) + 1e-3)])
    >>> a.shape, bool((a[:3] == b[:3]).all()), bool((a == b).all())
    ((5,), True, False)
    """
    layouts = zlib.crc32("\n".join(layout for _, layout, _ in entries).encode())
    values = zlib.crc32(np.array([number for _, _, number in entries], np.uint32).tobytes())
    return np.array([float(len(entries)), *_pieces(layouts), *_pieces(values)], np.float64)


def first_difference(mine: Sequence[tuple[str, str, int]],
                     chief: Sequence[tuple[str, str, int]]) -> tuple[int, int]:
    """`(index of the first entry that differs from the chief's, how many differ)`; `(-1, 0)` if
    none. Names are not compared (see `fingerprint`).

    Example:

    >>> first_difference([("a", "s", 1), ("b", "s", 2), ("c", "s", 9)],
    ...                  [("a", "s", 1), ("x", "s", 3), ("c", "s", 8)])
    (1, 2)
    """
    differing = [index for index, (own, theirs) in enumerate(zip(mine, chief)) if own[1:] != theirs[1:]]
    extra = abs(len(mine) - len(chief))   # variables only one side has
    if extra and not differing:
        return min(len(mine), len(chief)), extra
    return (differing[0] if differing else -1), len(differing) + extra


def check_workers_agree(port: Any, named_values: Sequence[tuple[str, np.ndarray]], where: str) -> None:
    """Raises `WorkersDifferError` on every worker when any variable differs between workers.

    Every worker must call it at the same point with its own `(name, value)` pairs in the
    same order; `port` offers `num_workers`, `worker_index`, `all_gather` and
    `broadcast_object` (a `keras_mwms.backends.base.Backend`). One all-gather when all agree.
    """
    if port.num_workers == 1 or not enabled():
        return
    entries = [fingerprint(name, value) for name, value in named_values]
    everyone = np.asarray(port.all_gather(summary(entries)))
    if (everyone == everyone[0]).all():
        return
    # Every worker gathered the same table, so all of them are here, in the same collectives.
    chief = port.broadcast_object(entries if port.worker_index == 0 else None, 0)
    index, count = first_difference(entries, chief)
    table = np.asarray(port.all_gather(np.array([index, count], np.float64)))
    raise WorkersDifferError(*_message(where, entries, chief, table, port.worker_index))


def _message(where: str, own: Sequence[tuple[str, str, int]], chief: Sequence[tuple[str, str, int]],
             table: np.ndarray, worker_index: int) -> tuple[str, str, list[int]]:
    odd = [rank for rank, (index, _) in enumerate(table.tolist()) if index >= 0]
    first = int(min(table[odd, 0])) if odd else 0
    count = int(max(table[odd, 1])) if odd else 0
    # Named by this worker's own path: Keras numbers layer names per process, so the chief's
    # `sequential_29` may be this worker's `sequential_26` (variables are compared by position).
    named = own if first < min(len(own), len(chief)) else chief
    if first < len(named):
        name = named[first][0]
        variable = f"{name} ({named[first][1]})"
    else:
        name = variable = f"variable #{first + 1} (the chief has {len(chief)})"
    if len(table) == 2:
        who = "worker 0 (the chief) and worker 1 hold different values"
    else:
        who = (f"worker(s) {', '.join(map(str, odd))} hold values different from the chief's "
               "(worker 0)")
    message = (
        f"keras_mwms worker {worker_index}: the workers' variables differ after {where}: "
        f"{who} of {variable} ({count} variable(s) differ; this is the first in the model's "
        "weights, then the optimizer's variables). Synchronous training keeps every worker "
        "bit-identical, so something changed state on some workers only: a callback or custom "
        "code that writes variables on one worker, a variable created outside "
        "strategy.scope(), or a keras_mwms bug (please report it with this message). "
        f"Every worker raised this error; {ENABLE_ENV}=0 turns the check off.")
    return message, name, odd


def model_state(model: Any) -> list[tuple[str, np.ndarray]]:
    """`(path, value)` of the model's weights, then its optimizer's variables (this worker's copy)."""
    from keras import ops

    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        # Gradient accumulators hold each worker's own share of a window until it is reduced.
        local = {id(variable) for variable in optimizer_attributes.accumulated_gradients(optimizer)}
        variables += [variable for variable in optimizer.variables if id(variable) not in local]
    return [(variable.path, np.asarray(ops.convert_to_numpy(variable.value))) for variable in variables]


def check_model(port: Any, model: Any, where: str) -> None:
    """`check_workers_agree` over `model_state(model)`; nothing at all on one worker."""
    if port.num_workers > 1 and enabled():
        check_workers_agree(port, model_state(model), where)
