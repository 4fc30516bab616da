"""Every `KERAS_MWMS_*` environment variable, registered and read in this one module.

Each variable is a `Setting`: its name, its type (a switch, an integer, seconds, a choice or
text), its default, what it does and which argument it fills. The rule is Keras': an explicit
argument wins, the environment fills an argument left as None, the default comes last
(`Setting.fill`). A value that cannot be read raises `keras_mwms.errors.EnvironmentVariableError`
(a `ValueError`) naming the variable, the value and the fix; the ones that describe the
cluster raise its subclass `ClusterEnvironmentError`, as the orchestrators' variables do.

Some variables are written by the launcher (or the benchmark driver) for the workers it starts;
it writes them under `Setting.name`, and the workers read them here like any other. The docs'
table of variables is generated from `SETTINGS` (`markdown_table`), and `tests/test_settings.py`
keeps the two equal.

Example:

>>> HANG_REPORT_SECONDS.fill(None, environ={"KERAS_MWMS_HANG_REPORT_SECONDS": "5"})
5.0
>>> HANG_REPORT_SECONDS.fill(30, environ={"KERAS_MWMS_HANG_REPORT_SECONDS": "5"})  # the argument wins
30
>>> HANG_REPORT_SECONDS.read(environ={})
60.0
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from keras_mwms.errors import ClusterEnvironmentError, EnvironmentVariableError

SWITCH, INTEGER, SECONDS, CHOICE, TEXT = "switch", "integer", "seconds", "choice", "text"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One `KERAS_MWMS_*` variable: how to read it, its default, and what it is for.

    Example:

    >>> setting = Setting("KERAS_MWMS_EXAMPLE", INTEGER, 1, "an example", minimum=1, fix="set it to 2.")
    >>> setting.read({"KERAS_MWMS_EXAMPLE": "4"}), setting.read({}), setting.fill(3, {"KERAS_MWMS_EXAMPLE": "4"})
    (4, 1, 3)

    Args:
        name: the variable's name.
        kind: `SWITCH` (1/0, true/false, on/off, yes/no), `INTEGER`, `SECONDS` (a number
            above 0; 0 too when `zero_turns_off`), `CHOICE` (one of `choices`, any case, `-`
            read as `_`) or `TEXT`.
        default: what `read` returns when the variable is unset or blank.
        meaning: what it does, one sentence for the docs' table (docs/messages.md).
        fills: the argument it fills when that is left as None (empty: none).
        set_by: who writes it for the processes it starts (empty: only the user).
        choices: the accepted values of a `CHOICE`.
        minimum, maximum: the accepted range of an `INTEGER`.
        zero_turns_off: a `SECONDS` value of 0 is accepted and means off.
        fix: what to do about a value that cannot be read (the end of the error message).
        error: the error class raised for such a value.
    """

    name: str
    kind: str
    default: Any
    meaning: str
    fills: str = ""
    set_by: str = ""
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    zero_turns_off: bool = False
    fix: str = ""
    error: type[EnvironmentVariableError] = EnvironmentVariableError

    def text(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's raw value, None when it is unset or blank (for messages)."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value if value is not None and value.strip() else None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable holds a (non-blank) value."""
        return self.text(environ) is not None

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The typed value in `environ` (default `os.environ`), else `default`; raises `error`."""
        text = self.text(environ)
        return self.default if text is None else self.parse(text)

    def fill(self, argument: Any, environ: Mapping[str, str] | None = None) -> Any:
        """`argument` unless it is None, else `read(environ)`: Keras' precedence."""
        return self.read(environ) if argument is None else argument

    def parse(self, text: str) -> Any:
        """`text` as this setting's type; raises `error` naming the variable, value and fix."""
        stripped = text.strip()
        if self.kind == SWITCH:
            if stripped.lower() in _TRUE + _FALSE:
                return stripped.lower() in _TRUE
            raise self._error(text, "is not a switch", "set it to 1 (on) or 0 (off).")
        if self.kind == CHOICE:
            value = stripped.lower().replace("-", "_")
            if value not in self.choices:
                raise self._error(text, "is not one of " + ", ".join(map(repr, self.choices)), self.fix)
            return value
        if self.kind == INTEGER:
            try:
                number = int(stripped)
            except ValueError:
                raise self._error(text, "is not an integer", self.fix) from None
            if (self.minimum is not None and number < self.minimum) or (self.maximum is not None
                                                                        and number > self.maximum):
                problem = (f"is outside {self.minimum}..{self.maximum}" if self.maximum is not None
                           else f"is below {self.minimum}")
                raise self._error(text, problem, self.fix)
            return number
        if self.kind == SECONDS:
            try:
                seconds = float(stripped)
            except ValueError:
                raise self._error(text, "is not a number of seconds", self.fix) from None
            if not (seconds > 0 or (self.zero_turns_off and seconds == 0)):
                raise self._error(text, "is not " + ("0 (off) or " if self.zero_turns_off else "")
                                  + "a positive number of seconds", self.fix)
            return seconds
        return stripped

    def _error(self, text: str, problem: str, fix: str) -> EnvironmentVariableError:
        return self.error(f"{self.name}={text!r} {problem}: {fix}")


SETTINGS: dict[str, Setting] = {}


def register(setting: Setting) -> Setting:
    """Adds `setting` to `SETTINGS` (once per name) and returns it.

    Example:

    >>> register(RENDEZVOUS_TIMEOUT) is SETTINGS["KERAS_MWMS_RENDEZVOUS_TIMEOUT"]
    True
    """
    known = SETTINGS.setdefault(setting.name, setting)
    if known is not setting:
        raise ValueError(f"{setting.name} is registered twice; read it through keras_mwms.settings.")
    return setting


def _describe_default(setting: Setting) -> str:
    if setting.default is None:
        return "unset"
    if setting.kind == SWITCH:
        return "1" if setting.default else "0"
    if isinstance(setting.default, float) and setting.default.is_integer():
        return str(int(setting.default))
    return str(setting.default)


def _describe_kind(setting: Setting) -> str:
    if setting.kind == CHOICE:
        return " \\| ".join(f"`{choice}`" for choice in setting.choices)
    if setting.kind == INTEGER and setting.minimum is not None:
        return f"integer ≥ {setting.minimum}" + (f", ≤ {setting.maximum}" if setting.maximum is not None else "")
    if setting.kind == SECONDS:
        return "seconds" + (" (0: off)" if setting.zero_turns_off else "")
    return setting.kind


def markdown_table() -> str:
    """The table of every variable (docs/messages.md, filled in at the site's build), generated from `SETTINGS`.

    Example:

    >>> markdown_table().splitlines()[0]
    '| variable | type | default | fills | set by | what it does |'
    """
    rows = ["| variable | type | default | fills | set by | what it does |",
            "|----------|------|---------|-------|--------|--------------|"]
    for setting in SETTINGS.values():
        fills = f"`{setting.fills}`" if setting.fills else ""
        rows.append(f"| `{setting.name}` | {_describe_kind(setting)} | {_describe_default(setting)} | {fills} "
                    f"| {setting.set_by} | {setting.meaning} |")
    return "\n".join(rows) + "\n"


_OPTIONS = "CommunicationOptions"

# Start-up: where the cluster comes from and how long to wait for it.
CLUSTER_SOURCE = register(Setting(
    "KERAS_MWMS_CLUSTER_SOURCE", CHOICE, None,
    "Which source describes the cluster, skipping the check that sources agree (unset: detect).",
    set_by="launcher (`tf_config`)", choices=("tf_config", "slurm", "torchrun", "mpi", "jax", "skypilot", "single"),
    fix="use one of them, or unset it to detect the source.", error=ClusterEnvironmentError))
RENDEZVOUS_TIMEOUT = register(Setting(
    "KERAS_MWMS_RENDEZVOUS_TIMEOUT", SECONDS, 120.0,
    "How long every worker waits for the others to show up at start.",
    fills=f"{_OPTIONS}(rendezvous_timeout_seconds=)", fix="set it to seconds, e.g. 300."))
PORT_BASE = register(Setting(
    "KERAS_MWMS_PORT_BASE", INTEGER, None,
    "First port of this job on every node under Slurm or MPI (unset: 8888 + 16 × (job id mod 1000)).",
    fills="SlurmClusterResolver(port_base=), MPIClusterResolver(port_base=)", minimum=1, maximum=65535,
    fix="Set it to the first port of this job, e.g. 20000, the same on every task.",
    error=ClusterEnvironmentError))
HOSTS = register(Setting(
    "KERAS_MWMS_HOSTS", TEXT, None,
    "The job's nodes in rank order (`node1,node2` or Slurm's `node[1-2]`), for torchrun or MPI across nodes.",
    fills="TorchrunClusterResolver(hosts=), MPIClusterResolver(hosts=)", error=ClusterEnvironmentError))

# Training: the CommunicationOptions fields the environment can fill.
JAX_PATH = register(Setting(
    "KERAS_MWMS_JAX_PATH", CHOICE, "auto", "JAX training path: the flat step where it is exact, or Keras' DataParallel.",
    fills=f"{_OPTIONS}(jax_path=)", choices=("auto", "flat", "dataparallel"),
    fix="use one of them, e.g. KERAS_MWMS_JAX_PATH=auto."))
TORCH_OVERLAP = register(Setting(
    "KERAS_MWMS_TORCH_OVERLAP", SWITCH, True, "torch: all-reduce gradient buckets while backward still runs.",
    fills=f"{_OPTIONS}(torch_overlap=)"))
TORCH_FUSED_ADAM = register(Setting(
    "KERAS_MWMS_TORCH_FUSED_ADAM", SWITCH, False,
    "torch: Adam/AdamW through torch's fused kernel (faster, differs in the last bits).",
    fills=f"{_OPTIONS}(torch_fused_adam=)"))
HANG_REPORT_SECONDS = register(Setting(
    "KERAS_MWMS_HANG_REPORT_SECONDS", SECONDS, 60.0,
    "After this long in one collective every worker reports and the chief prints one hang verdict.",
    fills=f"{_OPTIONS}(hang_report_seconds=)", zero_turns_off=True,
    fix="set it to seconds, e.g. 60, or 0 to turn hang reports off."))
COMPRESSION = register(Setting(
    "KERAS_MWMS_COMPRESSION", CHOICE, "none", "Send float32 gradients in 16 bits for the gradient all-reduce.",
    fills=f"{_OPTIONS}(compression=)", choices=("none", "bf16", "fp16"),
    fix="use bf16 or fp16, or none to turn gradient compression off."))
BATCH_NORM_STATISTICS = register(Setting(
    "KERAS_MWMS_BATCH_NORM_STATISTICS", CHOICE, "global",
    "What an unsynchronized BatchNormalization normalizes over: the global batch or each worker's shard.",
    fills=f"{_OPTIONS}(batch_norm_statistics=)", choices=("global", "per_worker"),
    fix="use 'global' (moments of the global batch, as one process) or 'per_worker' (each worker's "
        "shard, as tf.distribute with synchronized=False)."))

# Checks and diagnostics.
CHECK_WORKERS_AGREE = register(Setting(
    "KERAS_MWMS_CHECK_WORKERS_AGREE", SWITCH, True,
    "Check after `fit` and at every checkpoint that every worker holds the same variables."))
LEDGER = register(Setting(
    "KERAS_MWMS_LEDGER", SWITCH, True,
    "Record every collective call (the hang report's and straggler table's source)."))
REPORT = register(Setting(
    "KERAS_MWMS_REPORT", SWITCH, False, "Print every epoch's straggler table, not only the telling ones.",
    set_by="launcher (`--report`)"))
DIAGNOSTICS_ADDRESS = register(Setting(
    "KERAS_MWMS_DIAGNOSTICS_ADDRESS", TEXT, None, "The launcher's `host:port` where workers send hang reports.",
    set_by="launcher"))
PRELOAD = register(Setting(
    "KERAS_MWMS_PRELOAD", SWITCH, False,
    "Launcher: fork every worker and restart from one process that imported Keras once (`--preload`)."))
ALLOW_UNTESTED_KERAS = register(Setting(
    "KERAS_MWMS_ALLOW_UNTESTED_KERAS", SWITCH, False,
    "Try a Keras or backend release outside the supported range (one warning) instead of refusing."))

# Set by the launcher for its workers.
ATTEMPT = register(Setting(
    "KERAS_MWMS_ATTEMPT", INTEGER, 0, "Which start of the gang this is (0 first, then one more per restart).",
    set_by="launcher", minimum=0, fix="it counts the launcher's restarts: unset it."))
LAUNCH_PORT_BASE = register(Setting(
    "KERAS_MWMS_LAUNCH_PORT_BASE", INTEGER, None, "The launcher's `--port-base`, for the advice on a taken port.",
    set_by="launcher", minimum=1, maximum=65535, fix="it is the launcher's --port-base: unset it."))
LOCAL_WORKERS = register(Setting(
    "KERAS_MWMS_LOCAL_WORKERS", INTEGER, 1, "How many workers share this host (splits its cores and GPUs).",
    set_by="launcher", minimum=1, fix="set it to the number of workers on this host, e.g. 2."))
LOCAL_RANK = register(Setting(
    "KERAS_MWMS_LOCAL_RANK", TEXT, None,
    "This worker's index on its host; picks its GPU (before LOCAL_RANK, SLURM_LOCALID, OMPI_COMM_WORLD_LOCAL_RANK).",
    set_by="launcher"))
GPUS_PER_WORKER = register(Setting(
    "KERAS_MWMS_GPUS_PER_WORKER", TEXT, None, "The GPUs given to this worker (a count or `all`): it uses every visible one.",
    set_by="launcher, SlurmClusterResolver"))
THREADS_CHOSEN = register(Setting(
    "KERAS_MWMS_THREADS_CHOSEN", TEXT, None, "The OMP_NUM_THREADS the launcher chose (so it is not taken for the user's).",
    set_by="launcher"))

# Tests and the benchmark.
FAKE_GPU_UUIDS = register(Setting(
    "KERAS_MWMS_FAKE_GPU_UUIDS", TEXT, None,
    "Test only: the GPU identities this worker claims in the rendezvous (comma-separated); never on a real job."))
BENCH_THREADS = register(Setting(
    "KERAS_MWMS_BENCH_THREADS", INTEGER, None, "Benchmark: threads per worker (unset: cores ÷ local workers).",
    set_by="benchmark", minimum=1, fix="set it to a thread count, e.g. 2."))
BENCH_LAUNCHED_AT = register(Setting(
    "KERAS_MWMS_BENCH_LAUNCHED_AT", SECONDS, None, "Benchmark: the wall-clock time the driver started this worker.",
    set_by="benchmark", fix="it is the benchmark driver's: unset it."))
