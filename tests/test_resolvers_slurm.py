"""`keras_mwms.resolvers.SlurmClusterResolver` against TensorFlow's own, on random Slurm steps.

Each case draws a valid job step — distinct node names with prefixes, zero padding and ranges
(`node[01-04,07],gpu-a[1-2],login`), 1-4 tasks per node written Slurm's way (`2(x3),1`), GPUs per
node, optional `jobs` (`chief` + `worker`), `gpus_per_task`, `tasks_per_node` and `rpc_layer` —
sets it in `os.environ` and asks both resolvers. TensorFlow's reads the same variables (its node
list through its own Python `expand_hostlist`; nothing calls `scontrol`). They must agree on
`cluster_spec()`, `task_type`, `task_id`, `master()`, `num_accelerators()` and the
`CUDA_VISIBLE_DEVICES` each sets. An explicit `port_base` is given to both: our default adds the
job-id offset (`keras_mwms.resolvers.ports`), checked on its own.
"""

from __future__ import annotations

import os
import random

import pytest

from keras_mwms.resolvers import SlurmClusterResolver, expand_hostlist, expand_tasks_per_node

CASES = 300
SEED = 20261205


def _compress(names: list[tuple[str, int, int]]) -> str:
    """Slurm host-list text for (prefix, number, width) names, with ranges where numbers run on."""
    parts, index = [], 0
    while index < len(names):
        prefix, number, width = names[index]
        if width == 0:
            parts.append(prefix)
            index += 1
            continue
        group = [number]
        while (index + 1 < len(names) and names[index + 1][0] == prefix and names[index + 1][2] == width):
            index += 1
            group.append(names[index][1])
        index += 1
        items, start = [], 0
        while start < len(group):
            end = start
            while end + 1 < len(group) and group[end + 1] == group[end] + 1:
                end += 1
            low, high = str(group[start]).zfill(width), str(group[end]).zfill(width)
            items.append(low if start == end else f"{low}-{high}")
            start = end + 1
        parts.append(f"{prefix}[{','.join(items)}]" if len(group) > 1 or random.random() < 0.5
                     else f"{prefix}{str(group[0]).zfill(width)}")
    return ",".join(parts)


def _tasks_text(counts: list[int]) -> str:
    parts, index = [], 0
    while index < len(counts):
        run = 1
        while index + run < len(counts) and counts[index + run] == counts[index]:
            run += 1
        parts.append(f"{counts[index]}(x{run})" if run > 1 else str(counts[index]))
        index += run
    return ",".join(parts)


def random_step(rng: random.Random) -> tuple[dict[str, str], dict]:
    """A valid Slurm job-step environment and resolver arguments."""
    names: list[tuple[str, int, int]] = []
    for prefix in rng.sample(["node", "gpu-a", "c", "cn-x", "hpc"], rng.randint(1, 3)):
        if rng.random() < 0.15:
            names.append((f"{prefix}login", 0, 0))
            continue
        width = rng.choice([1, 2, 3, 4])
        first = rng.randrange(0, 10 ** width // 2)
        numbers = sorted(rng.sample(range(first, min(10 ** width, first + 40)), rng.randint(1, 5)))
        names += [(prefix, number, width) for number in numbers]
    random.seed(rng.random())
    nodelist = _compress(names)
    hosts = expand_hostlist(nodelist)
    counts = [rng.randint(1, 4) for _ in hosts] if rng.random() < 0.7 else [rng.randint(1, 4)] * len(hosts)
    total = sum(counts)
    rank = rng.randrange(total)
    environment = {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(total),
                   "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": _tasks_text(counts),
                   "SLURM_JOB_ID": str(rng.randrange(1, 10 ** 7))}
    most = max(counts)
    gpus_per_task = rng.choice([None, None, 1, 2])
    gpus_per_node = most * (gpus_per_task or rng.randint(1, 3)) + rng.choice([0, 0, 1])
    arguments = {"port_base": rng.randrange(1024, 60000), "gpus_per_node": gpus_per_node,
                 "gpus_per_task": gpus_per_task, "auto_set_gpu": rng.random() < 0.8,
                 "rpc_layer": rng.choice(["grpc", "grpc+verbs", ""])}
    if rng.random() < 0.3 and total > 1:
        arguments["jobs"] = {"chief": 1, "worker": total - 1}
    if rng.random() < 0.15 and len(set(counts)) == 1:
        arguments["tasks_per_node"] = counts[0]
    return environment, arguments


@pytest.fixture(scope="module")
def tensorflow_slurm():
    module = pytest.importorskip("tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver")
    return module.SlurmClusterResolver


def test_matches_tensorflow_on_random_steps(tensorflow_slurm, monkeypatch):
    # Our resolver also marks the GPUs it gives a task (KERAS_MWMS_GPUS_PER_WORKER): undone at the end.
    monkeypatch.setenv("KERAS_MWMS_GPUS_PER_WORKER", "")
    # Both resolvers narrow CUDA_VISIBLE_DEVICES in os.environ (TensorFlow's again in its later
    # calls): recorded here so that the end of the test restores it, whatever the last case left
    # (it leaked "0,1" into every later test and worker of the session).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    rng = random.Random(SEED)
    compared = set()
    for case in range(CASES):
        environment, arguments = random_step(rng)
        for name in [name for name in os.environ if name.startswith("SLURM") or name == "CUDA_VISIBLE_DEVICES"]:
            monkeypatch.delenv(name)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        theirs = tensorflow_slurm(**arguments)
        their_spec = theirs.cluster_spec().as_dict()
        their_devices = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        ours = SlurmClusterResolver(**arguments)
        our_devices = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        context = f"case {case}: {environment} {arguments}"
        assert ours.cluster_spec().as_dict() == their_spec, context
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        assert (ours.task_type, ours.task_id) == (theirs.task_type, theirs.task_id), context
        assert ours.get_task_info() == theirs.get_task_info(), context
        assert ours.master() == theirs.master(), context
        assert ours.master(rpc_layer="grpc") == theirs.master(rpc_layer="grpc"), context
        assert ours.master("worker", 0) == theirs.master("worker", 0), context
        assert ours.num_accelerators() == theirs.num_accelerators(), context
        assert our_devices == their_devices, context
        compared.add((len(their_spec), len(expand_hostlist(environment["SLURM_STEP_NODELIST"])) > 1,
                      "(x" in environment["SLURM_STEP_TASKS_PER_NODE"]))
    print(f"\n[slurm differential] {CASES} random job steps agree with TensorFlow's resolver")
    assert len(compared) >= 6, compared   # chief+worker and worker-only, one and many nodes, runs


def test_default_port_base_is_offset_by_the_job_id(monkeypatch):
    monkeypatch.delenv("KERAS_MWMS_PORT_BASE", raising=False)
    environment = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
                   "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    ports = {job: SlurmClusterResolver(gpus_per_node=0, environ={**environment, "SLURM_JOB_ID": job})
             .cluster_spec().as_dict()["worker"][0] for job in ("41", "42", "1041")}
    assert ports == {"41": "n1:9544", "42": "n1:9560", "1041": "n1:9544"}
    forced = SlurmClusterResolver(gpus_per_node=0, environ={**environment, "SLURM_JOB_ID": "42",
                                                            "KERAS_MWMS_PORT_BASE": "31000"})
    assert forced.worker_addresses == ["n1:31000", "n2:31000"]


@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("a,b[8-10],c", ["a", "b8", "b9", "b10", "c"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1,4(x1)") == [2, 2, 2, 1, 4]
