"""The pre-flight rendezvous with real processes (keras_mwms/rendezvous.py); no ML backend."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from keras_mwms.cluster import make_tf_config
from keras_mwms.launch import find_free_ports
from keras_mwms.rendezvous import Rendezvous, describe_difference
from tests.multiworker import WORKERS_DIR, worker_env

SCRIPT = str(WORKERS_DIR / "rendezvous_worker.py")


def start_workers(addresses_per_worker, indices, extra_env=None, timeout=20):
    """Starts one process per (address list, index); returns the Popen objects."""
    processes = []
    for position, (addresses, index) in enumerate(zip(addresses_per_worker, indices)):
        env = {**os.environ, **worker_env(), "RDV_TIMEOUT": str(timeout),
               "TF_CONFIG": make_tf_config(addresses, index)}
        env.update((extra_env or {}).get(position, {}))
        processes.append(subprocess.Popen([sys.executable, "-u", SCRIPT], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return processes


def collect(processes, deadline_seconds):
    """Waits for every process (killing stragglers at the deadline); returns (code, seconds, output)."""
    deadline = time.monotonic() + deadline_seconds
    results = []
    try:
        for process in processes:
            try:
                output, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
                results.append((None, None, output))
                continue
            line = next((line for line in output.splitlines() if line.startswith("RESULT")), "")
            seconds = float(line.split()[2]) if line else None
            results.append((process.returncode, seconds, output))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def addresses(count):
    return [f"localhost:{port}" for port in find_free_ports(count)]


def test_three_workers_meet_and_release_their_ports():
    cluster = addresses(3)
    results = collect(start_workers([cluster] * 3, [0, 1, 2]), 60)
    for code, _, output in results:
        assert code == 0, output


def test_missing_worker_is_named_within_timeout():
    cluster = addresses(3)
    timeout = 6
    results = collect(start_workers([cluster] * 2, [0, 1], timeout=timeout), 60)
    for code, seconds, output in results:
        assert code == 1, output
        assert seconds <= timeout + 5, output
        assert "worker:2" in output and cluster[2] in output, output


def test_mismatched_cluster_order_fails_fast_naming_the_odd_worker():
    cluster = addresses(3)
    odd = [cluster[0], cluster[2], cluster[1]]
    results = collect(start_workers([cluster, cluster, odd], [0, 1, 2], timeout=30), 60)
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
    results = collect(start_workers([cluster] * 2, [0, 1], {1: {"FAKE_KERAS": "3.9.0"}}, timeout=30), 60)
    for code, seconds, output in results:
        assert code == 1, output
        assert seconds < 10, output
        assert "keras" in output and "3.9.0" in output, output
    assert "worker:1" in results[0][2]


def test_duplicate_index_fails_fast():
    # Both processes claiming worker:1 are up before the chief (which starts 1.5 s late), so
    # the duplicate is seen before any verdict and the whole gang must stop.
    cluster = addresses(2)
    results = collect(start_workers([cluster] * 3, [0, 1, 1], {0: {"RDV_START_DELAY": "1.5"}},
                                    timeout=30), 60)
    codes = [code for code, _, _ in results]
    assert codes == [1, 1, 1], results
    assert any("already in use" in output for _, _, output in results)
    assert all(seconds is not None and seconds < 10 for _, seconds, _ in results), results


def test_port_taken_by_another_program_is_named():
    cluster = addresses(2)
    import socket

    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host, port = cluster[1].split(":")
        squatter.bind((host, int(port)))
        squatter.listen(1)
        results = collect(start_workers([cluster] * 2, [0, 1], timeout=5), 40)
    code, seconds, output = results[1]
    assert code == 1 and "already in use by another program" in output, output
    assert results[0][0] == 1


def test_single_member_group_returns_at_once():
    Rendezvous(["localhost:1"], 0, {}).run()


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="timeout"):
        Rendezvous(["a:1", "b:1"], 0, {}, timeout=0)
    with pytest.raises(ValueError, match="rank 2"):
        Rendezvous(["a:1", "b:1"], 2, {})


def test_describe_difference_lists_every_field():
    text = describe_difference({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4})
    assert "b: theirs=3, ours=2" in text and "c: theirs=4, ours=None" in text
