"""Which GPUs a worker uses (`keras_mwms.devices.assignment`), over faked environments: no GPU needed.

Worker side: N workers × G visible GPUs × backend × which local-rank variable is set, the
launcher's narrowed environment, and the refusals. Launcher side: each worker's
`CUDA_VISIBLE_DEVICES` for `--gpus-per-worker` auto/K/all/0, and its errors. Sharing: when the
rendezvous must refuse two workers on one GPU. Identities: `CUDA_VISIBLE_DEVICES` entries
mapped to nvidia-smi's UUIDs.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from unittest import mock

import numpy as np
import pytest

from keras_mwms import devices, launch
from keras_mwms.backends.policy import exclusive_gpus_reason
from keras_mwms.communication import CommunicationImplementation as Impl
from keras_mwms.devices.assignment import (
    GPUS_PER_WORKER_ENV,
    LOCAL_RANK_VARIABLES,
    GpuAssignmentError,
    assign_gpus,
    infer_local_rank,
    parse_gpus_per_worker,
    plan_launch,
)
from tests.multiworker import REPO, GangResult, python_worker, run_gang, worker_env

BACKENDS = ("tensorflow", "jax", "torch")
WORKERS = (1, 2, 4, 8)
GPUS = (0, 1, 2, 4, 8)


@pytest.mark.parametrize("backend,workers,visible,variable", list(itertools.product(
    BACKENDS, WORKERS, GPUS, (None, *LOCAL_RANK_VARIABLES))))
def test_every_worker_of_a_host_gets_a_gpu_or_a_clear_refusal(backend, workers, visible, variable):
    """Each local rank of N workers on G GPUs: the rules of the module docstring, worker by worker."""
    chosen = []
    for rank in range(workers):
        environ = {variable: str(rank)} if variable else {}
        if visible == 0:
            assignment = assign_gpus(backend, visible, workers, environ)
            assert assignment.gpus == () and assignment.replicas == 1 and not assignment.narrows
            continue
        if variable:
            assignment = assign_gpus(backend, visible, workers, environ)
            assert assignment.gpus == (rank % visible,), assignment
            assert assignment.local_rank == rank and variable in assignment.reason
            assert ("share GPUs" in assignment.reason) == (rank >= visible)
            chosen.append(assignment.gpus[0])
        elif backend in ("tensorflow", "jax"):
            assignment = assign_gpus(backend, visible, workers, environ)
            assert assignment.gpus == tuple(range(visible)) and assignment.replicas == visible
        elif visible == 1 or workers == 1:
            assert assign_gpus(backend, visible, workers, environ).gpus == (0,)
        else:
            with pytest.raises(GpuAssignmentError) as refused:
                assign_gpus(backend, visible, workers, environ)
            message = str(refused.value)
            assert f"sees {visible} GPUs" in message and "one device per process" in message
            assert all(name in message for name in LOCAL_RANK_VARIABLES)
            assert "CUDA_VISIBLE_DEVICES" in message and "keras_mwms.launch" in message
    if variable and visible >= workers:
        assert chosen == list(range(workers)), "one GPU per worker, in local-rank order"


def test_the_launchers_variable_wins_over_the_orchestrators():
    environ = {"LOCAL_RANK": "3", "SLURM_LOCALID": "1", "KERAS_MWMS_LOCAL_RANK": "2"}
    assert infer_local_rank(environ) == (2, "KERAS_MWMS_LOCAL_RANK")
    assert infer_local_rank({"SLURM_LOCALID": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}) == (1, "SLURM_LOCALID")
    assert infer_local_rank({"LOCAL_RANK": " "}) is None


@pytest.mark.parametrize("value", ["one", "-1", "1.5"])
def test_a_malformed_local_rank_is_named(value):
    with pytest.raises(GpuAssignmentError, match=rf"LOCAL_RANK='{value}' is not a local rank.*Fix or unset LOCAL_RANK"):
        assign_gpus("torch", 2, 2, {"LOCAL_RANK": value})


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_launcher_narrowed_worker_uses_what_it_sees(backend):
    """The launcher set CUDA_VISIBLE_DEVICES to this worker's GPUs: local rank 3 must not index them."""
    environ = {GPUS_PER_WORKER_ENV: "1", "KERAS_MWMS_LOCAL_RANK": "3"}
    assert assign_gpus(backend, 1, 4, environ).gpus == (0,)
    environ = {GPUS_PER_WORKER_ENV: "2", "KERAS_MWMS_LOCAL_RANK": "3"}
    if backend == "torch":
        with pytest.raises(GpuAssignmentError, match="one device per process: use --gpus-per-worker 1"):
            assign_gpus(backend, 2, 4, environ)
    else:
        assignment = assign_gpus(backend, 2, 4, environ)
        assert assignment.gpus == (0, 1) and assignment.replicas == 2 and not assignment.narrows


# -- the launcher -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,workers,gpus,per_worker,expected", [
    ("torch", 2, ["0", "1", "2", "3"], "auto", ["0", "1"]),
    ("jax", 4, ["0", "1", "2", "3"], "auto", ["0", "1", "2", "3"]),
    ("tensorflow", 2, ["4", "5", "6", "7"], 2, ["4,5", "6,7"]),
    ("jax", 2, ["GPU-a", "GPU-b", "GPU-c", "GPU-d"], 2, ["GPU-a,GPU-b", "GPU-c,GPU-d"]),
    ("tensorflow", 1, ["0", "1", "2"], "all", ["0,1,2"]),
    ("torch", 2, ["0"], "all", ["0", "0"]),
    ("torch", 2, ["0", "1"], 0, ["", ""]),
    ("jax", 3, [], "auto", None),
    ("torch", 1, ["0", "1"], 1, ["0"]),
])
def test_launch_plans(backend, workers, gpus, per_worker, expected):
    assert plan_launch(backend, workers, gpus, per_worker) == expected


@pytest.mark.parametrize("backend,workers,gpus,per_worker,message", [
    ("torch", 4, ["0", "1"], "auto", r"--workers 4 on a host with 2 GPU\(s\).*--gpus-per-worker all.*--gpus-per-worker 0"),
    ("jax", 3, ["0", "1", "2", "3"], 2, r"--gpus-per-worker 2 × --workers 3 = 6 GPUs, but this host has 4"),
    ("torch", 2, ["0", "1", "2", "3"], 2, r"torch trains on one device per process"),
    ("torch", 2, ["0", "1"], "all", r"every torch worker all 2 GPUs"),
    ("jax", 2, [], 1, r"shows no GPU"),
    ("tensorflow", 1, [], "all", r"--gpus-per-worker all, but this host shows no GPU.*Drop --gpus-per-worker"),
])
def test_launch_refusals(backend, workers, gpus, per_worker, message):
    with pytest.raises(GpuAssignmentError, match=message):
        plan_launch(backend, workers, gpus, per_worker)


def test_gpus_per_worker_parsing():
    assert [parse_gpus_per_worker(text) for text in ("auto", "All", "0", "3")] == ["auto", "all", 0, 3]
    for bad in ("-1", "two", ""):
        with pytest.raises(GpuAssignmentError, match="expected 'auto', 'all' or a number"):
            parse_gpus_per_worker(bad)


def test_launcher_environment_per_worker(capsys):
    """`--gpus-per-worker` → each worker's CUDA_VISIBLE_DEVICES, the marker, and a launcher line."""
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "KERAS_BACKEND": "jax"}
    env = launch.gpu_worker_env(2, "2", environ)
    assert env == {0: {"CUDA_VISIBLE_DEVICES": "0,1", GPUS_PER_WORKER_ENV: "2"},
                   1: {"CUDA_VISIBLE_DEVICES": "2,3", GPUS_PER_WORKER_ENV: "2"}}
    assert "worker 0: 0,1; worker 1: 2,3" in capsys.readouterr().err
    launch.gpu_worker_env(2, "auto", environ)
    assert "2 GPU(s) left idle" in capsys.readouterr().err
    assert launch.gpu_worker_env(1, "all", environ)[0] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3",
                                                          GPUS_PER_WORKER_ENV: "all"}
    with mock.patch.object(devices, "nvidia_smi_gpus", return_value=[]):
        assert launch.gpu_worker_env(2, "auto", {"KERAS_BACKEND": "torch"}) == {}


def test_launcher_gang_sets_each_workers_local_rank_and_gpus():
    gang = launch.Gang(["true"], workers=2, worker_env={1: {"CUDA_VISIBLE_DEVICES": "1"}})
    assert [gang._environment(index)["KERAS_MWMS_LOCAL_RANK"] for index in (0, 1)] == ["0", "1"]
    assert gang._environment(1)["CUDA_VISIBLE_DEVICES"] == "1"


def test_launcher_cli_refuses_more_gpus_than_the_host_has(capsys):
    with mock.patch.dict("os.environ", {"CUDA_VISIBLE_DEVICES": "0,1", "KERAS_BACKEND": "jax"}):
        with pytest.raises(SystemExit) as stopped:
            launch.main(["--workers", "2", "--gpus-per-worker", "2", "-m", "json.tool"])
    assert stopped.value.code == 2
    assert "--gpus-per-worker 2 × --workers 2 = 4 GPUs, but this host has 2 (0, 1)" in capsys.readouterr().err


# -- sharing a GPU --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("requested", list(Impl))
@pytest.mark.parametrize("gpus", [0, 1, 2])
def test_when_workers_must_not_share_a_gpu(backend, requested, gpus):
    reason = exclusive_gpus_reason(backend, requested, gpus)
    if gpus == 0:
        assert reason is None
    elif backend == "jax":
        assert "JAX runs collectives between GPUs with NCCL" in reason and f"Implementation.{requested.name};" in reason
    elif requested is Impl.RING:
        assert reason is None
    else:
        assert reason.startswith(f"CommunicationImplementation.{requested.name} ")
        assert "Duplicate GPU" in reason and "RING" in reason and "LOCAL_RANK" in reason


# -- identities -----------------------------------------------------------------------------------

SMI = [("0", "GPU-aaaa"), ("1", "GPU-bbbb"), ("2", "GPU-cccc")]


def test_visible_gpus_are_named_by_uuid():
    with mock.patch.object(devices, "nvidia_smi_gpus", return_value=SMI):
        assert devices.visible_gpu_identities({}) == ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
        assert devices.visible_gpu_identities({"CUDA_VISIBLE_DEVICES": "2,0"}) == ["GPU-cccc", "GPU-aaaa"]
        assert devices.visible_gpu_identities({"CUDA_VISIBLE_DEVICES": "MIG-x,GPU-bbbb"}) == ["MIG-x", "GPU-bbbb"]
        assert devices.visible_gpu_identities({"CUDA_VISIBLE_DEVICES": "-1"}) == []
        assert devices.visible_gpu_names({}) == ["0", "1", "2"]
    with mock.patch.object(devices, "nvidia_smi_gpus", return_value=[]):
        assert devices.visible_gpu_identities({"CUDA_VISIBLE_DEVICES": "3"})[0].endswith("/gpu3")


def test_nvidia_smi_listing_is_parsed():
    listing = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1b2c3d4e-0000-1111-2222-333344445555)\n"
               "  MIG 1g.10gb     Device  0: (UUID: MIG-aaaa)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-99)\n")
    completed = mock.Mock(returncode=0, stdout=listing)
    with mock.patch("subprocess.run", return_value=completed):
        assert devices.nvidia_smi_gpus() == [("0", "GPU-1b2c3d4e-0000-1111-2222-333344445555"), ("1", "GPU-99")]
    with mock.patch("subprocess.run", side_effect=FileNotFoundError("nvidia-smi")):
        assert devices.nvidia_smi_gpus() == []


def test_worker_identity_names_the_assigned_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("KERAS_MWMS_FAKE_GPU_UUIDS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("KERAS_MWMS_LOCAL_RANK", raising=False)
    monkeypatch.delenv(GPUS_PER_WORKER_ENV, raising=False)
    with mock.patch.object(devices, "nvidia_smi_gpus", return_value=SMI), \
            mock.patch.object(devices, "visible_gpu_count", return_value=3):
        devices._assignments.clear()
        assert devices.worker_identity("tensorflow", 2)["gpus"] == ["GPU-bbbb"]
    devices._assignments.clear()
    monkeypatch.setenv("KERAS_MWMS_FAKE_GPU_UUIDS", "GPU-fake")
    assert devices.worker_identity("torch", 2)["gpus"] == ["GPU-fake"]


def test_jax_counts_gpus_without_starting(monkeypatch):
    assert devices.jax_gpu_count_before_start({"JAX_PLATFORMS": "cpu"}) == 0
    assert devices.jax_gpu_count_before_start({"CUDA_VISIBLE_DEVICES": ""}) == 0
    with mock.patch("importlib.util.find_spec", return_value=object()), \
            mock.patch.object(devices, "nvidia_smi_gpus", return_value=SMI):
        assert devices.jax_gpu_count_before_start({}) == 3
        assert devices.jax_gpu_count_before_start({"CUDA_VISIBLE_DEVICES": "1"}) == 1


def test_configured_backend_is_read_without_keras(tmp_path):
    (tmp_path / "keras.json").write_text('{"backend": "torch"}')
    assert devices.configured_backend_name({"KERAS_HOME": str(tmp_path)}) == "torch"
    assert devices.configured_backend_name({"KERAS_HOME": str(tmp_path / "none")}) == "tensorflow"


# -- the same-GPU check in the rendezvous ------------------------------------------------------


def _meet(identities: list[dict], exclusive: str | None) -> list[str | None]:
    """Two in-process rendezvous (threads) with these identities; each one's error or None."""
    import threading

    from keras_mwms.startup.rendezvous import Rendezvous, RendezvousError

    addresses = [f"localhost:{port}" for port in launch.find_free_ports(2)]
    errors: list[str | None] = [None, None]

    def member(rank: int) -> None:
        try:
            Rendezvous(addresses, rank, {"backend": "torch"}, timeout=20,
                       identity=identities[rank], exclusive_gpus=exclusive).run()
        except RendezvousError as error:
            errors[rank] = str(error)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    return errors


def test_rendezvous_refuses_two_workers_on_one_gpu_naming_both():
    reason = exclusive_gpus_reason("torch", Impl.NCCL, 1)
    errors = _meet([{"host": "h0", "gpus": ["GPU-a", "GPU-x"]}, {"host": "h1", "gpus": ["GPU-x"]}], reason)
    for error in errors:
        assert error is not None
        assert "worker:0 at localhost:" in error and "(host h0)" in error
        assert "worker:1 at localhost:" in error and "(host h1)" in error
        assert "both train on GPU GPU-x." in error and "Duplicate GPU" in error


def test_rendezvous_lets_workers_share_a_gpu_where_allowed_and_distinct_gpus_always():
    same = [{"host": "h", "gpus": ["GPU-x"]}, {"host": "h", "gpus": ["GPU-x"]}]
    assert _meet(same, None) == [None, None]
    distinct = [{"host": "h", "gpus": ["GPU-x"]}, {"host": "h", "gpus": ["GPU-y"]}]
    assert _meet(distinct, exclusive_gpus_reason("jax", Impl.RING, 1)) == [None, None]


# -- a real gang claiming one GPU -----------------------------------------------------------------


def _claiming_one_gpu(backend: str, implementation: str, out) -> GangResult:
    env = worker_env(backend, lean=True, KERAS_MWMS_FAKE_GPU_UUIDS="GPU-0f0e0d0c-fake-4000-8000-000000000001")
    return run_gang(python_worker("gpu_identity.py", implementation, str(out)), 2, timeout=180, env=env)


@pytest.mark.torch
def test_torch_gang_on_one_gpu_fails_fast_under_auto_and_trains_under_ring(tmp_path):
    """AUTO means NCCL on GPUs: both workers stop in the rendezvous, naming each other and the GPU.

    The fake UUID only changes what the workers claim; they run on the CPU, so under RING the
    same gang trains (gloo), and its workers end bit-identical.
    """
    started = time.monotonic()
    result = _claiming_one_gpu("torch", "AUTO", tmp_path / "auto")
    elapsed = time.monotonic() - started
    assert result.returncode != 0, result.output[-3000:]
    refusals = [line for worker in (0, 1) for line in result.lines(worker) if line.startswith("RESULT error")]
    assert refusals, result.output[-3000:]
    for line in refusals:
        assert "worker:0 at localhost:" in line and "worker:1 at localhost:" in line
        assert "both train on GPU GPU-0f0e0d0c-fake-4000-8000-000000000001" in line
        assert "CommunicationImplementation.AUTO picks NCCL on GPUs" in line
        assert float(line.split()[2]) < 20, line    # strategy creation to refusal: 0.1 s here
    assert not (tmp_path / "auto").exists(), "no worker may train after the refusal"
    print(f"torch AUTO on one claimed GPU: refused after {elapsed:.1f} s (gang wall time)")

    result = _claiming_one_gpu("torch", "RING", tmp_path / "ring")
    assert result.returncode == 0, result.output[-3000:]
    first, second = (np.load(tmp_path / "ring" / f"w{index}.npz") for index in (0, 1))
    assert all(np.array_equal(first[key], second[key]) for key in first.files)


@pytest.mark.tensorflow
def test_tensorflow_gang_on_one_gpu_fails_fast_under_nccl(tmp_path):
    """NCCL requested by name: the check uses the request and the claimed GPUs, not the CPU fallback."""
    result = _claiming_one_gpu("tensorflow", "NCCL", tmp_path)
    assert result.returncode != 0, result.output[-3000:]
    lines = [line for worker in (0, 1) for line in result.lines(worker) if line.startswith("RESULT error")]
    assert lines and all("CommunicationImplementation.NCCL is NCCL on GPUs" in line
                         and "worker:0" in line and "worker:1" in line for line in lines), result.output[-3000:]


def test_slurm_tasks_keep_the_gpus_slurm_gave_them(monkeypatch):
    """SlurmClusterResolver narrows CUDA_VISIBLE_DEVICES per task: SLURM_LOCALID must not index them."""
    from keras_mwms.resolvers import SlurmClusterResolver

    for name in ("CUDA_VISIBLE_DEVICES", GPUS_PER_WORKER_ENV):
        monkeypatch.setenv(name, "")
    environ = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu01",
               "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_LOCALID": "1"}
    resolver = SlurmClusterResolver(gpus_per_node=4, environ=environ)
    assert resolver.visible_devices == "2,3" and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assignment = assign_gpus("jax", 2, 2, {**environ, GPUS_PER_WORKER_ENV: os.environ[GPUS_PER_WORKER_ENV]})
    assert assignment.gpus == (0, 1) and assignment.replicas == 2


# -- scripts/gpu_check.py (the GPU run itself is not CI's: `make gpu-check`) ----------------------------


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_plans_without_running_anything():
    import subprocess

    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--dry-run"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "gpu_check plan:" in result.stdout and "two workers sharing a GPU under RING and AUTO" in result.stdout


def test_gpu_check_unpacks_only_the_wheels_this_python_lacks(tmp_path, monkeypatch):
    import zipfile

    gpu_check = _gpu_check_module()
    monkeypatch.setattr(gpu_check, "BUNDLED", {"keras-mwms-absent": "keras_mwms_absent", "numpy": "numpy"})
    wheels = tmp_path / "bundle" / "wheels"
    wheels.mkdir(parents=True)
    for name in ("keras_mwms_absent-1.0-py3-none-any.whl", "numpy-9.9-cp30-cp30-manylinux_2_28_x86_64.whl"):
        with zipfile.ZipFile(wheels / name, "w") as archive:
            archive.writestr(f"{name.split('-')[0]}/__init__.py", "VALUE = 1\n")
    unpacked, missing = gpu_check.unpack_bundle(tmp_path / "bundle", tmp_path / "site")
    assert unpacked == ["keras_mwms_absent-1.0-py3-none-any.whl"] and missing == []
    assert (tmp_path / "site" / "keras_mwms_absent" / "__init__.py").exists()
    assert not (tmp_path / "site" / "numpy").exists(), "numpy is present: its wheel stays packed"
    assert not gpu_check._wheel_fits(wheels / "numpy-9.9-cp30-cp30-manylinux_2_28_x86_64.whl")


def test_launcher_gives_each_real_worker_its_gpus(tmp_path):
    """The CLI end to end (real processes, a host whose CUDA_VISIBLE_DEVICES names four GPUs)."""
    from tests.multiworker import run_launcher

    script = tmp_path / "show.py"
    script.write_text("import os\nprint('SEES', os.environ['KERAS_MWMS_LOCAL_RANK'], os.environ['CUDA_VISIBLE_DEVICES'],"
                      " os.environ['KERAS_MWMS_GPUS_PER_WORKER'])\n")
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "KERAS_BACKEND": "jax"}
    result = run_launcher(["--workers", "2", "--gpus-per-worker", "2"], [str(script)], timeout=60, env=env)
    assert result.returncode == 0, result.launcher_log
    assert sorted(line.split("SEES ", 1)[1] for line in result.output.splitlines() if "SEES" in line) == \
        ["0 4,5 2", "1 6,7 2"]
    assert "CUDA_VISIBLE_DEVICES worker 0: 4,5; worker 1: 6,7" in result.launcher_log
    refused = run_launcher(["--workers", "3"], [str(script)], timeout=60, env={**env, "KERAS_BACKEND": "torch",
                                                                              "CUDA_VISIBLE_DEVICES": "0,1"})
    assert refused.returncode == 2 and "--workers 3 on a host with 2 GPU(s) (0, 1)" in refused.launcher_log


# -- the backends take the assignment (faked GPUs; each backend in its own process) ---------------

_TF_WIRING = """
from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended
from keras_mwms.backends.tensorflow.engine import tf_cluster_resolver
from keras_mwms.startup.cluster import SimpleClusterResolver
resolver = SimpleClusterResolver({"worker": ["h0:1", "h1:1"]}, "worker", 1)
for gpus in (0, 2):
    # TF's strategy takes its local replicas from the resolver, whatever devices exist.
    local, kind = CollectiveAllReduceExtended._initialize_local_devices(
        None, tf_cluster_resolver(resolver, gpus), "/job:worker/task:1")
    print("TF", gpus, kind, len(local))
"""

_JAX_WIRING = """
from unittest import mock
import jax
from jax._src import xla_bridge
from keras_mwms.backends.jax import engine
from keras_mwms.startup.cluster import SimpleClusterResolver
from keras_mwms.communication import CommunicationOptions
from keras_mwms.devices.assignment import assign_gpus
resolver = SimpleClusterResolver({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "worker", 1)
with mock.patch("keras_mwms.devices.gpu_assignment", return_value=assign_gpus("jax", 4, 2, {"LOCAL_RANK": "1"})):
    backend = engine.JaxBackend(resolver, CommunicationOptions())
with mock.patch.object(jax.distributed, "initialize") as initialize, \\
        mock.patch.object(xla_bridge, "backends_are_initialized", return_value=False):
    engine.initialize_distributed(backend)
print("JAX", backend.engine_description(), initialize.call_args.kwargs["local_device_ids"])
"""


@pytest.mark.tensorflow
def test_tensorflow_workers_get_their_gpus_as_local_replicas():
    """Without `num_accelerators` TF's strategy puts a GPU worker's replica on its CPU."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", _TF_WIRING], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **worker_env("tensorflow", lean=True)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stdout.splitlines() if line.startswith("TF")] == ["TF 0 CPU 1", "TF 2 GPU 2"]


@pytest.mark.jax
def test_jax_workers_start_on_their_gpus():
    """`jax.distributed.initialize` gets this worker's GPU (LOCAL_RANK=1 of 4): local_device_ids=[1]."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", _JAX_WIRING], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **worker_env("jax", lean=True)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "JAX nccl [1]" in result.stdout.splitlines(), result.stdout
