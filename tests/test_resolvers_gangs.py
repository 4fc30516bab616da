"""Real gangs started the way an orchestrator starts them, with no TF_CONFIG anywhere.

Every backend under every style, on localhost:

* `srun`: the `SLURM_*` variables `srun --ntasks 2` exports on one node (no Slurm here);
* `torchrun` (torch ships it) configured only by Kubeflow Trainer's `PET_*` variables, whatever the
  Keras backend: the strategy finds `RANK`/`WORLD_SIZE`/`MASTER_PORT` by itself and listens on
  `MASTER_PORT + 1 + LOCAL_RANK`, next to torchrun's own store on `MASTER_PORT`;
* `mpirun`: the `OMPI_COMM_WORLD_*` variables Open MPI exports (no MPI is installed here; JAX's
  own Open MPI detection must not get in the way);
* Kubeflow Trainer's JAX runtime: only `JAX_NUM_PROCESSES`/`JAX_PROCESS_ID`/`JAX_COORDINATOR_ADDRESS`
  (hosts exchanged at the coordinator);
* SkyPilot: a one-node task starting one process per "GPU" (`LOCAL_RANK`), `SKYPILOT_*` set.

With `ray[train]` installed (the `ray` extra), one local Ray cluster also runs the same fit under
TensorflowTrainer, TorchTrainer and JaxTrainer (`tests/workers/ray_fit.py`), Ray restarting the
group once and BackupAndRestore resuming it; without Ray those cases skip, saying so.

tests/test_two_hosts.py adds the Slurm style across two network namespaces. Each gang runs
`tests/workers/two_hosts_fit.py` (2 epochs of SGD on fixed data); the workers must end
bit-identical and within 1e-5 of one process (one reference per backend, shared), report the
resolver the strategy picked with no TF_CONFIG set, and the chief alone must log the source
once. A gang takes 11-15 s here, so the 15 runs plus 3 references cost about 4 minutes.
A last test starts two PyTorchJob-style "pods" (one process each, no LOCAL_WORLD_SIZE) that
exchange their hosts through the store rank 0 opens on MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiworker import Spawn, python_worker, run_processes, worker_env
from tests.shared_gangs import SHARED, SINGLE, Runner
from tests.workers.common import load_result, load_weights, max_weight_difference

RUN_TIMEOUT = 240
RAY_TIMEOUT = 900
GRACE_AFTER_FAILURE = 60
EQUIVALENCE_TOLERANCE = 1e-5
SOURCE_LINE = "keras_mwms: cluster of 2 workers from"

pytestmark = pytest.mark.slow


def free_port_run(count: int) -> int:
    """A port P with P .. P + count - 1 all free on localhost right now."""
    for _ in range(200):
        base = random.randrange(20000, 30000)
        sockets = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                sockets.append(probe)
                probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for probe in sockets:
                probe.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def kill_marked(marker: str) -> None:
    """Kills what is left of processes whose command line holds `marker` (torchrun's workers run
    in their own sessions, so killing torchrun's process group does not reach them)."""
    listed = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    for pid in listed.stdout.split():
        if int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


BACKENDS = [pytest.param("tensorflow", marks=pytest.mark.tensorflow),
            pytest.param("jax", marks=pytest.mark.jax),
            pytest.param("torch", marks=pytest.mark.torch)]


# The single-process reference of each backend: a job of the suite's shared process without
# TF_CONFIG (`tests/shared_gangs.py`).
for _backend in ("tensorflow", "jax", "torch"):
    SHARED.add(__name__, Runner(_backend, SINGLE), "reference", "two_hosts_fit", ["{out}"], seconds=RUN_TIMEOUT)


@pytest.fixture(scope="module")
def references(shared_runs):
    """backend -> folder of the single-process run (no orchestrator variables)."""
    return lambda backend: Path(shared_runs.folder(Runner(backend, SINGLE), __name__, "reference"))


def srun_style(backend: str, out: Path) -> list[Spawn]:
    """What `srun --ntasks 2` on one node exports (the variables our resolver reads, and more)."""
    job_id, port_base = str(random.randrange(10 ** 6, 10 ** 7)), str(free_port_run(2))
    return [Spawn(python_worker("two_hosts_fit.py", str(out)),
                  {**worker_env(backend, lean=True), "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
                   "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "2",
                   "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost",
                   "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
                   "SLURMD_NODENAME": "localhost", "KERAS_MWMS_PORT_BASE": port_base})
            for rank in (0, 1)]


def torchrun_style(backend: str, out: Path) -> list[Spawn]:
    """Kubeflow Trainer's torch runtime: `torchrun train.py` configured only by `PET_*` variables
    (torchrun reads `PET_<FLAG>` for every flag, e.g. `--nproc-per-node`), one agent process whose
    store holds MASTER_PORT."""
    pytest.importorskip("torch.distributed.run", reason="torchrun ships with torch")
    return [Spawn([sys.executable, "-m", "torch.distributed.run",
                   *python_worker("two_hosts_fit.py", str(out))[2:]],
                  {**worker_env(backend, lean=True), "PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0",
                   "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port_run(3))})]


def mpirun_style(backend: str, out: Path) -> list[Spawn]:
    """What `mpirun -np 2` (Open MPI) exports to each rank."""
    port_base = str(free_port_run(2))
    return [Spawn(python_worker("two_hosts_fit.py", str(out)),
                  {**worker_env(backend, lean=True), "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                   "OMPI_COMM_WORLD_NODE_RANK": "0", "KERAS_MWMS_PORT_BASE": port_base})
            for rank in (0, 1)]


def jax_style(backend: str, out: Path) -> list[Spawn]:
    """Kubeflow Trainer's JAX runtime: only JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_COORDINATOR_ADDRESS."""
    coordinator = f"127.0.0.1:{free_port_run(2)}"
    return [Spawn(python_worker("two_hosts_fit.py", str(out)),
                  {**worker_env(backend, lean=True), "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(rank),
                   "JAX_COORDINATOR_ADDRESS": coordinator})
            for rank in (0, 1)]


def skypilot_style(backend: str, out: Path) -> list[Spawn]:
    """A one-node SkyPilot task whose `run:` section starts one process per GPU (LOCAL_RANK each)."""
    port_base = str(free_port_run(2))
    return [Spawn(python_worker("two_hosts_fit.py", str(out)),
                  {**worker_env(backend, lean=True), "SKYPILOT_NODE_IPS": "127.0.0.1\n", "SKYPILOT_NODE_RANK": "0",
                   "SKYPILOT_NUM_NODES": "1", "SKYPILOT_NUM_GPUS_PER_NODE": "2", "LOCAL_RANK": str(rank),
                   "SKYPILOT_TASK_ID": "sky-test", "KERAS_MWMS_PORT_BASE": port_base})
            for rank in (0, 1)]


STYLES = {"srun": (srun_style, "SlurmClusterResolver", "Slurm job step"),
          "torchrun-pet": (torchrun_style, "TorchrunClusterResolver", "torchrun"),
          "mpirun": (mpirun_style, "MPIClusterResolver", "Open MPI"),
          "jax-variables": (jax_style, "JaxClusterResolver", "JAX variables"),
          "skypilot": (skypilot_style, "SkyPilotClusterResolver", "SkyPilot task")}


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_orchestrator_gang_trains_like_one_process(style, backend, tmp_path, references):
    start, resolver, source = STYLES[style]
    spawns = start(backend, tmp_path / "gang")
    try:
        ran = run_processes(spawns, timeout=RUN_TIMEOUT, grace_after_failure=GRACE_AFTER_FAILURE)
    finally:
        kill_marked(str(tmp_path / "gang"))
    assert ran.codes == [0] * len(spawns), ran.log()
    first = load_weights(tmp_path / "gang", 0)
    assert max_weight_difference(load_weights(tmp_path / "gang", 1), first) == 0.0
    delta = max_weight_difference(first, load_weights(references(backend), 0))
    print(f"\n[orchestrators] {style} / {backend}: 2 workers in {max(ran.seconds):.1f} s, "
          f"max|dw| vs one process = {delta:.3g}")
    assert delta <= EQUIVALENCE_TOLERANCE
    for index in (0, 1):
        result = load_result(tmp_path / "gang", index)
        assert (result["resolver"], result["tf_config_set"], result["num_workers"]) == (resolver, False, 2)
    # The chief (the first process, or torchrun's merged output) names the source, once.
    assert ran.outputs[0].count(SOURCE_LINE) == 1, ran.outputs[0][-4000:]
    assert source in ran.outputs[0].split(SOURCE_LINE)[1].splitlines()[0]
    if len(spawns) == 2:
        assert SOURCE_LINE not in ran.outputs[1], ran.outputs[1][-4000:]


@pytest.mark.torch
def test_pytorchjob_pods_exchange_their_hosts_through_the_masters_store(tmp_path):
    """One process per "pod" (no LOCAL_WORLD_SIZE), as a PyTorchJob starts them: each learns the
    other's host through the store rank 0 opens on MASTER_PORT. Both pods are this machine, whose
    loopback address stands for its host name."""
    master_port = free_port_run(2)
    script = ("import json, keras_mwms.resolvers as r; "
              "print('ADDRESSES', json.dumps(r.TorchrunClusterResolver().worker_addresses))")
    spawns = [Spawn([sys.executable, "-c", script, str(tmp_path)],
                    {**worker_env(lean=True), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(master_port), "KERAS_MWMS_RENDEZVOUS_TIMEOUT": "30"})
              for rank in (0, 1)]
    ran = run_processes(spawns, timeout=90, grace_after_failure=30)
    assert ran.codes == [0, 0], ran.log()
    expected = [f"{socket.gethostname()}:{master_port + 1}"] * 2
    for output in ran.outputs:
        assert f"ADDRESSES {json.dumps(expected)}" in output, output[-2000:]


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    """One local Ray cluster (2 CPUs) running a 2-worker trainer per backend: `tests/workers/ray_fit.py`."""
    pytest.importorskip("ray.train", reason="Ray Train is an optional extra: pip install 'keras-mwms[ray]'")
    out = tmp_path_factory.mktemp("ray")
    ran = run_processes([Spawn(python_worker("ray_fit.py", str(out), "tensorflow", "torch", "jax"),
                               {**worker_env(), "RAY_DEDUP_LOGS": "0"})],
                        timeout=RAY_TIMEOUT)
    return out, ran


@pytest.mark.parametrize("backend, resolver, source", [
    pytest.param("tensorflow", "TFConfigClusterResolver", "TF_CONFIG", marks=pytest.mark.tensorflow),
    pytest.param("torch", "TorchrunClusterResolver", "torch-style launcher", marks=pytest.mark.torch),
    pytest.param("jax", "RayTrainClusterResolver", "Ray Train worker group", marks=pytest.mark.jax),
])
def test_ray_train_gang_trains_like_one_process(backend, resolver, source, ray_runs, references):
    """TensorflowTrainer (Ray's TF_CONFIG), TorchTrainer (Ray's process group, joined and left to
    Ray) and JaxTrainer (RayTrainClusterResolver): 2 workers == one process, after Ray restarted
    the group once (TF, torch) and BackupAndRestore resumed; the chief's metrics reach Ray, and
    the chief of each attempt names the source once."""
    out, ran = ray_runs
    assert ran.codes == [0], ran.log(tail=12000)
    attempts = 1 if backend == "jax" else 2
    named = [line for line in ran.outputs[0].splitlines() if f"{SOURCE_LINE} {source}" in line]
    assert len(named) == attempts and all("[worker 0]" in line for line in named), named
    gang = out / backend
    reported = json.loads((gang / "ray.json").read_text())
    assert reported["error"] is None and reported["checkpoint"], reported
    first = load_weights(gang, 0)
    assert max_weight_difference(load_weights(gang, 1), first) == 0.0
    delta = max_weight_difference(first, load_weights(references(backend), 0))
    print(f"\n[ray] {backend}: trainer.fit() in {reported['seconds']:.1f} s, max|dw| vs one process = {delta:.3g}")
    assert delta <= EQUIVALENCE_TOLERANCE
    chief = load_result(gang, 0)
    assert (chief["resolver"], chief["num_workers"]) == (resolver, 2)
    assert reported["metrics"]["loss"] == pytest.approx(chief["history"]["loss"][-1], rel=1e-6)
    assert reported["metrics"]["epoch"] == 1
    if backend != "jax":   # resumed: the failed attempt left its marker, the last run only epoch 2
        assert (gang / "failed-once").exists() and len(chief["history"]["loss"]) == 1
    if backend == "torch":
        for index in (0, 1):
            assert load_result(gang, index)["group_before"] is True
            assert json.loads((gang / f"closed{index}.json").read_text())["group_after_close"] is True
