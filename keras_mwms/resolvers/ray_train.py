"""`RayTrainClusterResolver`: the cluster of a Ray Train worker group, from `ray.train.get_context()`.

Ray's `TensorflowTrainer` writes `TF_CONFIG` and its `TorchTrainer` sets torchrun's variables, so
under those two the strategy needs no resolver. Its `JaxTrainer` on CPU (and a plain
`DataParallelTrainer`) sets nothing; `JaxTrainer(use_gpu=True)` only calls
`jax.distributed.initialize` (which the JAX backend then joins). This resolver reads the world
rank and size from Ray's train context, lets rank 0 pick a free port on its node and sends
`node IP:port` to every worker (`ray.train.collective.broadcast_from_rank_zero`); from there it
is `JaxClusterResolver` with that coordinator address (hosts gathered at rank 0, ports after it).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from keras_mwms.resolvers.jax_processes import JaxClusterResolver
from keras_mwms.startup.cluster import format_address


def _free_port(host: str) -> int:
    """A port free on `host` now (probed, not held: the rendezvous names it if it is taken later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class RayTrainClusterResolver(JaxClusterResolver):
    """The cluster of the Ray Train worker group this `train_loop_per_worker` runs in.

    Build it inside the loop and hand it to the strategy, on any backend (it is the one way to
    run keras_mwms under Ray's `JaxTrainer` on CPU):

    ```python
    def train_loop_per_worker(config):
        strategy = keras_mwms.MultiWorkerMirroredStrategy(
            cluster_resolver=keras_mwms.resolvers.RayTrainClusterResolver())
    ```

    Args:
        hosts: the nodes in order (ranks placed by block). Default: each worker reports its own.
        rpc_layer: protocol prefix of `master()`. Default none.
        timeout: seconds to wait for every worker's host. Default the rendezvous timeout.
    """

    members_advice = "Keep every worker of the Ray Train worker group alive"
    restart_advice = "Let Ray restart the group (RunConfig(failure_config=FailureConfig(max_failures=N)))"

    def __init__(self, hosts: str | Sequence[str] | None = None, rpc_layer: str | None = None,
                 timeout: float | None = None):
        import ray
        import ray.train
        from ray.train.collective import broadcast_from_rank_zero

        context = ray.train.get_context()
        coordinator = None
        if context.get_world_rank() == 0:
            node_ip = ray.util.get_node_ip_address()
            coordinator = format_address(node_ip, _free_port(node_ip))
        coordinator = broadcast_from_rank_zero(coordinator)
        super().__init__(hosts=hosts, rpc_layer=rpc_layer, timeout=timeout, environ={
            **os.environ, "JAX_NUM_PROCESSES": str(context.get_world_size()),
            "JAX_PROCESS_ID": str(context.get_world_rank()), "JAX_COORDINATOR_ADDRESS": coordinator})
        self.source = (f"Ray Train worker group (world rank {context.get_world_rank()} of "
                       f"{context.get_world_size()}, rank 0 at {coordinator})")
