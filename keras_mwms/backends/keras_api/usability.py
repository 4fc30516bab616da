"""Can keras_mwms run on the installed Keras? Answered before the workers meet.

`require_usable(backend)` runs first in `MultiWorkerMirroredStrategy.__init__`, before the
rendezvous: it resolves every private Keras name the backend needs (every `Target` of
`keras_mwms.backends.keras_api.targets`, the private methods and properties the accessors of
`attributes` call included; instance attributes exist only on built objects, and
`tests/test_keras_api.py` reads those on real ones) and checks the Keras and backend releases
(`keras_mwms.backends.patches.require_supported_versions`). A release keras_mwms cannot serve
fails every worker within seconds, naming the release, what it lacks and the override, instead
of after the rendezvous or in the middle of the first `fit`.

Example:

>>> missing_names("jax")        # the installed Keras has every name keras_mwms uses
[]
>>> require_usable("torch")     # silent inside the supported range
"""

from __future__ import annotations

from keras_mwms import settings
from keras_mwms.backends import patches
from keras_mwms.backends.keras_api import targets
from keras_mwms.errors import KerasVersionError


def missing_names(backend: str) -> list[str]:
    """The private Keras names `backend` needs that the installed Keras lacks, each with how
    keras_mwms looks for it."""
    return [f"{target} ({target.anchor.found_as})" for target in targets.ALL
            if backend in target.needed_by and target not in targets.OPTIONAL and not target.exists()]


def require_usable(backend: str) -> None:
    """Raises `KerasVersionError` unless keras_mwms can serve the installed Keras on `backend`.

    Names missing are an error even with `KERAS_MWMS_ALLOW_UNTESTED_KERAS=1` (no patch could
    be applied); a release outside the range with every name present is an error without it
    and one warning per process with it.
    """
    missing = missing_names(backend)
    if missing:
        override = settings.ALLOW_UNTESTED_KERAS.read()
        raise KerasVersionError(
            f"keras_mwms cannot run on Keras {patches.installed_version('keras')} with the {backend} "
            f"backend: it lacks {len(missing)} private name(s) keras_mwms relies on: {'; '.join(missing)}. "
            f"Install a supported release (pip install 'keras>={patches.SUPPORTED_KERAS[0]},"
            f"<{patches.next_minor(patches.SUPPORTED_KERAS[-1])}'; tested: "
            f"{', '.join(patches.TESTED_KERAS)})"
            + (f"; {patches.ALLOW_UNTESTED_ENV}=1 cannot help while these are missing." if override else
               f", and report the release you use; {patches.ALLOW_UNTESTED_ENV}=1 tries other releases "
               "that have every name."))
    patches.require_supported_versions(backend)
