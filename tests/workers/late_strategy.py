"""Uses the backend before creating the strategy (TF and JAX cannot join a cluster then); prints the outcome.

Prints `RESULT ok <replicas>` if the strategy was created and trains, else
`RESULT error <type>: <message>`. On torch, `--own-process-group` first starts a one-process
group of the script's own, which the strategy must refuse (TF_CONFIG describes more workers).
"""

import os
import sys

import common  # noqa: F401  (puts the repo on sys.path)

backend = os.environ["KERAS_BACKEND"]
if backend == "tensorflow":
    import tensorflow as tf

    print("early op", float(tf.reduce_sum(tf.ones(3))), flush=True)
elif backend == "jax":
    import jax.numpy as jnp

    print("early op", float(jnp.sum(jnp.ones(3))), flush=True)
else:
    import torch

    print("early op", float(torch.ones(3).sum()), flush=True)
    if "--own-process-group" in sys.argv:
        # A script that starts its own one-process group, not the one TF_CONFIG describes.
        import tempfile

        import torch.distributed as dist

        handle, path = tempfile.mkstemp(prefix="keras_mwms_store_")
        os.close(handle)
        store = dist.FileStore(path, 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)

import keras_mwms  # noqa: E402

try:
    strategy = keras_mwms.MultiWorkerMirroredStrategy()
except Exception as error:  # noqa: BLE001 - the outcome is what this script reports
    print(f"RESULT error {type(error).__name__}: {error}", flush=True)
    sys.exit(1)
print(f"RESULT ok {strategy.num_replicas_in_sync}", flush=True)
