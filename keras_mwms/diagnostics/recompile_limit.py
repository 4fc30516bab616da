"""TorchDynamo's recompile-limit hits, read from the one log line torch writes at each (no torch import).

Once a `torch.compile`d function has `torch._dynamo.config.recompile_limit` cache entries (8),
TorchDynamo stops compiling it and the function runs eagerly from then on. torch says so only
in one WARNING on the logger `torch._dynamo.convert_frame` ("torch._dynamo hit
config.recompile_limit (8)", or `accumulated_recompile_limit`), with the limit, its value and
the function as the record's first three arguments.

`RecompileHits` is a `logging.Filter` on that logger that counts the hits while it is
installed and passes torch's record on unchanged; it runs only when TorchDynamo compiles, never
per step. Two users read it: the torch backend's one-time warning for a hit inside the train
step of a model in the scope (`keras_mwms.backends.torch.recompile_limit`), and the benchmark's
count for a block (`keras_mwms.benchmark.graph_breaks.GraphBreaks`). A user who raises torch's
dynamo log level above WARNING silences the line, and with it this count.

Example (a record as torch writes it, without torch):

>>> import logging
>>> record = logging.LogRecord(TORCH_LOGGER, logging.WARNING, __file__, 1,
...     "torch._dynamo hit config.%s (%s)\\n   function: %s", ("recompile_limit", 8, "'step'"), None)
>>> with RecompileHits() as hits:
...     _ = logging.getLogger(TORCH_LOGGER).filter(record)   # the filters a logged record meets
>>> hits.count, str(hits.last)
(1, "'step', recompile_limit (8)")
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

TORCH_LOGGER = "torch._dynamo.convert_frame"
_HIT = "torch._dynamo hit config."     # the start of torch's message


@dataclass(frozen=True)
class Hit:
    """One hit: which limit (`recompile_limit` or `accumulated_recompile_limit`), its value, the function."""

    limit: str
    value: str
    function: str

    def __str__(self) -> str:
        return f"{self.function}, {self.limit} ({self.value})"


def read_hit(record: logging.LogRecord) -> Hit | None:
    """The hit `record` reports, or None for any other record of TorchDynamo's logger."""
    if not (isinstance(record.msg, str) and record.msg.startswith(_HIT)):
        return None
    args = record.args if isinstance(record.args, tuple) and len(record.args) >= 3 else ("limit", "?", "?")
    return Hit(*(str(arg) for arg in args[:3]))


class RecompileHits(logging.Filter):
    """Counts the hits (`count`, `last`) while installed, calling `on_hit(hit)` at each.

    `install()` is idempotent; as a context manager it is installed for the block only.
    """

    def __init__(self, on_hit: Callable[[Hit], None] | None = None) -> None:
        super().__init__()
        self.count = 0
        self.last: Hit | None = None
        self._on_hit = on_hit

    def filter(self, record: logging.LogRecord) -> bool:
        hit = read_hit(record)
        if hit is not None:
            self.count += 1
            self.last = hit
            if self._on_hit is not None:
                self._on_hit(hit)
        return True

    def install(self) -> RecompileHits:
        torch_logger = logging.getLogger(TORCH_LOGGER)
        if self not in torch_logger.filters:
            torch_logger.addFilter(self)
        return self

    def remove(self) -> None:
        logging.getLogger(TORCH_LOGGER).removeFilter(self)

    def __enter__(self) -> RecompileHits:
        return self.install()

    def __exit__(self, *exc) -> bool:
        self.remove()
        return False
