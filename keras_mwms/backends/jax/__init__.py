"""keras_mwms on `KERAS_BACKEND=jax`: `JaxBackend` and its parts.

* `engine` — `jax.distributed` start-up (coordinator and gloo bound to the `TF_CONFIG` hosts),
  the training path, the collective port, `strategy.scope()`; the `JaxBackend` class;
* `faults` — the lost-worker hook (the flow is `keras_mwms.backends.faults`): which peer a
  failed collective lost, and an exit that skips JAX's shutdown barrier;
* `surface` — the tf.distribute-style `run`, `reduce`, local results and distributed datasets;
* `patches` — the private-Keras patch table (`PATCHES`);
* `data` — global batches placed for each path (rows per worker, global arrays);
* `step` — the flat train step: one flat gradient all-reduce per step, outside Keras' jit;
* `step_payload` — what that step sends: its values packed into one vector per dtype, and
  read back (pure JAX, no model).

Example:

>>> JaxBackend.name
'jax'
"""

from __future__ import annotations

from keras_mwms.backends.jax.engine import JaxBackend, resolve_engine

__all__ = ["JaxBackend", "resolve_engine"]
