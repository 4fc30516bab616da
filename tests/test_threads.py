"""The host's cores split among its workers whatever started them (keras_mwms/devices/threads.py).

The rules alone, then one real torch gang started the way `srun --ntasks 2` starts it on one
node, with no thread variable set: before the split read only the launcher's variable, each
worker kept every core (40-100x slower than under the launcher on a 16-core host).
"""

from __future__ import annotations

import os
import sys

import pytest

from keras_mwms.devices.threads import CHOSEN_ENV, local_workers, plan
from tests.multiworker import Spawn, run_processes, worker_env
from tests.test_advice import srun_environment
from tests.test_resolvers_gangs import free_port_run


@pytest.mark.parametrize("addresses,index,expected", [
    (["localhost:1", "localhost:2", "localhost:3"], 2, 3),            # the launcher, a local TF_CONFIG
    (["node1:1", "node1:2", "node2:1", "node2:2"], 3, 2),             # srun / mpirun, 2 per node
    (["127.0.0.1:5", "[::1]:6", "localhost:7"], 0, 3),                # loopback, spelled three ways
    (["node1:1", "node2:1"], 0, 1),                                   # one worker per host
])
def test_local_workers_are_counted_from_the_addresses(addresses, index, expected):
    assert local_workers(addresses, index) == expected


def test_the_users_threads_win_and_the_launchers_do_not_count_as_the_users():
    two = ["localhost:1", "localhost:2"]
    assert plan(two, 0, {}, cores=16).threads == 8
    assert plan(two, 0, {"OMP_NUM_THREADS": "4"}, cores=16).threads is None
    assert plan(two, 0, {"OMP_NUM_THREADS": "8", CHOSEN_ENV: "8"}, cores=16).threads == 8
    assert plan(two, 0, {}, cores=1).threads == 1
    assert plan(["localhost:1"], 0, {}, cores=16).threads is None   # alone: the backend's default


@pytest.mark.torch
def test_an_srun_step_without_thread_variables_splits_the_cores(tmp_path, monkeypatch):
    script = tmp_path / "threads.py"
    script.write_text("import keras_mwms, torch\n"
                      "strategy = keras_mwms.MultiWorkerMirroredStrategy()\n"
                      "print('torch threads', torch.get_num_threads(), flush=True)\n")
    env = worker_env("torch", lean=True)
    del env["OMP_NUM_THREADS"]
    for variable in [name for name in os.environ if name.startswith(("OMP_", "MKL_"))]:
        monkeypatch.delenv(variable)   # the workers inherit the rest of this environment
    base = free_port_run(2)
    ran = run_processes([Spawn([sys.executable, str(script)], {**env, **srun_environment(rank, 2, base)})
                         for rank in (0, 1)], timeout=120)
    assert ran.codes == [0, 0], ran.log()
    cores = os.cpu_count()
    expected = max(1, cores // 2)
    for output in ran.outputs:
        assert f"torch threads {expected}" in output, output[-3000:]
    announcement = f"keras_mwms: 2 workers share this host's {cores} cores: {expected} compute thread"
    assert ran.outputs[0].count(announcement) == 1, ran.outputs[0][-3000:]
    assert f"[worker 0] {announcement}" in ran.outputs[0]   # labelled without the launcher (keras_mwms.log)
    assert announcement not in ran.outputs[1]
