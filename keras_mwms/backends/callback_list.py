"""One hook where Keras collects a call's callbacks, on every backend: `CallbackList.__init__`.

Every `fit`, `evaluate` and `predict` of the three Keras trainers (and a custom loop that
builds a `keras.callbacks.CallbackList` itself) hands the user's callbacks to
`CallbackList.__init__`, which flattens them and gives each the model before any hook runs.
While installed, the row `worker-aware-keras-callbacks` passes them first through the
conversion the facade installed it with (`keras_mwms.callbacks.worker_aware.worker_aware`:
Keras' own file-writing callbacks become keras_mwms' chief-aware ones), so the policy lives in
one place instead of in each backend's `fit` wrapper. The strategy sets the conversion and
installs the row when it is created (with its other tables, `keras_mwms.active.Session`), and
`close()` removes both. The conversion sees every list, an empty one too, so what it adds on
every worker (`keras_mwms.callbacks.agreement`) is there on every worker.

Example (a stand-in conversion; the facade sets the real one):

>>> import keras
>>> convert_with(lambda callbacks: [keras.callbacks.History()]); PATCHES.install()
>>> [type(c).__name__ for c in keras.callbacks.CallbackList([keras.callbacks.EarlyStopping()]).callbacks]
['History']
>>> PATCHES.uninstall(); convert_with(None)
>>> [type(c).__name__ for c in keras.callbacks.CallbackList([keras.callbacks.EarlyStopping()]).callbacks]
['EarlyStopping']
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from keras_mwms import active
from keras_mwms.backends.keras_api import targets
from keras_mwms.backends.patches import Patch, PatchTable

_conversion: Callable[[list], list] | None = None


def convert_with(conversion: Callable[[list], list] | None) -> None:
    """While `PATCHES` is installed, every `CallbackList` built passes its callbacks through
    `conversion` (None: unchanged)."""
    global _conversion
    _conversion = conversion


active.register(__name__, "_conversion", reset=lambda: convert_with(None), state=lambda: _conversion)


def _converting_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if _conversion is not None:   # an empty list too: every worker's list gets what it adds
            bound.arguments["callbacks"] = _conversion(bound.arguments.get("callbacks") or [])
        original(*bound.args, **bound.kwargs)

    return __init__


PATCHES = PatchTable("callbacks", [Patch(
    name="worker-aware-keras-callbacks",
    target=targets.CALLBACK_LIST_INIT,
    replacement=_converting_init,
    works_around="Keras' own ModelCheckpoint, BackupAndRestore, CSVLogger and TensorBoard write the "
                 "user's path on every worker: HDF5 'unable to lock file' crashes, every CSV row and "
                 "event file once per worker",
    parameters=("callbacks",),
)])
