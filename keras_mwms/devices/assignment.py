"""Which GPUs a worker trains on, the torchrun way and the TensorFlow way: pure rules, no ML framework.

On a host with G GPUs and N workers, every worker sees every GPU unless someone narrows
`CUDA_VISIBLE_DEVICES`. Left alone, torch trains everyone on `cuda:0` (NCCL then fails with
"Duplicate GPU detected", or one card is oversubscribed) and each JAX worker claims every GPU.
These rules decide, from what a worker can read before any engine starts:

**Worker side** (`assign_gpus`, used by every backend adapter):

1. no visible GPU → the CPU;
2. started by `keras_mwms.launch` with GPUs, or resolved by `SlurmClusterResolver` with
   `auto_set_gpu` (both set `KERAS_MWMS_GPUS_PER_WORKER` and narrow `CUDA_VISIBLE_DEVICES` to
   this worker's GPUs) → every visible GPU;
3. a local rank can be inferred — the first set of `KERAS_MWMS_LOCAL_RANK` (the launcher's),
   `LOCAL_RANK` (torchrun, PyTorchJob, Lightning), `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`
   → visible GPU `local_rank % visible` (an orchestrator that gave each task its own
   `CUDA_VISIBLE_DEVICES` leaves one visible GPU: that one);
4. otherwise TensorFlow and JAX use every visible GPU as local replicas of this worker; torch
   (one device per process) uses its only GPU, or GPU 0 in a single-worker job as plain Keras
   does, and refuses several GPUs in a multi-worker job, naming the variables to set.

**Launcher side** (`plan_launch`): `--gpus-per-worker K` gives worker i the visible GPUs
`i*K .. i*K+K-1`; `auto` (the default) is one GPU per worker when the host has at least as
many GPUs as workers; `all` lets every worker see every GPU (TensorFlow: one worker with all of
a host's GPUs as local replicas); `0` hides the GPUs (CPU training).

**Sharing** (`keras_mwms.backends.policy.exclusive_gpus_reason`): NCCL cannot run two ranks on one GPU, so when the
requested implementation means NCCL on GPUs (AUTO or NCCL on torch and TensorFlow; always on
JAX, whose GPU collectives are NCCL whatever is asked) the rendezvous refuses two workers
claiming the same physical GPU, naming both, before any engine starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from keras_mwms import settings
from keras_mwms.errors import GpuAssignmentError

LOCAL_RANK_ENV = settings.LOCAL_RANK.name
GPUS_PER_WORKER_ENV = settings.GPUS_PER_WORKER.name
# Test-only: the GPU identities this worker claims in the rendezvous, comma-separated; lets a
# CPU machine exercise the same-GPU check. Never set it on a real job.
FAKE_GPU_UUIDS_ENV = settings.FAKE_GPU_UUIDS.name
LOCAL_RANK_VARIABLES = (LOCAL_RANK_ENV, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
BACKENDS_WITH_LOCAL_REPLICAS = ("tensorflow", "jax")
SET_A_LOCAL_RANK = (
    "set the worker's index on its host in one of " + ", ".join(LOCAL_RANK_VARIABLES)
    + ", or narrow CUDA_VISIBLE_DEVICES to this worker's GPU, or start the workers with "
    "`python -m keras_mwms.launch --workers N` (one GPU each)"
)


@dataclass(frozen=True)
class GpuAssignment:
    """The GPUs one worker trains on, as indices into the GPUs this process can see.

    Example:

    >>> assignment = assign_gpus("torch", visible=4, workers=4, environ={"LOCAL_RANK": "2"})
    >>> assignment.gpus, assignment.replicas, assignment.narrows
    ((2,), 1, True)

    Args:
        backend: the Keras backend ("tensorflow", "jax", "torch").
        visible: how many GPUs this process sees (after `CUDA_VISIBLE_DEVICES`).
        gpus: the visible GPUs' indices this worker uses; empty: the CPU.
        local_rank: the inferred local rank, or None.
        reason: one sentence saying why, for logs and errors.
    """

    backend: str
    visible: int
    gpus: tuple[int, ...]
    local_rank: int | None
    reason: str

    @property
    def replicas(self) -> int:
        """Local replicas of this worker: one per GPU, one on the CPU."""
        return max(1, len(self.gpus))

    @property
    def narrows(self) -> bool:
        """True when the worker uses only some of the GPUs it sees (the backend must restrict)."""
        return 0 < len(self.gpus) < self.visible


def infer_local_rank(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """`(local rank, variable)` from the first of `LOCAL_RANK_VARIABLES` that is set, else None.

    Example:

    >>> infer_local_rank({"SLURM_LOCALID": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    (3, 'SLURM_LOCALID')
    >>> infer_local_rank({}) is None
    True
    """
    for variable in LOCAL_RANK_VARIABLES:
        text = (settings.LOCAL_RANK.text(environ) if variable == LOCAL_RANK_ENV else environ.get(variable)) or ""
        text = text.strip()
        if not text:
            continue
        try:
            rank = int(text)
        except ValueError:
            rank = -1
        if rank < 0:
            raise GpuAssignmentError(
                f"{variable}={text!r} is not a local rank: it must be this worker's index on its "
                f"host, an integer >= 0. Fix or unset {variable}.")
        return rank, variable
    return None


def assign_gpus(backend: str, visible: int, workers: int, environ: Mapping[str, str]) -> GpuAssignment:
    """The GPUs this worker trains on (see the module docstring's worker-side rules).

    Example:

    >>> assign_gpus("jax", visible=8, workers=2, environ={}).gpus
    (0, 1, 2, 3, 4, 5, 6, 7)
    >>> assign_gpus("torch", visible=8, workers=8, environ={"OMPI_COMM_WORLD_LOCAL_RANK": "5"}).gpus
    (5,)

    Args:
        backend: the Keras backend name.
        visible: GPUs this process sees.
        workers: workers of the whole job (1: a single-worker job).
        environ: the process environment (or a fake one, in tests).

    Raises:
        GpuAssignmentError: torch sees several GPUs in a multi-worker job and no local rank is
            set, the launcher gave a torch worker several GPUs, or a local rank is malformed.
    """
    if visible <= 0:
        return GpuAssignment(backend, 0, (), None, "no GPU is visible: the CPU")
    every = tuple(range(visible))
    launcher_share = settings.GPUS_PER_WORKER.read(environ) or ""
    found = infer_local_rank(environ)
    local_rank = found[0] if found else None
    if launcher_share:
        if backend == "torch" and visible > 1:
            raise GpuAssignmentError(
                f"keras_mwms.launch gave this torch worker {visible} GPUs "
                f"({GPUS_PER_WORKER_ENV}={launcher_share}), but torch trains on one device per "
                "process: use --gpus-per-worker 1 (the default) and one worker per GPU.")
        return GpuAssignment(backend, visible, every, local_rank,
                             f"keras_mwms.launch gave this worker {visible} GPU(s)")
    if found is not None:
        rank, variable = found
        index = rank % visible
        shared = " (more local workers than GPUs: workers share GPUs)" if rank >= visible else ""
        return GpuAssignment(backend, visible, (index,), rank,
                             f"{variable}={rank}: visible GPU {index} of {visible}{shared}")
    if backend in BACKENDS_WITH_LOCAL_REPLICAS:
        return GpuAssignment(backend, visible, every, None,
                             f"no local rank set: all {visible} visible GPU(s) as local replicas")
    if visible == 1:
        return GpuAssignment(backend, 1, (0,), None, "the one visible GPU")
    if workers == 1:
        return GpuAssignment(backend, visible, (0,), None,
                             f"one worker: GPU 0 of {visible}, as plain Keras")
    raise GpuAssignmentError(
        f"This {backend} worker sees {visible} GPUs but no local rank, and torch trains on one "
        f"device per process, so keras_mwms cannot tell which GPU is this worker's: "
        f"{SET_A_LOCAL_RANK}.")


# -- the launcher ---------------------------------------------------------------------------

AUTO, ALL = "auto", "all"


def parse_gpus_per_worker(text: str) -> str | int:
    """`--gpus-per-worker`: "auto", "all" or a count >= 0.

    Example:

    >>> parse_gpus_per_worker("2"), parse_gpus_per_worker("ALL")
    (2, 'all')
    """
    lowered = str(text).strip().lower()
    if lowered in (AUTO, ALL):
        return lowered
    try:
        count = int(lowered)
    except ValueError:
        count = -1
    if count < 0:
        raise GpuAssignmentError(f"--gpus-per-worker {text!r}: expected 'auto', 'all' or a "
                                 "number of GPUs >= 0 (0: train on the CPU).")
    return count


def plan_launch(backend: str, workers: int, gpus: Sequence[str],
                gpus_per_worker: str | int = AUTO) -> list[str] | None:
    """Each local worker's `CUDA_VISIBLE_DEVICES`, or None to leave the environment alone (no GPU).

    `gpus` are the host's visible GPUs as `CUDA_VISIBLE_DEVICES` names them (indices or UUIDs).

    Example:

    >>> plan_launch("torch", 2, ["0", "1", "2", "3"])
    ['0', '1']
    >>> plan_launch("tensorflow", 2, ["0", "1", "2", "3"], gpus_per_worker=2)
    ['0,1', '2,3']
    >>> plan_launch("jax", 2, []) is None
    True

    Raises:
        GpuAssignmentError: more GPUs asked for than the host has, several GPUs per torch
            worker, or GPUs asked for (a number or `all`) where none is visible.
    """
    available = len(gpus)
    if gpus_per_worker == 0:
        return [""] * workers
    if available == 0:
        if gpus_per_worker == AUTO:
            return None
        # `all` asks for GPUs as much as a number does: training on the CPU instead would be silent.
        raise GpuAssignmentError(
            f"--gpus-per-worker {gpus_per_worker}, but this host shows no GPU (CUDA_VISIBLE_DEVICES "
            "is empty, or nvidia-smi lists none). Drop --gpus-per-worker (or pass 0) to train on "
            "the CPU.")
    if gpus_per_worker == ALL:
        if backend == "torch" and available > 1:
            raise GpuAssignmentError(
                f"--gpus-per-worker all would give every torch worker all {available} GPUs, but "
                "torch trains on one device per process: use --gpus-per-worker 1 (the default).")
        return [",".join(gpus)] * workers
    if gpus_per_worker == AUTO:
        if available < workers:
            raise GpuAssignmentError(
                f"--workers {workers} on a host with {available} GPU(s) ({', '.join(gpus)}): each "
                "worker needs its own GPU for NCCL. Start at most "
                f"{available} worker(s), or pass --gpus-per-worker all to let workers share GPUs "
                "(CommunicationImplementation.RING on torch and TensorFlow only), or "
                "--gpus-per-worker 0 to train on the CPU.")
        gpus_per_worker = 1
    if backend == "torch" and gpus_per_worker > 1:
        raise GpuAssignmentError(
            f"--gpus-per-worker {gpus_per_worker}: torch trains on one device per process; use "
            "--gpus-per-worker 1 and one worker per GPU (TensorFlow and JAX can take several).")
    if gpus_per_worker * workers > available:
        raise GpuAssignmentError(
            f"--gpus-per-worker {gpus_per_worker} × --workers {workers} = "
            f"{gpus_per_worker * workers} GPUs, but this host has {available} "
            f"({', '.join(gpus)}). Lower --workers or --gpus-per-worker, or make more GPUs "
            "visible (CUDA_VISIBLE_DEVICES).")
    return [",".join(gpus[i * gpus_per_worker:(i + 1) * gpus_per_worker]) for i in range(workers)]
