"""The torchrun and MPI resolvers, auto-detection, and malformed environments of every kind.

Pure Python (no backend): every resolver reads an `environ` mapping given here. Each malformed
environment must raise `ClusterEnvironmentError` whose message names the variable, shows the
bad value and says what to do.
"""

from __future__ import annotations

import json

import pytest

from keras_mwms.resolvers import (
    ClusterEnvironmentError,
    JaxClusterResolver,
    MPIClusterResolver,
    SkyPilotClusterResolver,
    SlurmClusterResolver,
    TorchrunClusterResolver,
    detect_cluster_resolver,
)
from keras_mwms.resolvers.detect import describe_source
from keras_mwms.startup.cluster import TFConfigClusterResolver

SLURM = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0",
         "SLURM_LOCALID": "0", "SLURMD_NODENAME": "node2"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "none"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
JAX = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "n1:6666",
       "KERAS_MWMS_HOSTS": "n1,n2"}
SKYPILOT = {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "0", "SKYPILOT_TASK_ID": "sky-1"}
TF_CONFIG_3 = json.dumps({"cluster": {"worker": ["a:1", "b:1", "c:1"]}, "task": {"type": "worker", "index": 0}})
TF_CONFIG_2 = json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})


def _changed(base: dict, changes: dict) -> dict:
    environ = dict(base)
    for name, value in changes.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


def slurm(**changes):
    return lambda: SlurmClusterResolver(gpus_per_node=0, environ=_changed(SLURM, changes))


def torchrun(**changes):
    return lambda: TorchrunClusterResolver(environ=_changed(TORCHRUN, changes))


def mpi(**changes):
    return lambda: MPIClusterResolver(environ=_changed(OPEN_MPI, changes))


def jax(**changes):
    return lambda: JaxClusterResolver(environ=_changed(JAX, changes))


def skypilot(**changes):
    return lambda: SkyPilotClusterResolver(environ=_changed(SKYPILOT, changes))


def detect(environ):
    return lambda: detect_cluster_resolver(environ)


# (case id, build, variable the message must name, value it must show, or None for "unset")
MALFORMED = [
    ("slurm-procid-unset", slurm(SLURM_PROCID=None), "SLURM_PROCID", None),
    ("slurm-procid-text", slurm(SLURM_PROCID="one"), "SLURM_PROCID", "one"),
    ("slurm-procid-too-big", slurm(SLURM_PROCID="5"), "SLURM_PROCID", "5"),
    ("slurm-procid-negative", slurm(SLURM_PROCID="-1"), "SLURM_PROCID", "-1"),
    ("slurm-num-tasks-zero", slurm(SLURM_STEP_NUM_TASKS="0"), "SLURM_STEP_NUM_TASKS", "0"),
    ("slurm-num-tasks-text", slurm(SLURM_STEP_NUM_TASKS="two"), "SLURM_STEP_NUM_TASKS", "two"),
    ("slurm-num-tasks-disagree", slurm(SLURM_STEP_NUM_TASKS="3"), "SLURM_STEP_NUM_TASKS", "3"),
    ("slurm-nodelist-unset", slurm(SLURM_STEP_NODELIST=None), "SLURM_STEP_NODELIST", None),
    ("slurm-nodelist-unclosed", slurm(SLURM_STEP_NODELIST="node[1-2"), "SLURM_STEP_NODELIST", "node[1-2"),
    ("slurm-nodelist-stray-bracket", slurm(SLURM_STEP_NODELIST="node1],node2"), "SLURM_STEP_NODELIST",
     "node1],node2"),
    ("slurm-nodelist-nested", slurm(SLURM_STEP_NODELIST="n[1-[2]]"), "SLURM_STEP_NODELIST", "n[1-[2]]"),
    ("slurm-nodelist-decreasing", slurm(SLURM_STEP_NODELIST="node[2-1]"), "SLURM_STEP_NODELIST", "node[2-1]"),
    ("slurm-nodelist-letters", slurm(SLURM_STEP_NODELIST="node[a-b]"), "SLURM_STEP_NODELIST", "node[a-b]"),
    ("slurm-nodelist-empty-name", slurm(SLURM_STEP_NODELIST="node1,,node2"), "SLURM_STEP_NODELIST",
     "node1,,node2"),
    ("slurm-nodelist-repeated", slurm(SLURM_STEP_NODELIST="node1,node1"), "SLURM_STEP_NODELIST", "node1,node1"),
    ("slurm-tasks-per-node-syntax", slurm(SLURM_STEP_TASKS_PER_NODE="1(x)"), "SLURM_STEP_TASKS_PER_NODE", "1(x)"),
    ("slurm-tasks-per-node-zero", slurm(SLURM_STEP_TASKS_PER_NODE="0,2"), "SLURM_STEP_TASKS_PER_NODE", "0,2"),
    ("slurm-tasks-per-node-count", slurm(SLURM_STEP_TASKS_PER_NODE="1(x3)"), "SLURM_STEP_TASKS_PER_NODE",
     "1(x3)"),
    ("slurm-node-name-mismatch", slurm(SLURMD_NODENAME="node1"), "SLURMD_NODENAME", "node1"),
    ("slurm-localid-mismatch", slurm(SLURM_LOCALID="1"), "SLURM_LOCALID", "1"),
    ("slurm-port-base-range", slurm(KERAS_MWMS_PORT_BASE="70000"), "KERAS_MWMS_PORT_BASE", "70000"),
    ("slurm-port-base-text", slurm(KERAS_MWMS_PORT_BASE="high"), "KERAS_MWMS_PORT_BASE", "high"),
    ("slurm-gpus-short", lambda: SlurmClusterResolver(gpus_per_task=2, environ={**SLURM, "SLURM_GPUS_ON_NODE": "1"}),
     "SLURM_GPUS_ON_NODE", "1"),
    ("torchrun-world-size-unset", torchrun(WORLD_SIZE=None), "WORLD_SIZE", None),
    ("torchrun-world-size-zero", torchrun(WORLD_SIZE="0"), "WORLD_SIZE", "0"),
    ("torchrun-rank-too-big", torchrun(RANK="2"), "RANK", "2"),
    ("torchrun-rank-text", torchrun(RANK="x"), "RANK", "x"),
    ("torchrun-master-addr-unset", torchrun(MASTER_ADDR=None), "MASTER_ADDR", None),
    ("torchrun-master-port-text", torchrun(MASTER_PORT="port"), "MASTER_PORT", "port"),
    ("torchrun-master-port-top", torchrun(MASTER_PORT="65535"), "MASTER_PORT", "65535"),
    ("torchrun-local-size-uneven", torchrun(WORLD_SIZE="4", LOCAL_WORLD_SIZE="3"), "LOCAL_WORLD_SIZE", "3"),
    ("torchrun-local-rank-too-big", torchrun(LOCAL_RANK="2", RANK="0", WORLD_SIZE="4"), "LOCAL_RANK", "2"),
    ("torchrun-hosts-count", torchrun(WORLD_SIZE="4", RANK="3", KERAS_MWMS_HOSTS="h1,h2,h3"),
     "KERAS_MWMS_HOSTS", "h1,h2,h3"),
    ("mpi-size-unset", mpi(OMPI_COMM_WORLD_SIZE=None), "OMPI_COMM_WORLD_SIZE", None),
    ("mpi-rank-too-big", mpi(OMPI_COMM_WORLD_RANK="2"), "OMPI_COMM_WORLD_RANK", "2"),
    ("mpi-several-nodes-no-hosts", mpi(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3"),
     "KERAS_MWMS_HOSTS", None),
    ("mpi-hosts-uneven", mpi(OMPI_COMM_WORLD_SIZE="3", OMPI_COMM_WORLD_LOCAL_SIZE="1",
                             OMPI_COMM_WORLD_LOCAL_RANK="0", KERAS_MWMS_HOSTS="n[1-2]"), "KERAS_MWMS_HOSTS", "n1,n2"),
    ("mpi-map-by-node", mpi(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_LOCAL_RANK="0",
                            KERAS_MWMS_HOSTS="n1,n2"), "OMPI_COMM_WORLD_LOCAL_RANK", "0"),
    ("mpi-pmi-size-text", lambda: MPIClusterResolver(environ={"PMI_RANK": "0", "PMI_SIZE": "many"}),
     "PMI_SIZE", "many"),
    ("jax-num-processes-unset", jax(JAX_NUM_PROCESSES=None), "JAX_NUM_PROCESSES", None),
    ("jax-num-processes-zero", jax(JAX_NUM_PROCESSES="0"), "JAX_NUM_PROCESSES", "0"),
    ("jax-process-id-unset", jax(JAX_PROCESS_ID=None), "JAX_PROCESS_ID", None),
    ("jax-process-id-too-big", jax(JAX_PROCESS_ID="2"), "JAX_PROCESS_ID", "2"),
    ("jax-process-id-text", jax(JAX_PROCESS_ID="one"), "JAX_PROCESS_ID", "one"),
    ("jax-coordinator-unset", jax(JAX_COORDINATOR_ADDRESS=None), "JAX_COORDINATOR_ADDRESS", None),
    ("jax-coordinator-no-port", jax(JAX_COORDINATOR_ADDRESS="n1"), "JAX_COORDINATOR_ADDRESS", "n1"),
    ("jax-coordinator-port-text", jax(JAX_COORDINATOR_ADDRESS="n1:port"), "JAX_COORDINATOR_ADDRESS", "n1:port"),
    ("jax-coordinator-port-top", jax(JAX_NUM_PROCESSES="4", KERAS_MWMS_HOSTS="n1",
                                     JAX_COORDINATOR_ADDRESS="n1:65534"), "JAX_COORDINATOR_ADDRESS", "n1:65534"),
    ("jax-hosts-uneven", jax(JAX_NUM_PROCESSES="3", KERAS_MWMS_HOSTS="n1,n2"), "KERAS_MWMS_HOSTS", "n1,n2"),
    ("skypilot-node-ips-unset", skypilot(SKYPILOT_NODE_IPS=None), "SKYPILOT_NODE_IPS", None),
    ("skypilot-node-ips-blank", skypilot(SKYPILOT_NODE_IPS="\n"), "SKYPILOT_NODE_IPS", "\n"),
    ("skypilot-node-rank-unset", skypilot(SKYPILOT_NODE_RANK=None), "SKYPILOT_NODE_RANK", None),
    ("skypilot-node-rank-too-big", skypilot(SKYPILOT_NODE_RANK="2"), "SKYPILOT_NODE_RANK", "2"),
    ("skypilot-node-rank-text", skypilot(SKYPILOT_NODE_RANK="last"), "SKYPILOT_NODE_RANK", "last"),
    ("skypilot-num-nodes-disagree", skypilot(SKYPILOT_NUM_NODES="3"), "SKYPILOT_NUM_NODES", "3"),
    ("skypilot-gpus-text", skypilot(SKYPILOT_NUM_GPUS_PER_NODE="eight"), "SKYPILOT_NUM_GPUS_PER_NODE", "eight"),
    ("skypilot-local-rank-without-gpus", skypilot(LOCAL_RANK="1"), "SKYPILOT_NUM_GPUS_PER_NODE", "0"),
    ("skypilot-local-rank-too-big", skypilot(SKYPILOT_NUM_GPUS_PER_NODE="2", LOCAL_RANK="2"), "LOCAL_RANK", "2"),
    ("skypilot-port-base-text", skypilot(KERAS_MWMS_PORT_BASE="high"), "KERAS_MWMS_PORT_BASE", "high"),
    ("detect-jax-vs-tf-config", detect({**JAX, "TF_CONFIG": TF_CONFIG_3}), "JAX_NUM_PROCESSES", "2"),
    ("detect-skypilot-vs-jax", detect({**SKYPILOT, **JAX, "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "0"}),
     "SKYPILOT_NODE_IPS", "10.0.0.1\n10.0.0.2\n"),
    ("detect-skypilot-vs-torchrun", detect({**SKYPILOT, **TORCHRUN, "WORLD_SIZE": "4", "RANK": "3",
                                            "LOCAL_WORLD_SIZE": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "3"}),
     "SKYPILOT_NODE_IPS", "10.0.0.1\n10.0.0.2\n"),
    ("detect-unknown-source", detect({**SLURM, "KERAS_MWMS_CLUSTER_SOURCE": "kubernetes"}),
     "KERAS_MWMS_CLUSTER_SOURCE", "kubernetes"),
    ("detect-tf-config-vs-slurm", detect({**SLURM, "TF_CONFIG": TF_CONFIG_3}), "SLURM_STEP_NUM_TASKS", "2"),
    ("detect-torchrun-vs-mpi", detect({**TORCHRUN, **OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "3"}),
     "OMPI_COMM_WORLD_SIZE", "3"),
]


@pytest.mark.parametrize("build, variable, value", [case[1:] for case in MALFORMED],
                         ids=[case[0] for case in MALFORMED])
def test_malformed_environment_names_variable_value_and_fix(build, variable, value):
    with pytest.raises(ClusterEnvironmentError) as caught:
        build()
    message = str(caught.value)
    assert variable in message, message
    if value is None:
        assert f"{variable} is unset" in message, message
    else:
        assert repr(value) in message, message
    fix = message.partition(": ")[2]
    assert len(fix) > 15, f"no fix in {message!r}"


def test_malformed_cases_are_many_and_cover_every_resolver():
    assert len(MALFORMED) >= 20
    assert {case[0].split("-")[0] for case in MALFORMED} == {"slurm", "torchrun", "mpi", "jax", "skypilot", "detect"}


def test_conflict_message_names_both_sources_and_the_way_out():
    with pytest.raises(ClusterEnvironmentError) as caught:
        detect_cluster_resolver({**SLURM, "TF_CONFIG": TF_CONFIG_3})
    message = str(caught.value)
    assert "says 2 workers, but TF_CONFIG says 3" in message
    assert "KERAS_MWMS_CLUSTER_SOURCE" in message


def test_torchrun_one_node_ports_follow_master_port():
    resolver = TorchrunClusterResolver(environ=TORCHRUN)
    assert resolver.worker_addresses == ["127.0.0.1:29501", "127.0.0.1:29502"]
    assert (resolver.task_type, resolver.task_id, resolver.worker_index, resolver.local_rank) == ("worker", 1, 1, 1)
    assert not resolver.is_chief and resolver.num_workers == 2
    assert resolver.master() == "127.0.0.1:29502"
    assert resolver.master(rpc_layer="grpc") == "grpc://127.0.0.1:29502"
    assert "torchrun" in describe_source(resolver)


def test_torchrun_several_nodes_with_hosts_and_lightning_variables():
    environ = {"NODE_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
               "MASTER_ADDR": "n1", "MASTER_PORT": "1234", "KERAS_MWMS_HOSTS": "n1,n2"}
    resolver = TorchrunClusterResolver(environ=environ)
    assert resolver.worker_addresses == ["n1:1235", "n1:1236", "n2:1235", "n2:1236"]
    assert resolver.task_id == 2


def test_pytorchjob_one_process_per_pod():
    environ = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    resolver = TorchrunClusterResolver(hosts=["job-master-0", "job-worker-0", "job-worker-1"], environ=environ)
    assert resolver.worker_addresses == ["job-master-0:23457", "job-worker-0:23457", "job-worker-1:23457"]
    assert resolver.task_id == 2 and resolver.local_rank == 0
    assert "torch-style" in describe_source(resolver)


@pytest.mark.parametrize("environ, source", [
    (OPEN_MPI, "Open MPI"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "MPICH"),
    ({"PMIX_RANK": "1", "PMIX_SIZE": "2"}, "PMIx"),
])
def test_mpi_flavours_on_one_node(environ, source):
    resolver = MPIClusterResolver(port_base=6000, environ=environ)
    assert resolver.worker_addresses == ["localhost:6000", "localhost:6001"]
    assert resolver.task_id == 1 and source in resolver.source


def test_mpi_hosts_from_environment_and_job_port_offset():
    environ = {**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
               "OMPI_COMM_WORLD_LOCAL_RANK": "0", "KERAS_MWMS_HOSTS": "gpu[07-08]", "OMPI_MCA_ess_base_jobid": "5"}
    resolver = MPIClusterResolver(environ=environ)
    assert resolver.worker_addresses == ["gpu07:8968", "gpu07:8969", "gpu08:8968", "gpu08:8969"]


def test_jax_variables_with_hosts_place_ranks_by_block_and_start_at_the_coordinator():
    resolver = JaxClusterResolver(environ={**JAX, "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2",
                                           "KERAS_MWMS_HOSTS": "node1,node2"})
    # Process 0 is the coordinator, even where KERAS_MWMS_HOSTS spells its node another way.
    assert resolver.worker_addresses == ["n1:6666", "node1:6667", "node2:6666", "node2:6667"]
    assert (resolver.task_id, resolver.local_rank, resolver.is_chief) == (2, 0, False)
    assert "JAX variables" in describe_source(resolver)


def test_jax_variables_alone_exchange_hosts_at_the_coordinator():
    """No KERAS_MWMS_HOSTS: every process reports its host to process 0 (threads stand for pods)."""
    import socket
    import threading

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    found = {}

    def resolve(rank):
        found[rank] = JaxClusterResolver(timeout=30, environ={
            "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": str(rank), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"})

    threads = [threading.Thread(target=resolve, args=(rank,)) for rank in (2, 0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    expected = [f"127.0.0.1:{port + local}" for local in range(3)]
    assert [found[rank].worker_addresses for rank in range(3)] == [expected] * 3
    assert [found[rank].local_rank for rank in range(3)] == [0, 1, 2]


def test_jax_variables_exchange_names_the_missing_rank_0():
    from keras_mwms.startup.rendezvous import RendezvousError

    with pytest.raises(RendezvousError, match="rank 0 never answered at 127.0.0.1:9 .*JAX_COORDINATOR_ADDRESS"):
        JaxClusterResolver(timeout=0.5, environ={"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1",
                                                 "JAX_COORDINATOR_ADDRESS": "127.0.0.1:9"})


@pytest.mark.parametrize("changes, addresses, rank", [
    ({}, ["10.0.0.1:7000", "10.0.0.2:7000"], 1),
    ({"SKYPILOT_NUM_GPUS_PER_NODE": "2", "LOCAL_RANK": "1"},
     ["10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.2:7000", "10.0.0.2:7001"], 3),
    ({"SKYPILOT_NUM_GPUS_PER_NODE": "2", "KERAS_MWMS_LOCAL_RANK": "0"},
     ["10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.2:7000", "10.0.0.2:7001"], 2),
    ({"SKYPILOT_NUM_GPUS_PER_NODE": "8"}, ["10.0.0.1:7000", "10.0.0.2:7000"], 1),
], ids=["per-node", "per-gpu-local-rank", "per-gpu-launcher-rank", "per-node-with-gpus"])
def test_skypilot_one_worker_per_node_or_per_gpu(changes, addresses, rank):
    resolver = SkyPilotClusterResolver(environ={**SKYPILOT, **changes, "KERAS_MWMS_PORT_BASE": "7000"})
    assert (resolver.worker_addresses, resolver.task_id) == (addresses, rank)
    assert "SkyPilot task" in describe_source(resolver)


@pytest.mark.parametrize("environ, expected", [
    ({}, "TFConfigClusterResolver"),
    ({"TF_CONFIG": TF_CONFIG_3}, "TFConfigClusterResolver"),
    (SLURM, "SlurmClusterResolver"),
    (TORCHRUN, "TorchrunClusterResolver"),
    (OPEN_MPI, "MPIClusterResolver"),
    ({**SLURM, "TF_CONFIG": TF_CONFIG_2}, "TFConfigClusterResolver"),
    ({**SLURM, **TORCHRUN}, "SlurmClusterResolver"),
    ({**TORCHRUN, **OPEN_MPI}, "TorchrunClusterResolver"),
    (_changed(SLURM, {"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": "2"}), "TFConfigClusterResolver"),
    ({**SLURM, **TORCHRUN, "WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "4",
      "KERAS_MWMS_CLUSTER_SOURCE": "torchrun"}, "TorchrunClusterResolver"),
    (JAX, "JaxClusterResolver"),
    (SKYPILOT, "SkyPilotClusterResolver"),
    ({**OPEN_MPI, **_changed(JAX, {"KERAS_MWMS_HOSTS": None})}, "MPIClusterResolver"),
    ({**JAX, **SKYPILOT}, "JaxClusterResolver"),
    ({**SKYPILOT, **TORCHRUN, "WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "2",
      "SKYPILOT_NUM_GPUS_PER_NODE": "2", "KERAS_MWMS_HOSTS": "n1,n2"}, "TorchrunClusterResolver"),
    ({**SKYPILOT, **JAX, "JAX_NUM_PROCESSES": "4", "KERAS_MWMS_CLUSTER_SOURCE": "skypilot"},
     "SkyPilotClusterResolver"),
], ids=["nothing", "tf-config", "slurm", "torchrun", "mpi", "tf-config-agrees-with-slurm",
        "slurm-before-torchrun", "torchrun-before-mpi", "batch-script-is-no-step", "forced-source",
        "jax", "skypilot", "mpi-before-jax", "jax-before-skypilot", "torchrun-per-gpu-inside-skypilot",
        "forced-skypilot"])
def test_detection_order(environ, expected):
    assert type(detect_cluster_resolver(environ)).__name__ == expected


def test_single_worker_fallback_describes_itself():
    resolver = detect_cluster_resolver({})
    assert isinstance(resolver, TFConfigClusterResolver) and resolver.is_single_worker
    assert describe_source(resolver).startswith("single worker")


@pytest.mark.parametrize("make, advice", [
    (lambda port: SlurmClusterResolver(gpus_per_node=0, environ={
        **SLURM, "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURMD_NODENAME": "localhost", "KERAS_MWMS_PORT_BASE": str(port)}), "KERAS_MWMS_PORT_BASE"),
    (lambda port: TorchrunClusterResolver(environ={**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0",
                                                   "MASTER_PORT": str(port - 1)}), "--master-port"),
], ids=["slurm", "torchrun"])
def test_rendezvous_names_the_port_convention_when_the_port_is_taken(make, advice):
    """Another job already holds this worker's port: the rendezvous says so, with the resolver's way out."""
    import socket

    from keras_mwms.startup.rendezvous import Rendezvous, RendezvousError

    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen(1)
        resolver = make(occupant.getsockname()[1])
        with pytest.raises(RendezvousError) as caught:
            Rendezvous(resolver.worker_addresses, resolver.worker_index, {}, timeout=10,
                       port_advice=resolver.port_advice).run()
    message = str(caught.value)
    assert "already in use" in message and advice in message, message
