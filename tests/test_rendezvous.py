"""The pre-flight rendezvous with real processes (keras_mwms/startup/rendezvous.py); no ML backend."""

from __future__ import annotations

import socket
import time

import pytest

from keras_mwms.launch import find_free_ports
from keras_mwms.startup.cluster import make_tf_config
from keras_mwms.startup.rendezvous import Rendezvous, describe_difference
from tests.multiworker import Spawn, python_worker, run_processes, worker_env


def run_workers(addresses_per_worker, indices, extra_env=None, timeout=20, deadline=60):
    """Runs one worker per (address list, index) until all exit; each must exit by itself.

    Returns `(exit code, seconds the rendezvous took, output)` per worker; past `deadline`
    seconds every worker is killed and the test fails with their output.
    """
    spawns = [Spawn(python_worker("rendezvous_worker.py"),
                    {**worker_env(lean=True), "RDV_TIMEOUT": str(timeout), "TF_CONFIG": make_tf_config(addresses, index),
                     **(extra_env or {}).get(position, {})})
              for position, (addresses, index) in enumerate(zip(addresses_per_worker, indices))]
    ran = run_processes(spawns, timeout=deadline)
    results = []
    for code, output in zip(ran.codes, ran.outputs):
        line = next((line for line in output.splitlines() if line.startswith("RESULT")), "")
        results.append((code, float(line.split()[2]) if line else None, output))
    return results


def addresses(count):
    return [f"localhost:{port}" for port in find_free_ports(count)]


def test_three_workers_meet_and_release_their_ports():
    cluster = addresses(3)
    results = run_workers([cluster] * 3, [0, 1, 2])
    for code, _, output in results:
        assert code == 0, output


def test_missing_worker_is_named_within_timeout():
    cluster = addresses(3)
    timeout = 6
    results = run_workers([cluster] * 2, [0, 1], timeout=timeout)
    for code, seconds, output in results:
        assert code == 1, output
        assert seconds <= timeout + 5, output
        assert "worker:2" in output and cluster[2] in output, output


def test_mismatched_cluster_order_fails_fast_naming_the_odd_worker():
    cluster = addresses(3)
    odd = [cluster[0], cluster[2], cluster[1]]
    results = run_workers([cluster, cluster, odd], [0, 1, 2], timeout=30)
    for code, seconds, output in results:
        assert code == 1, output
        assert seconds < 10, output
    # Every worker explains the cluster difference and shows the odd order.
    odd_order = repr(odd)
    for _, _, output in results:
        assert "configured differently" in output and "cluster" in output, output
    assert any(odd_order in output for _, _, output in results[:2]), results


def test_version_mismatch_fails_fast_naming_the_worker_and_field():
    cluster = addresses(2)
    results = run_workers([cluster] * 2, [0, 1], {1: {"FAKE_KERAS": "3.9.0"}}, timeout=30)
    for code, seconds, output in results:
        assert code == 1, output
        assert seconds < 10, output
        assert "keras" in output and "3.9.0" in output, output
    assert "worker:1" in results[0][2]


def test_duplicate_index_fails_fast():
    # Both processes claiming worker:1 are up before the chief (which starts 1.5 s late), so
    # the duplicate is seen before any verdict and the whole gang must stop.
    cluster = addresses(2)
    results = run_workers([cluster] * 3, [0, 1, 1], {0: {"RDV_START_DELAY": "1.5"}}, timeout=30)
    codes = [code for code, _, _ in results]
    assert codes == [1, 1, 1], results
    assert any("already in use" in output for _, _, output in results)
    assert all(seconds is not None and seconds < 10 for _, seconds, _ in results), results


def test_port_taken_by_another_program_is_named():
    cluster = addresses(2)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host, port = cluster[1].split(":")
        squatter.bind((host, int(port)))
        squatter.listen(1)
        results = run_workers([cluster] * 2, [0, 1], timeout=5, deadline=40)
    code, seconds, output = results[1]
    assert code == 1 and "already in use by another program" in output, output
    assert results[0][0] == 1


def test_single_member_group_returns_at_once():
    started = time.monotonic()
    assert Rendezvous(["localhost:1"], 0, {}).run() is None
    assert time.monotonic() - started < 1.0


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="timeout"):
        Rendezvous(["a:1", "b:1"], 0, {}, timeout=0)
    with pytest.raises(ValueError, match="rank 2"):
        Rendezvous(["a:1", "b:1"], 2, {})


def test_describe_difference_lists_every_field():
    text = describe_difference({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4})
    assert "b: theirs=3, ours=2" in text and "c: theirs=4, ours=None" in text
