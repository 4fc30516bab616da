"""BatchNormalization's moments across workers: the one replacement every backend's row uses.

Keras' `BatchNormalization._moments(inputs, mask)` gives the moments of the rows one replica
sees. Inside a step that spans several workers keras_mwms gives the global batch's moments
instead (what one process computes), unless the user chose per-worker statistics
(`policy.global_batch_norm_moments`). The decision and its order are written here once; a
backend supplies only when its step spans several replicas (`in_step`), how it sums the
moments over them (`global_moments`), and, optionally, what it does to Keras' own per-worker
moments (`per_worker`; TensorFlow keeps an empty shard finite).

Example (no strategy active: Keras' own moments, untouched):

>>> replace = moments_replacement(in_step=lambda layer, backend: True,
...                               global_moments=lambda backend, inputs, axes: "global")
>>> moments = replace(lambda layer, inputs, mask: "keras's own")
>>> moments(None, [[1.0]], None)
"keras's own"
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from keras_mwms import active
from keras_mwms.backends import policy
from keras_mwms.backends.keras_api import attributes


def moments_replacement(in_step: Callable[[Any, Any], bool],
                        global_moments: Callable[[Any, Any, tuple], tuple],
                        per_worker: Callable[[tuple, Any], tuple] | None = None) -> Callable:
    """The replacement of Keras' `BatchNormalization._moments` for one backend's patch row.

    `in_step(layer, backend)`: whether this call runs where several replicas share a step;
    `global_moments(backend, inputs, axes)`: mean and variance over every replica's rows;
    `per_worker(moments, inputs)`: Keras' own moments when per-worker statistics were chosen.
    A masked call keeps Keras' moments (a mask's rows differ per replica).
    """
    def replacement(original: Callable) -> Callable:
        # Keras' `_moments(self, inputs, mask)` (the rows' `parameters`), spelled out:
        # `inspect.signature(...).bind` is a graph break in a compiled torch step.
        @functools.wraps(original)
        def _moments(self, inputs, mask):
            backend = active.active_backend()
            if backend is None or mask is not None or not in_step(self, backend):
                return original(self, inputs, mask)
            if policy.global_batch_norm_moments(self, backend.options):
                return global_moments(backend, inputs, tuple(attributes.batch_norm_reduction_axes(self)))
            moments = original(self, inputs, mask)
            return moments if per_worker is None else per_worker(moments, inputs)

        return _moments

    return replacement
