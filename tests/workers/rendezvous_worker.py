"""One worker of the rendezvous tests: plain Python, no ML backend.

Reads TF_CONFIG, runs the rendezvous with a fingerprint (FAKE_KERAS overrides the Keras
version to simulate a mismatch), then proves its port is free again by binding and listening on
it with SO_REUSEADDR, as every backend engine does (gRPC, torch's TCPStore): that fails while
any listener remains, while a connection still closing (TIME_WAIT) does not block it.
RDV_START_DELAY (seconds) makes this worker start late. Prints `RESULT ok <seconds>` or `RESULT error <seconds> <message>`.
"""

import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from keras_mwms.startup.cluster import TFConfigClusterResolver, split_address  # noqa: E402
from keras_mwms.startup.rendezvous import Rendezvous, RendezvousError  # noqa: E402

time.sleep(float(os.environ.get("RDV_START_DELAY", "0")))
started = time.monotonic()
resolver = TFConfigClusterResolver()
fingerprint = {
    "cluster": resolver.worker_addresses,
    "keras": os.environ.get("FAKE_KERAS", "3.15.1"),
    "backend": "none",
}
try:
    Rendezvous(resolver.worker_addresses, resolver.worker_index, fingerprint,
               timeout=float(os.environ.get("RDV_TIMEOUT", "20"))).run()
except RendezvousError as error:
    print(f"RESULT error {time.monotonic() - started:.2f} {error}", flush=True)
    sys.exit(1)
host, port = split_address(resolver.worker_addresses[resolver.worker_index])
with socket.socket() as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    probe.bind((host, port))
    probe.listen(1)
print(f"RESULT ok {time.monotonic() - started:.2f}", flush=True)
