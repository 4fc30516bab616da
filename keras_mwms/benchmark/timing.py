"""Turning step timestamps into steps/s, examples/s, first-step and start-up times.

A fit is timed by the perf_counter at the end of every step (Keras' callback list converts
the logs to Python numbers there, so the step has really finished, also on JAX). Steps/s is
1 ÷ the median step time after `warmup_steps` (tracing, compilation, allocation): on a shared
machine, other processes' bursts inflate a few steps a lot, and the median ignores them. The
mean rate (timed steps ÷ the time from the end of the warm-up to the fit's return) is kept as
`mean_steps_per_second`. Start-up is measured from the moment the
driver launched the worker process (`KERAS_MWMS_BENCH_LAUNCHED_AT`, wall clock) to the end of
the first training step: imports, joining the cluster, building, compiling and one step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from keras_mwms import settings

LAUNCHED_AT_ENV = settings.BENCH_LAUNCHED_AT.name


@dataclass
class FitTiming:
    """One timed fit of one variant.

    Example:

    >>> timing = FitTiming.from_times("keras_mwms", "mlp", 0, [1.0, 1.5, 2.0, 2.5, 4.5], 4.5,
    ...                               setup_started=0.5, warmup_steps=1, global_batch=64)
    >>> timing.steps_per_second, timing.examples_per_second, timing.mean_steps_per_second
    (2.0, 128.0, 1.1428571428571428)
    >>> timing.first_step_seconds, timing.timed_steps
    (0.5, 4)
    """

    variant: str
    model: str
    repeat: int
    steps_per_second: float
    examples_per_second: float
    mean_steps_per_second: float
    first_step_seconds: float
    timed_steps: int
    global_batch: int
    startup_seconds: float | None = None
    graph_breaks: int | None = None   # torch.compile'd variants: TorchDynamo's graph breaks in fit
    recompile_limit_hits: int | None = None   # and the functions it stopped compiling (`graph_breaks`)

    @classmethod
    def from_times(cls, variant: str, model: str, repeat: int, step_ends: list[float], finished: float,
                   setup_started: float, warmup_steps: int, global_batch: int) -> FitTiming:
        """From perf_counter step ends, the fit's return time and its set-up start."""
        if warmup_steps < 1 or len(step_ends) <= warmup_steps + 1:
            raise ValueError(f"{variant}: {len(step_ends)} steps were timed with {warmup_steps} warm-up "
                             "steps; at least one warm-up step and two timed steps are needed")
        timed = step_ends[warmup_steps - 1:]
        durations = [later - earlier for earlier, later in zip(timed[:-1], timed[1:])]
        steps_per_second = 1.0 / statistics.median(durations)
        mean_steps_per_second = len(durations) / (finished - timed[0])
        return cls(variant, model, repeat, steps_per_second, steps_per_second * global_batch,
                   mean_steps_per_second, step_ends[0] - setup_started, len(durations), global_batch)

    def to_dict(self) -> dict:
        return asdict(self)


def seconds_since_launch(now_perf_counter: float) -> float | None:
    """Wall seconds from the driver's launch of this process to `now_perf_counter`, if known."""
    launched = settings.BENCH_LAUNCHED_AT.read()
    if launched is None:
        return None
    return time.time() - (time.perf_counter() - now_perf_counter) - launched
