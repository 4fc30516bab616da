"""Hints that fit how the job was started (keras_mwms/startup/advice.py and the messages that use it).

Each message is produced in its own context, with real processes where the context is a
process's environment: the launcher with `--port-base`, a simulated `srun` step, torchrun
variables under a leftover `TF_CONFIG`, two workers on different backends, a backend package
that is not installed. Workers are torch (or jax) processes that only create the strategy.
"""

from __future__ import annotations

import faulthandler
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from keras_mwms.errors import WorkerLostError
from keras_mwms.launch import find_free_ports
from keras_mwms.resolvers import SlurmClusterResolver
from keras_mwms.startup.cluster import make_tf_config
from tests.multiworker import REPO, Spawn, run_launcher, run_processes, worker_env
from tests.test_resolvers_gangs import free_port_run

JOIN = "import keras_mwms\nstrategy = keras_mwms.MultiWorkerMirroredStrategy()\nprint('joined', strategy.worker_index)\n"
DEADLINE = 120


def srun_environment(rank: int, tasks: int, port_base: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
            "SLURMD_NODENAME": "localhost", "KERAS_MWMS_PORT_BASE": str(port_base)}


@pytest.fixture
def join_script(tmp_path):
    script = tmp_path / "join.py"
    script.write_text(JOIN)
    return str(script)


@pytest.mark.torch
def test_a_port_clash_under_port_base_names_the_flag(join_script):
    base = free_port_run(2)
    with socket.socket() as squatter:
        squatter.bind(("localhost", base + 1))
        squatter.listen(1)
        launched = run_launcher(["--workers", "2", "--port-base", str(base)], [join_script], timeout=DEADLINE,
                                env=worker_env("torch", lean=True, KERAS_MWMS_RENDEZVOUS_TIMEOUT="20"))
    assert launched.returncode != 0
    assert f"pass another --port-base to keras_mwms.launch (its workers listen on {base} .. {base + 1})" \
        in launched.output, launched.output[-4000:]
    assert "in TF_CONFIG" not in launched.output.split("already in use")[1].splitlines()[0]


@pytest.mark.torch
def test_a_missing_task_of_an_srun_step_is_named_as_such(join_script):
    alone = run_processes([Spawn([sys.executable, join_script],
                                 {**worker_env("torch", lean=True, KERAS_MWMS_RENDEZVOUS_TIMEOUT="3"),
                                  **srun_environment(0, 2, free_port_run(2))})], timeout=DEADLINE)
    assert alone.codes == [1], alone.log()
    assert "Start every task of the Slurm job step (srun) within the timeout" in alone.outputs[0], alone.log()
    assert "listed in TF_CONFIG" not in alone.outputs[0]


def test_a_lost_worker_under_srun_says_to_run_the_step_again():
    from keras_mwms.backends import policy

    resolver = SlurmClusterResolver(environ=srun_environment(0, 2, 7000))
    backend = SimpleNamespace(resolver=resolver, worker_index=0,
                              options=SimpleNamespace(lost_worker_exit_seconds=60))
    try:
        with pytest.raises(WorkerLostError) as raised:
            policy.raise_worker_lost(backend, "barrier", OSError("Connection reset by peer"), [1])
    finally:
        faulthandler.cancel_dump_traceback_later()   # the exit watchdog it arms
    assert "Run the job step again (srun in a retry loop, or sbatch --requeue)" in str(raised.value)
    assert "keras_mwms.launch" not in str(raised.value)


@pytest.mark.torch
def test_a_leftover_tf_config_under_torchrun_is_named(join_script):
    addresses = [f"localhost:{port}" for port in find_free_ports(2)]
    master = free_port_run(3)
    spawns = [Spawn([sys.executable, join_script],
                    {**worker_env("torch", lean=True, KERAS_MWMS_RENDEZVOUS_TIMEOUT="8"),
                     "TF_CONFIG": make_tf_config(addresses, 0),   # left in the shell: index 0 for both
                     "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)})
              for rank in (0, 1)]
    ran = run_processes(spawns, timeout=DEADLINE, grace_after_failure=30)
    assert all(code not in (0, None) for code in ran.codes), ran.log()
    for output in ran.outputs:
        assert ("cluster is read from tf_config (TF_CONFIG); the torchrun (WORLD_SIZE) variables also present "
                "are ignored") in output, output[-3000:]
        assert "KERAS_MWMS_CLUSTER_SOURCE=torchrun" in output
    assert any("calls itself worker:0 too: two processes were given the same place" in output
               for output in ran.outputs), ran.log()


@pytest.mark.torch
@pytest.mark.jax
def test_a_backend_mismatch_names_each_worker_and_keras_backend(join_script):
    addresses = [f"localhost:{port}" for port in find_free_ports(2)]
    spawns = [Spawn([sys.executable, join_script],
                    {**worker_env(backend, lean=True, KERAS_MWMS_RENDEZVOUS_TIMEOUT="30"),
                     "TF_CONFIG": make_tf_config(addresses, index)})
              for index, backend in enumerate(("torch", "jax"))]
    ran = run_processes(spawns, timeout=DEADLINE, grace_after_failure=30)
    assert ran.codes == [1, 1], ran.log()
    for output in ran.outputs:   # the same sentence on both, true on both
        assert "backend: worker:1='jax', worker:0='torch'" in output or \
            "backend: worker:0='torch', worker:1='jax'" in output, output[-3000:]
        assert "Set KERAS_BACKEND to the same backend on every worker" in output
        assert "theirs=" not in output and "ours=" not in output


def test_a_backend_that_is_not_installed_names_the_extra(tmp_path, join_script):
    hidden = tmp_path / "hide_torch"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None   # not installed\n")
    env = worker_env("torch", lean=True)
    env["PYTHONPATH"] = f"{hidden}:{env['PYTHONPATH']}"
    launched = run_launcher(["--workers", "2"], [join_script], timeout=DEADLINE, env=env)
    assert launched.returncode == 2
    assert ("KERAS_BACKEND is 'torch', but the torch package is not installed: "
            'pip install "keras_mwms[torch]"') in launched.launcher_log, launched.launcher_log
    direct = subprocess.run([sys.executable, join_script], cwd=REPO, capture_output=True, text=True,
                            timeout=DEADLINE, env={**__import__("os").environ, **env})
    assert direct.returncode == 1
    assert 'pip install "keras_mwms[torch]"' in direct.stderr.splitlines()[-1], direct.stderr[-2000:]
