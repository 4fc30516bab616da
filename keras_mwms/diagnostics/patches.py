"""The diagnostics' Keras patches, one table: batch timing, the epoch-end straggler report and
the fit/evaluate loops still open (`open_calls`).

Installed with the hang watchdog when a job has several workers, by the strategy's start-up
(`MultiWorkerMirroredStrategy._patch`); `close()` removes it.

Example:

>>> for row in PATCHES:
...     print(row.name)
ledger-data-wait
ledger-epoch-report
ledger-on-train-begin
ledger-on-train-end
ledger-on-test-begin
ledger-on-test-end
"""

from __future__ import annotations

from keras_mwms.backends.patches import PatchTable
from keras_mwms.diagnostics import data_wait, open_calls, straggler

PATCHES = PatchTable("diagnostics", [data_wait.PATCH, straggler.PATCH, *open_calls.PATCHES])
