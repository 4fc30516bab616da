"""`JaxFaults.gone` on JAX's real coordination service, with the peers taken for remote ones.

    python jax_remote_peers.py OUT      (2 workers, TF_CONFIG set; no Keras)

Both workers join `jax.distributed` (keras_mwms' `heartbeat_timeout_seconds`) and publish their
identity through `JaxFaults.publish_identity`. Each then records its peer as living on another
host (as on a real cluster), so `gone` cannot look at the peer's process:

1. worker 0 asks `gone([1])` while worker 1 lives: a remote non-chief peer is never named
   (JAX cannot tell quickly), and the answer comes at once;
2. worker 1 asks `gone([0])` while the chief lives: not named (the code before named the chief
   whenever it had not checked in yet: its `get_live_nodes` call always failed).

A remote chief that dies is not asked about here: JAX aborts every other worker at once when the
coordination service it hosts goes (worker 1 dies with "Failed to send RPC to coordination
service"), so `gone` can name it only in the moment before that abort.

Writes `OUT/w<index>.json`: {"answers": {step: [ranks, seconds]}} or {"error": ...}.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ELSEWHERE = "a-host-that-is-not-this-one"


def main(out: str) -> None:
    import jax

    from keras_mwms.backends.jax import engine
    from keras_mwms.backends.jax.faults import JaxFaults
    from keras_mwms.startup.cluster import TFConfigClusterResolver

    resolver = TFConfigClusterResolver()
    index = resolver.worker_index
    jax.distributed.initialize(coordinator_address=resolver.worker_addresses[0], num_processes=2,
                               process_id=index, initialization_timeout=60,
                               heartbeat_timeout_seconds=engine.heartbeat_timeout_seconds(60))
    faults = JaxFaults(SimpleNamespace(worker_index=index, num_workers=2, is_chief=index == 0,
                                       collective_timeout_seconds=60.0))
    faults.publish_identity()
    peer = 1 - index
    faults.peers[peer] = dict(faults.peers[peer], host=ELSEWHERE)

    def timed(ranks):
        started = time.monotonic()
        found = faults.gone(ranks)
        return [found, round(time.monotonic() - started, 2)]

    answers = {}
    if index == 0:
        answers["remote worker 1 alive"] = timed([1])
    else:
        answers["remote chief alive"] = timed([0])
    common.save_result(out, index, answers=answers)
    jax.distributed.shutdown()   # both leave together (a chief that left first would abort worker 1)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception:  # noqa: BLE001 - the test reads the error
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        common.save_result(sys.argv[1], index, error=traceback.format_exc())
        raise
