"""TensorFlow's hook for lost workers (the flow is `keras_mwms.backends.faults`).

TF notices a lost peer itself: its coordination-service heartbeats (and a user's
`timeout_seconds`) end a collective with an `UnavailableError`, `AbortedError` or
`DeadlineExceededError`, naming the peer as `/job:worker/replica:0/task:1` deep in a graph
traceback. So no check-in round is needed: `lost_ranks` reads the ranks from the error's text,
and the message quotes its telling line. Mismatched collectives ("Collective instance 177
expected type 0 and data_type 1 but got type 0 and data_type 9", an `InternalError` on every
worker) are a desync, not a lost peer: the hang report's round names it and ends the job.

Example:

>>> from keras_mwms.startup.cluster import SimpleClusterResolver
>>> resolver = SimpleClusterResolver({"worker": ["h0:1", "h1:2"]}, "worker", 0)
>>> lost_ranks("Socket closed: /job:worker/replica:0/task:1", resolver, 0)
[1]
"""

from __future__ import annotations

import re
from typing import Any

from keras_mwms.backends.faults import Faults

# How TF says two workers issued different collectives under one instance key.
_MISMATCH = "Collective instance"
_TASK_PATTERN = re.compile(r"/job:(\w+)/(?:replica:\d+/)?task:(\d+)")


def lost_ranks(text: str, resolver: Any, own_rank: int) -> list[int]:
    """The peers' ranks a TF lost-peer error names (`/job:worker/replica:0/task:N`), in order.

    When TF lists unhealthy tasks ("tasks are unhealthy (stopped sending heartbeats): ...")
    only that list counts; this worker itself is never reported.

    Example:

    >>> from keras_mwms.startup.cluster import SimpleClusterResolver
    >>> resolver = SimpleClusterResolver({"worker": ["h0:1", "h1:2", "h2:3"]}, "worker", 0)
    >>> lost_ranks("/job:worker/replica:0/task:0 saw: the following tasks are unhealthy "
    ...            "(stopped sending heartbeats): /job:worker/replica:0/task:2", resolver, 0)
    [2]
    """
    listed = text.split("unhealthy", 1)[1] if "unhealthy" in text else text
    ranks: list[int] = []
    for job, index in _TASK_PATTERN.findall(listed):
        task = (job, int(index))
        if task in resolver.group_tasks:
            rank = resolver.group_tasks.index(task)
            if rank != own_rank and rank not in ranks:
                ranks.append(rank)
    return ranks


class TensorFlowFaults(Faults):
    """Lost peers as TF's own errors name them (held as `backend.faults`)."""

    def is_lost_peer(self, error: BaseException) -> bool:
        import tensorflow as tf

        return isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError,
                                  tf.errors.DeadlineExceededError))

    def is_desync(self, error: BaseException) -> bool:
        import tensorflow as tf

        return isinstance(error, tf.errors.InternalError) and _MISMATCH in str(error)

    def lost_ranks(self, error: BaseException) -> list[int]:
        """The ranks TF's error names; where it names none, the one peer of a 2-worker job, or
        the chief when TF's own heartbeat to the coordination service (which the chief hosts)
        timed out ("Deadline Exceeded" with no collective timeout of the user's): cut off by a
        partition, a worker learns only that the chief stopped answering."""
        import tensorflow as tf

        me = self.backend.worker_index
        ranks = lost_ranks(str(error), self.backend.resolver, me)
        if ranks:
            return ranks
        if self.backend.num_workers == 2:
            return [1 - me]
        if (me != 0 and isinstance(error, tf.errors.DeadlineExceededError)
                and self.backend.collective_timeout_seconds is None):
            return [0]
        return []

    def detail(self, error: BaseException) -> RuntimeError:
        """TF's lost-peer error reduced to its telling line (TF's own error chained as the cause)."""
        text = str(error)
        reason = next((line.strip() for line in text.splitlines()
                       if "unhealthy" in line or "aborted" in line.lower()),
                      text.splitlines()[0] if text else "")
        detail = RuntimeError(f"{type(error).__name__}: {reason[:300]}")
        detail.__cause__ = error
        return detail
