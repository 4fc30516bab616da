"""Times every batch a `keras.utils.PyDataset` makes, for the ledger: the data phase.

Keras turns a `PyDataset` into batches through `PyDatasetAdapter._get_iterator` on every
backend (torch and JAX iterate it on the main thread; TensorFlow's `from_generator` on a
thread of its own, ahead of the step). `PATCH` wraps that iterator so each `next()` is a
`Ledger.data(batch)` interval: the hang report sees "making batch 5 for 30 s", and the
straggler table counts seconds spent waiting for data. (A finite PyDataset in a TensorFlow
`fit` is read by batch index instead, `keras_mwms.backends.tensorflow.data`, which times each
read the same way.) keras_mwms feeds numpy arrays to the
torch backend through a `PyDataset` as well; other inputs (tf.data, generators) are not timed.

Example:

>>> from keras_mwms.diagnostics.ledger import Ledger
>>> ledger = Ledger()
>>> list(timed_batches(iter("ab"), ledger)), ledger.data_batch
(['a', 'b'], 2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from keras_mwms.backends.keras_api import targets
from keras_mwms.backends.patches import Patch
from keras_mwms.diagnostics.ledger import LEDGER, Ledger


def timed_batches(iterator: Iterator[Any], ledger: Ledger | None = None) -> Iterator[Any]:
    """Yields what `iterator` yields, each `next()` timed as `ledger.data(batch number)`."""
    ledger = LEDGER if ledger is None else ledger
    batch = 0
    while True:
        with ledger.data(batch):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item
        batch += 1


def _timed_get_iterator(original: Callable) -> Callable:
    def _get_iterator(self, *args, **kwargs):
        return timed_batches(iter(original(self, *args, **kwargs)))

    return _get_iterator


PATCH = Patch(
    name="ledger-data-wait",
    target=targets.PY_DATASET_GET_ITERATOR,
    replacement=_timed_get_iterator,
    works_around="Keras has no hook around making a batch: the hang report and the straggler "
                 "table need the time each worker waits for its input pipeline",
)
