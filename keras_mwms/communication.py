"""Which collective engine to use: `CommunicationImplementation` and `CommunicationOptions`.

The names follow `tf.distribute.experimental`. One rule decides RING or NCCL for every backend
(`keras_mwms.backends.policy.choose_implementation`); each backend's
`resolve_engine(implementation, gpu_count)` names the real engine that answer means:

| request | TensorFlow              | JAX                  | torch              |
|---------|-------------------------|----------------------|--------------------|
| AUTO    | TF collectives (NCCL on GPU, RING on CPU) | NCCL on GPU, gloo on CPU | nccl with CUDA, gloo otherwise |
| RING    | TF gRPC ring            | gloo                 | gloo               |
| NCCL    | NCCL; on CPU a warning and RING | NCCL; on CPU a warning and gloo | nccl; without CUDA a clear error |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from keras_mwms import settings

RENDEZVOUS_TIMEOUT_ENV = settings.RENDEZVOUS_TIMEOUT.name
JAX_PATH_ENV = settings.JAX_PATH.name
TORCH_OVERLAP_ENV = settings.TORCH_OVERLAP.name
TORCH_FUSED_ADAM_ENV = settings.TORCH_FUSED_ADAM.name
HANG_REPORT_ENV = settings.HANG_REPORT_SECONDS.name
COMPRESSION_ENV = settings.COMPRESSION.name
COMPRESSIONS = ("bf16", "fp16")
BATCH_NORM_STATISTICS_ENV = settings.BATCH_NORM_STATISTICS.name
BATCH_NORM_STATISTICS = settings.BATCH_NORM_STATISTICS.choices
JAX_PATHS = settings.JAX_PATH.choices
# The fields a KERAS_MWMS_* variable fills when they are left as None (Keras' precedence).
FILLED_FROM_ENVIRONMENT = {
    "rendezvous_timeout_seconds": settings.RENDEZVOUS_TIMEOUT,
    "jax_path": settings.JAX_PATH,
    "torch_overlap": settings.TORCH_OVERLAP,
    "torch_fused_adam": settings.TORCH_FUSED_ADAM,
    "hang_report_seconds": settings.HANG_REPORT_SECONDS,
    "compression": settings.COMPRESSION,
    "batch_norm_statistics": settings.BATCH_NORM_STATISTICS,
}


class CommunicationImplementation(enum.Enum):
    """The collective engine family requested by the user.

    Example:

    >>> CommunicationImplementation["RING"]
    <CommunicationImplementation.RING: 'RING'>
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclass(frozen=True)
class CommunicationOptions:
    """How workers talk: engine, collective timeout, packing; mirrors `tf.distribute.experimental.CommunicationOptions`.

    An argument left as None is filled from its `KERAS_MWMS_*` environment variable, else
    its default (Keras' precedence: argument > environment > default; the docs' table of
    variables lists them); an argument you pass wins over the environment.

    Example:

    >>> options = CommunicationOptions(implementation=CommunicationImplementation.RING,
    ...                                timeout_seconds=60)
    >>> options.implementation.value, options.timeout_seconds
    ('RING', 60.0)

    Args:
        bytes_per_pack: split gradients into all-reduce packs of about this many bytes
            (0: the backend's default packing).
        timeout_seconds: bound on every collective operation and on joining the backend engine;
            None uses the backend's default bound set by keras_mwms (never infinite). On JAX
            it is also the coordination service's heartbeat timeout (at least 20 s): a worker
            silent this long ends the job, named by the hang report 15 s before (its threshold
            is kept below that).
        implementation: a `CommunicationImplementation` or its name (`"AUTO"`, `"RING"`, `"NCCL"`).
        rendezvous_timeout_seconds: how long to wait for every worker to show up at start
            (default: `KERAS_MWMS_RENDEZVOUS_TIMEOUT`, else 120 s).
        lost_worker_exit_seconds: after a `keras_mwms.WorkerLostError`, the process ends at
            most this long later even if the backend's teardown waits for the dead peer
            (default 30 s).
        jax_path: JAX training path, `"auto"` (the fast flat step where it gives one process's
            result, else Keras' DataParallel), `"flat"` or `"dataparallel"`. The environment
            None (the default) reads `KERAS_MWMS_JAX_PATH`, else `"auto"`.
        torch_overlap: torch: all-reduce gradient buckets while the backward pass still runs
            (None: `KERAS_MWMS_TORCH_OVERLAP`, else True).
        torch_fused_adam: torch: Adam/AdamW through torch's fused kernel (faster, differs from
            one Keras process in the last bits; None: `KERAS_MWMS_TORCH_FUSED_ADAM`, else False).
        hang_report_seconds: when a worker has waited this long in one collective, every worker
            reports its collective ledger and stack and the chief prints one verdict (who is
            behind, where, doing what), then the job ends (`keras_mwms.diagnostics`); 0 turns
            hang reports off. None (the default) reads `KERAS_MWMS_HANG_REPORT_SECONDS`, else
            60 s, well below the engines' collective timeouts.
        compression: `"none"` (gradients travel in their own dtype), `"bf16"` or
            `"fp16"`: float32 gradients are cast to that 16-bit type for the gradient all-reduce
            and back (half the bytes; summed in 16 bits where the engine sums, divided in
            float32); row counts, metric states and BatchNormalization statistics stay exact
            (`keras_mwms.backends.compression`). None (the default) reads
            `KERAS_MWMS_COMPRESSION`, else `"none"`; after construction off reads None.
        batch_norm_statistics: what a `BatchNormalization` layer in training mode normalizes
            over when it was left at `synchronized=False`. `"global"` (the default): the moments
            of the whole global batch, combined across workers and weighted by rows, so N
            workers train exactly like one process (one small all-reduce per layer in the
            forward pass and one in the backward pass). `"per_worker"`: each worker normalizes
            over its own shard, as `tf.distribute` does with `synchronized=False` (no extra
            collective, but results depend on the worker count); the moving statistics are
            still averaged across workers, weighted by rows, so every worker keeps the same.
            `synchronized=True` always means global moments. None (the default) reads
            `KERAS_MWMS_BATCH_NORM_STATISTICS`, else `"global"`.

    Example of compression:

    >>> CommunicationOptions(compression="bf16").compression
    'bf16'

    Example of per-worker BatchNormalization statistics (speed over equivalence):

    >>> CommunicationOptions(batch_norm_statistics="per_worker").batch_norm_statistics
    'per_worker'
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    rendezvous_timeout_seconds: float | None = None
    lost_worker_exit_seconds: float = 30.0
    jax_path: str | None = None
    torch_overlap: bool | None = None
    torch_fused_adam: bool | None = None
    hang_report_seconds: float | None = None
    compression: str | None = None
    batch_norm_statistics: str | None = None

    def __post_init__(self) -> None:
        implementation = self.implementation
        if isinstance(implementation, str):
            try:
                implementation = CommunicationImplementation[implementation.upper()]
            except KeyError:
                raise ValueError(
                    f"Unknown communication implementation {self.implementation!r}. "
                    "Expected AUTO, RING or NCCL."
                ) from None
        if not isinstance(implementation, CommunicationImplementation):
            # Accept tf.distribute.experimental.CommunicationImplementation members by name.
            name = getattr(implementation, "name", None)
            if name not in CommunicationImplementation.__members__:
                raise ValueError(
                    f"implementation must be a CommunicationImplementation, got {implementation!r}"
                )
            implementation = CommunicationImplementation[name]
        object.__setattr__(self, "implementation", implementation)
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative int, got {self.bytes_per_pack!r}")
        for name, setting in FILLED_FROM_ENVIRONMENT.items():
            object.__setattr__(self, name, setting.fill(getattr(self, name)))
        for name in ("timeout_seconds", "rendezvous_timeout_seconds", "lost_worker_exit_seconds",
                     "hang_report_seconds"):
            value = getattr(self, name)
            if value is not None:
                off = name == "hang_report_seconds" and value == 0
                if isinstance(value, bool) or not isinstance(value, (int, float)) or (value <= 0 and not off):
                    raise ValueError(f"{name} must be a positive number of seconds"
                                     f"{' or 0 (off)' if name == 'hang_report_seconds' else ' or None'}, "
                                     f"got {value!r}")
                object.__setattr__(self, name, float(value))
        if self.lost_worker_exit_seconds is None:
            raise ValueError("lost_worker_exit_seconds must be a positive number of seconds, got None")
        self._check_switches()

    def _check_switches(self) -> None:
        """Validates the behaviour switches (the environment's values were checked when read)."""
        if not isinstance(self.jax_path, str) or self.jax_path.lower() not in JAX_PATHS:
            raise ValueError(f"jax_path={self.jax_path!r} is not a JAX training path; use one of "
                             f"{', '.join(JAX_PATHS)}.")
        object.__setattr__(self, "jax_path", self.jax_path.lower())
        for name in ("torch_overlap", "torch_fused_adam"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        compression = self.compression
        if not isinstance(compression, str) or compression.lower() not in ("none", *COMPRESSIONS):
            raise ValueError(f"compression={compression!r} is not a gradient compression; use 'bf16', "
                             f"'fp16' or 'none' (e.g. CommunicationOptions(compression='bf16'), or "
                             f"{COMPRESSION_ENV}=bf16).")
        object.__setattr__(self, "compression", None if compression.lower() == "none" else compression.lower())
        statistics = self.batch_norm_statistics
        if not isinstance(statistics, str) or statistics.lower().replace("-", "_") not in BATCH_NORM_STATISTICS:
            raise ValueError(f"batch_norm_statistics={statistics!r} is not a BatchNormalization statistics "
                             f"choice; use 'global' (moments of the global batch, as one process) or "
                             f"'per_worker' (each worker's shard, as tf.distribute with synchronized=False).")
        object.__setattr__(self, "batch_norm_statistics", statistics.lower().replace("-", "_"))
