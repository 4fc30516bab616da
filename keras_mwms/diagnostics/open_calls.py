"""Which `fit` / `evaluate` loops are still open: begun and not ended normally.

A worker whose script ends tells its peers it *left* the job (the watchdog's leaving
announcement), so that a collective the others enter later — `if strategy.is_chief:
model.evaluate(...)` — gets its verdict at once. A worker whose `fit` died mid-loop (a callback
raised, the script caught the error and exited) has not left between calls: its peers are still
in that loop and must learn of a *lost* worker, as the engine tells them. Keras calls
`CallbackList.on_train_end` / `on_test_end` only when the loop ends normally, so a loop begun
and not ended is one the worker left by an error; `LEDGER.open_calls` counts them (nested:
fit's validation runs an evaluate loop inside the fit loop).

>>> from keras_mwms.diagnostics.ledger import Ledger
>>> ledger = Ledger(enabled=True)
>>> _opened(ledger); _opened(ledger); _closed(ledger); ledger.open_calls
1
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from keras_mwms.backends.keras_api import targets
from keras_mwms.backends.patches import Patch
from keras_mwms.diagnostics.ledger import LEDGER, Ledger


def _opened(ledger: Ledger = LEDGER) -> None:
    ledger.open_calls += 1


def _closed(ledger: Ledger = LEDGER) -> None:
    ledger.open_calls = max(ledger.open_calls - 1, 0)


def _counting(change: Callable[[], None]) -> Callable[[Callable], Callable]:
    def replacement(original: Callable) -> Callable:
        @functools.wraps(original)
        def hook(self, *args, **kwargs):
            change()
            return original(self, *args, **kwargs)

        return hook

    return replacement


_WHY = ("Keras has no hook telling whether a fit/evaluate loop ended normally: a worker that "
        "left mid-loop by an error must not announce leaving between calls (its peers learn of a "
        "lost worker instead of a call made on some workers only)")

PATCHES = [Patch(name=f"ledger-{str(target).rpartition('.')[2].replace('_', '-')}", target=target,
                 replacement=_counting(change), works_around=_WHY)
           for target, change in ((targets.CALLBACK_LIST_ON_TRAIN_BEGIN, _opened),
                                  (targets.CALLBACK_LIST_ON_TRAIN_END, _closed),
                                  (targets.CALLBACK_LIST_ON_TEST_BEGIN, _opened),
                                  (targets.CALLBACK_LIST_ON_TEST_END, _closed))]
