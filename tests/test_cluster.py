"""TF_CONFIG parsing, validation and the resolvers (keras_mwms/startup/cluster.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from keras_mwms.startup.cluster import (
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TFConfigError,
    make_tf_config,
    parse_tf_config,
    split_address,
)

TWO = {"worker": ["localhost:2001", "localhost:2002"]}


def config(cluster=None, task=None, **extra) -> str:
    body = {"cluster": TWO if cluster is None else cluster,
            "task": {"type": "worker", "index": 0} if task is None else task}
    body.update(extra)
    return json.dumps(body)


# (TF_CONFIG text, a field the message must name, a phrase the message must contain)
MALFORMED = [
    ("{not json", "not valid JSON", "line 1 column 2"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0},}', "not valid JSON", "column"),
    ("[1, 2]", "`TF_CONFIG`", "JSON object"),
    ('"a string"', "`TF_CONFIG`", "JSON object"),
    ("null", "`TF_CONFIG`", "JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "`cluster`", "missing"),
    (json.dumps({"cluster": TWO}), "`task`", "missing"),
    (config(cluster=["localhost:1"]), "`cluster`", "object mapping job names"),
    (config(cluster={}), "`cluster`", "empty"),
    (config(cluster={"workers": ["localhost:1"]}), "`cluster.workers`", "Did you mean 'worker'"),
    (config(cluster={"worker": "localhost:1"}), "`cluster.worker`", "list"),
    (config(cluster={"worker": []}), "`cluster.worker`", "empty job"),
    (config(cluster={"worker": {"0": "localhost:1"}}), "`cluster.worker`", "sparse"),
    (config(cluster={"worker": ["localhost"]}), "`cluster.worker[0]`", "no port"),
    (config(cluster={"worker": ["localhost:abc"]}), "`cluster.worker[0]`", "not a number"),
    (config(cluster={"worker": ["localhost:0"]}), "`cluster.worker[0]`", "outside 1..65535"),
    (config(cluster={"worker": ["localhost:70000"]}), "`cluster.worker[0]`", "outside 1..65535"),
    (config(cluster={"worker": ["::1:2000"]}), "`cluster.worker[0]`", "[::1]"),
    (config(cluster={"worker": ["[zz]:2000"]}), "`cluster.worker[0]`", "IPv6"),
    (config(cluster={"worker": [2001]}), "`cluster.worker[0]`", "host:port"),
    (config(cluster={"worker": ["a b:1"]}), "`cluster.worker[0]`", "not a valid host"),
    (config(cluster={"worker": ["h:1", "h:1"]}), "`cluster.worker[1]`", "duplicates the address of worker:0"),
    (config(cluster={"chief": ["h:1"], "worker": ["h:1"]}), "`cluster.worker[0]`", "chief:0"),
    (config(cluster={"chief": ["h:1", "h:2"], "worker": ["h:3"]}), "`cluster.chief`", "at most one chief"),
    (config(cluster={"evaluator": ["h:1"]}), "`cluster`", "neither a `chief` nor a `worker`"),
    (config(task=[0]), "`task`", "must be an object"),
    (config(task={"index": 0}), "`task.type`", "missing"),
    (config(task={"type": "wroker", "index": 0}), "`task.type`", "Did you mean 'worker'"),
    (config(task={"type": 3, "index": 0}), "`task.type`", "not a known task type"),
    (config(task={"type": "chief", "index": 0}), "`task.type`", "does not have"),
    (config(task={"type": "worker"}), "`task.index`", "missing"),
    (config(task={"type": "worker", "index": "1"}), "`task.index`", "integer"),
    (config(task={"type": "worker", "index": 1.0}), "`task.index`", "integer"),
    (config(task={"type": "worker", "index": True}), "`task.index`", "integer"),
    (config(task={"type": "worker", "index": -1}), "`task.index`", "out of range"),
    (config(task={"type": "worker", "index": 2}), "`task.index`", "0..1"),
    (config(rpc_layer=5), "`rpc_layer`", "string"),
    (config(environment=["cloud"]), "`environment`", "string"),
]


@pytest.mark.parametrize("text,field,phrase", MALFORMED, ids=[f"case{i}" for i in range(len(MALFORMED))])
def test_malformed_tf_config_names_the_field(text, field, phrase):
    with pytest.raises(TFConfigError) as caught:
        parse_tf_config(text)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert field in message, message
    assert phrase in message, message


def test_there_are_at_least_25_malformed_cases():
    assert len(MALFORMED) >= 25


def test_resolver_reports_bad_environment_variable(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": 1}')
    with pytest.raises(TFConfigError, match="`cluster`"):
        TFConfigClusterResolver()


def test_no_tf_config_is_a_single_worker(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    resolver = TFConfigClusterResolver()
    assert resolver.is_single_worker
    assert (resolver.num_workers, resolver.worker_index, resolver.is_chief) == (1, 0, True)
    assert resolver.master() == ""
    assert resolver.cluster_spec().as_dict() == {}


def test_worker_view():
    resolver = TFConfigClusterResolver(tf_config=config(task={"type": "worker", "index": 1}))
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert (resolver.worker_index, resolver.num_workers, resolver.is_chief) == (1, 2, False)
    assert resolver.chief_address == "localhost:2001"
    assert resolver.master() == "localhost:2002"
    assert resolver.master(rpc_layer="grpc") == "grpc://localhost:2002"
    assert resolver.master("worker", 0) == "localhost:2001"


def test_master_follows_tensorflow_rules():
    one_task = TFConfigClusterResolver(tf_config=config({"worker": ["localhost:2001"]}, rpc_layer="grpc"))
    assert one_task.master() == one_task.master("worker", 0, rpc_layer="grpc") == ""
    two = TFConfigClusterResolver(tf_config=config(task={"type": "worker", "index": 1}, rpc_layer="grpc"))
    assert two.master() == "grpc://localhost:2002" and two.master(rpc_layer="") == "localhost:2002"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pinned = TFConfigClusterResolver(tf_config=config(session_master="grpc://m:1"))
    assert pinned.master("worker", 1) == "grpc://m:1"


def test_chief_job_comes_first_and_evaluator_is_not_in_the_group():
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "evaluator": ["e:1"]}
    chief = TFConfigClusterResolver(tf_config=config(cluster, {"type": "chief", "index": 0}))
    worker = TFConfigClusterResolver(tf_config=config(cluster, {"type": "worker", "index": 0}))
    evaluator = TFConfigClusterResolver(tf_config=config(cluster, {"type": "evaluator", "index": 0}))
    assert chief.worker_addresses == ["c:1", "w:1", "w:2"]
    assert (chief.is_chief, chief.worker_index, chief.num_workers) == (True, 0, 3)
    assert (worker.is_chief, worker.worker_index) == (False, 1)
    assert (evaluator.is_chief, evaluator.worker_index, evaluator.num_workers) == (False, None, 3)


def test_ps_job_is_ignored_with_a_warning():
    cluster = {"worker": ["w:1", "w:2"], "ps": ["p:1"]}
    with pytest.warns(UserWarning, match="`ps` task"):
        resolver = TFConfigClusterResolver(tf_config=config(cluster))
    assert resolver.num_workers == 2
    assert "ps" in resolver.cluster_spec().jobs


def test_localhost_mixed_with_remote_hosts_warns():
    with pytest.warns(UserWarning, match="mixes local addresses"):
        parse_tf_config(config({"worker": ["localhost:1", "node2:1"]}))


def test_ipv6_addresses_are_accepted():
    parsed = parse_tf_config(config({"worker": ["[::1]:2001", "[::1]:2002"]}))
    assert parsed["cluster"]["worker"][1] == "[::1]:2002"
    assert split_address("[::1]:2002") == ("::1", 2002)


def test_valid_config_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolver = TFConfigClusterResolver(tf_config=config())
    assert resolver.worker_addresses == TWO["worker"]


def test_cluster_spec_api():
    spec = ClusterSpec({"chief": ["c:1"], "worker": ["w:1", "w:2"]})
    assert spec.jobs == ["chief", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "w:2"
    assert spec.job_tasks("chief") == ["c:1"]
    assert spec == ClusterSpec(spec)
    with pytest.raises(ValueError, match="No such job"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match="No task with index 5"):
        spec.task_address("worker", 5)


def test_simple_resolver_validates_like_tf_config():
    resolver = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, "worker", 1, rpc_layer="grpc")
    assert resolver.master() == "grpc://b:1"
    with pytest.raises(TFConfigError, match="out of range"):
        SimpleClusterResolver({"worker": ["a:1"]}, "worker", 3)


def test_make_tf_config_round_trips():
    text = make_tf_config(["h1:1", "h2:1"], 1, chief="h0:1")
    resolver = TFConfigClusterResolver(tf_config=text)
    assert resolver.worker_addresses == ["h0:1", "h1:1", "h2:1"]
    assert resolver.worker_index == 2
    with pytest.raises(TFConfigError):
        make_tf_config(["h1:1"], 4)


PARITY_CONFIGS = [
    config(),
    config(task={"type": "worker", "index": 1}, rpc_layer="grpc", environment="cloud"),
    config({"chief": ["c:2000"], "worker": ["w0:2000", "w1:2000"]}, {"type": "chief", "index": 0}),
    config({"chief": ["c:2000"], "worker": ["w0:2000", "w1:2000"], "evaluator": ["e:2000"]},
           {"type": "evaluator", "index": 0}),
    config({"chief": ["c:2000"], "worker": ["w0:2000", "w1:2000"]}, {"type": "worker", "index": 1}),
    config({"worker": ["localhost:2001"]}),
    config({"worker": ["localhost:2001"]}, rpc_layer="grpc"),
    config({"chief": ["c:2000"]}, {"type": "chief", "index": 0}),
    config(task={"type": "worker", "index": 1}, session_master="grpc://m:2000"),
]

TF_SIDE = r"""
import json, os, sys
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import tensorflow as tf
rows = []
for text in json.load(sys.stdin):
    os.environ["TF_CONFIG"] = text
    r = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    rows.append({"task_type": r.task_type, "task_id": r.task_id, "rpc_layer": r.rpc_layer,
                 "environment": r.environment, "master": r.master(),
                 "master_grpc": r.master(rpc_layer="grpc"), "master_no_layer": r.master(rpc_layer=""),
                 "master_worker_0": r.master("worker", 0), "cluster": r.cluster_spec().as_dict()})
print("PARITY" + json.dumps(rows))
"""


@pytest.mark.tensorflow
def test_parity_with_tensorflow_resolver():
    completed = subprocess.run(
        [sys.executable, "-c", TF_SIDE], input=json.dumps(PARITY_CONFIGS), capture_output=True,
        text=True, timeout=180, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    line = next(line for line in completed.stdout.splitlines() if line.startswith("PARITY"))
    expected_rows = json.loads(line[len("PARITY"):])
    for text, expected in zip(PARITY_CONFIGS, expected_rows):
        ours = TFConfigClusterResolver(tf_config=text)
        actual = {"task_type": ours.task_type, "task_id": ours.task_id, "rpc_layer": ours.rpc_layer,
                  "environment": ours.environment, "master": ours.master(),
                  "master_grpc": ours.master(rpc_layer="grpc"), "master_no_layer": ours.master(rpc_layer=""),
                  "master_worker_0": ours.master("worker", 0), "cluster": ours.cluster_spec().as_dict()}
        assert actual == expected, text
