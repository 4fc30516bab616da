"""The diagnostics' Keras patches, one table: batch timing and the epoch-end straggler report.

Installed with the hang watchdog when a job has several workers (`Backend.start_diagnostics`).

Example:

>>> [row.name for row in PATCHES]
['ledger-data-wait', 'ledger-epoch-report']
"""

from __future__ import annotations

from keras_mwms.backends.patches import PatchTable
from keras_mwms.diagnostics import data_wait, straggler

PATCHES = PatchTable("diagnostics", [data_wait.PATCH, straggler.PATCH])
