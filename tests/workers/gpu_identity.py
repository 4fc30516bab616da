"""One worker of the same-GPU rendezvous check (tests/test_gpu_assignment.py), on any backend.

`KERAS_MWMS_FAKE_GPU_UUIDS` makes this worker claim GPUs in the rendezvous while it trains on
the CPU. Argument: the CommunicationImplementation (AUTO, RING, NCCL) and the output folder.
Creates the strategy (the rendezvous refuses a shared GPU under NCCL, before any engine starts),
then trains a small model for 4 steps and writes `<out>/w<index>.npz`. Prints
`RESULT ok <seconds>` or `RESULT error <seconds> <message>` and exits 1 on an error.
"""

import os
import sys
import time

import keras  # noqa: E402  (imported first: the timing below is the strategy's start-up alone)
import numpy as np  # noqa: E402
from common import REPO, worker_index  # noqa: F401  (puts the repo on sys.path)

import keras_mwms  # noqa: E402
from keras_mwms.backends import backend_class  # noqa: E402
from keras_mwms.startup.rendezvous import RendezvousError  # noqa: E402

implementation, out = sys.argv[1], sys.argv[2]
backend_class(keras.backend.backend())
started = time.monotonic()
try:
    strategy = keras_mwms.MultiWorkerMirroredStrategy(
        keras_mwms.CommunicationOptions(implementation=implementation))
except RendezvousError as error:
    print(f"RESULT error {time.monotonic() - started:.2f} {error}", flush=True)
    sys.exit(1)
startup = time.monotonic() - started

from common import mlp, regression_data  # noqa: E402

x, y = regression_data(64)
with strategy.scope():
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
os.makedirs(out, exist_ok=True)
np.savez(os.path.join(out, f"w{strategy.worker_index}.npz"), *model.get_weights())
print(f"RESULT ok {startup:.2f} replicas={strategy.num_replicas_in_sync}", flush=True)
