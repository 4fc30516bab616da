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
import os
from dataclasses import dataclass

from keras_mwms.rendezvous import DEFAULT_TIMEOUT_SECONDS

RENDEZVOUS_TIMEOUT_ENV = "KERAS_MWMS_RENDEZVOUS_TIMEOUT"
JAX_PATH_ENV = "KERAS_MWMS_JAX_PATH"
TORCH_OVERLAP_ENV = "KERAS_MWMS_TORCH_OVERLAP"
TORCH_FUSED_ADAM_ENV = "KERAS_MWMS_TORCH_FUSED_ADAM"
HANG_REPORT_ENV = "KERAS_MWMS_HANG_REPORT_SECONDS"
COMPRESSION_ENV = "KERAS_MWMS_COMPRESSION"
COMPRESSIONS = ("bf16", "fp16")
BATCH_NORM_STATISTICS_ENV = "KERAS_MWMS_BATCH_NORM_STATISTICS"
BATCH_NORM_STATISTICS = ("global", "per_worker")
JAX_PATHS = ("auto", "flat", "dataparallel")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class CommunicationImplementation(enum.Enum):
    """The collective engine family requested by the user.

    Example:

    >>> CommunicationImplementation["RING"]
    <CommunicationImplementation.RING: 'RING'>
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


def _default_rendezvous_timeout() -> float:
    text = os.environ.get(RENDEZVOUS_TIMEOUT_ENV)
    if not text:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{RENDEZVOUS_TIMEOUT_ENV}={text!r} is not a number of seconds; set e.g. "
            f"{RENDEZVOUS_TIMEOUT_ENV}=300"
        ) from None
    if value <= 0:
        raise ValueError(f"{RENDEZVOUS_TIMEOUT_ENV} must be positive seconds, got {text!r}")
    return value


@dataclass(frozen=True)
class CommunicationOptions:
    """How workers talk: engine, collective timeout, packing; mirrors `tf.distribute.experimental.CommunicationOptions`.

    Example:

    >>> options = CommunicationOptions(implementation=CommunicationImplementation.RING,
    ...                                timeout_seconds=60)
    >>> options.implementation.value, options.timeout_seconds
    ('RING', 60.0)

    Args:
        bytes_per_pack: split gradients into all-reduce packs of about this many bytes
            (0: the backend's default packing).
        timeout_seconds: bound on every collective operation and on joining the backend engine;
            None uses the backend's default bound set by keras_mwms (never infinite).
        implementation: a `CommunicationImplementation` or its name (`"AUTO"`, `"RING"`, `"NCCL"`).
        rendezvous_timeout_seconds: how long to wait for every worker to show up at start
            (default: `KERAS_MWMS_RENDEZVOUS_TIMEOUT`, else 120 s).
        lost_worker_exit_seconds: after a `keras_mwms.WorkerLostError`, the process ends at
            most this long later even if the backend's teardown waits for the dead peer
            (default 30 s).
        jax_path: JAX training path, `"auto"` (the fast flat step where it gives one process's
            result, else Keras' DataParallel), `"flat"` or `"dataparallel"`. The environment
            variable `KERAS_MWMS_JAX_PATH` overrides it.
        torch_overlap: torch: all-reduce gradient buckets while the backward pass still runs
            (default True); `KERAS_MWMS_TORCH_OVERLAP=0` overrides it.
        torch_fused_adam: torch: Adam/AdamW through torch's fused kernel (faster, differs from
            one Keras process in the last bits; default False); `KERAS_MWMS_TORCH_FUSED_ADAM=1`
            overrides it.
        hang_report_seconds: when a worker has waited this long in one collective, every worker
            reports its collective ledger and stack and the chief prints one verdict (who is
            behind, where, doing what), then the job ends (`keras_mwms.diagnostics`); default
            60 s, well below the engines' collective timeouts; None turns hang reports off.
            `KERAS_MWMS_HANG_REPORT_SECONDS` (seconds, or 0 for off) overrides it.
        compression: None (default: gradients travel in their own dtype), `"bf16"` or
            `"fp16"`: float32 gradients are cast to that 16-bit type for the gradient all-reduce
            and back (half the bytes; summed in 16 bits where the engine sums, divided in
            float32); row counts, metric states and BatchNormalization statistics stay exact
            (`keras_mwms.backends.compression`). `KERAS_MWMS_COMPRESSION` (`bf16`, `fp16`, or
            `none`) overrides it.
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
    jax_path: str = "auto"
    torch_overlap: bool = True
    torch_fused_adam: bool = False
    hang_report_seconds: float | None = 60.0
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
        self._apply_hang_report_override()
        for name in ("timeout_seconds", "rendezvous_timeout_seconds", "lost_worker_exit_seconds",
                     "hang_report_seconds"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
                object.__setattr__(self, name, float(value))
        if self.lost_worker_exit_seconds is None:
            raise ValueError("lost_worker_exit_seconds must be a positive number of seconds, got None")
        if self.rendezvous_timeout_seconds is None:
            object.__setattr__(self, "rendezvous_timeout_seconds", _default_rendezvous_timeout())
        self._apply_switches()

    def _apply_hang_report_override(self) -> None:
        text = os.environ.get(HANG_REPORT_ENV, "").strip()
        if not text:
            return
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{HANG_REPORT_ENV}={text!r} is not a number of seconds; set e.g. "
                             f"{HANG_REPORT_ENV}=60, or 0 to turn hang reports off.") from None
        if seconds < 0:
            raise ValueError(f"{HANG_REPORT_ENV} must be >= 0 seconds (0: off), got {text!r}")
        object.__setattr__(self, "hang_report_seconds", seconds or None)

    def _apply_switches(self) -> None:
        """Validates the behaviour switches; their environment variables override them."""
        path = os.environ.get(JAX_PATH_ENV) or self.jax_path
        if str(path).lower() not in JAX_PATHS:
            source = JAX_PATH_ENV if os.environ.get(JAX_PATH_ENV) else "jax_path"
            raise ValueError(f"{source}={path!r} is not a JAX training path; use one of "
                             f"{', '.join(JAX_PATHS)}.")
        object.__setattr__(self, "jax_path", str(path).lower())
        self._apply_compression()
        self._apply_batch_norm_statistics()
        for name, env in (("torch_overlap", TORCH_OVERLAP_ENV), ("torch_fused_adam", TORCH_FUSED_ADAM_ENV)):
            text = os.environ.get(env, "").strip().lower()
            if text in _TRUE:
                object.__setattr__(self, name, True)
            elif text in _FALSE:
                object.__setattr__(self, name, False)
            elif text:
                raise ValueError(f"{env}={text!r} is not a switch; set it to 1 or 0.")
            elif not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _apply_compression(self) -> None:
        """Validates `compression`; `KERAS_MWMS_COMPRESSION` overrides it (`none` turns it off)."""
        text = os.environ.get(COMPRESSION_ENV, "").strip().lower()
        value, source = (text, COMPRESSION_ENV) if text else (self.compression, "compression")
        if value is None or value == "none":
            object.__setattr__(self, "compression", None)
            return
        if not isinstance(value, str) or value.lower() not in COMPRESSIONS:
            raise ValueError(f"{source}={value!r} is not a gradient compression; use None, 'bf16' or "
                             f"'fp16' (e.g. CommunicationOptions(compression='bf16'), or "
                             f"{COMPRESSION_ENV}=bf16; {COMPRESSION_ENV}=none turns it off).")
        object.__setattr__(self, "compression", value.lower())

    def _apply_batch_norm_statistics(self) -> None:
        """Validates `batch_norm_statistics`; left None, `KERAS_MWMS_BATCH_NORM_STATISTICS` fills it."""
        value, source = self.batch_norm_statistics, "batch_norm_statistics"
        if value is None:
            value, source = os.environ.get(BATCH_NORM_STATISTICS_ENV, "").strip() or "global", BATCH_NORM_STATISTICS_ENV
        if not isinstance(value, str) or value.lower().replace("-", "_") not in BATCH_NORM_STATISTICS:
            raise ValueError(f"{source}={value!r} is not a BatchNormalization statistics choice; use "
                             f"'global' (moments of the global batch, as one process) or 'per_worker' "
                             f"(each worker's shard, as tf.distribute with synchronized=False).")
        object.__setattr__(self, "batch_norm_statistics", value.lower().replace("-", "_"))
