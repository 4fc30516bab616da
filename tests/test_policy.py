"""The shared policy runs on any engine: a fourth, in-process backend with no ML framework.

`ThreadBackend` is what a new backend has to write — a subclass of the engine interface
(`keras_mwms.backends.base.Backend`) with a collective port, plus its patch rows — and nothing
else. Its workers are threads of this process meeting at a `threading.Barrier`; the shared
policy (row checks, first-batch digests, metric reduction, lost-worker message) runs on it
unchanged. A last test proves the policy modules import no ML framework at all.
"""

from __future__ import annotations

import contextlib
import faulthandler
import subprocess
import sys
import threading
import types
import warnings

import numpy as np
import pytest

from keras_mwms import WorkerLostError, active
from keras_mwms.backends import policy
from keras_mwms.backends.base import Backend
from keras_mwms.backends.patches import ANY_KERAS, Patch, PatchTable
from keras_mwms.communication import BATCH_NORM_STATISTICS_ENV, CommunicationOptions
from keras_mwms.startup.cluster import SimpleClusterResolver

WAIT_SECONDS = 10.0

# The fake backend's one "private patch": a module attribute standing in for a Keras internal.
patched_internals = types.SimpleNamespace(step=lambda batch: f"step on {batch}")


class ThreadRoom:
    """Where the worker threads of one fake job meet: a barrier and one slot per worker."""

    def __init__(self, workers: int, timeout: float = WAIT_SECONDS):
        self.barrier = threading.Barrier(workers, timeout=timeout)
        self.slots: list = [None] * workers
        self.alive = set(range(workers))   # what a real engine learns from heartbeats or pids


class ThreadBackend(Backend):
    """A complete backend for the shared policy: workers are threads, collectives a barrier."""

    name = "threads"

    def __init__(self, room: ThreadRoom, worker_index: int, workers: int):
        resolver = SimpleClusterResolver(
            {"worker": [f"localhost:{2000 + index}" for index in range(workers)]}, "worker", worker_index)
        super().__init__(resolver, CommunicationOptions(lost_worker_exit_seconds=600))
        self.room = room

    @staticmethod
    def version() -> str:
        return "0"

    def join(self) -> None:
        self.barrier("join")

    def patch_table(self) -> PatchTable:
        return PatchTable(self.name, [Patch(
            name="threads-step", target=patched_internals, attribute="step",
            replacement=lambda original: lambda *args, **kwargs: "distributed " + original(*args, **kwargs),
            works_around="a stand-in for a Keras internal", keras_versions=ANY_KERAS,
            parameters=("batch",))])

    def _exchange(self, value, where: str) -> list:
        """Every worker's `value`, in worker order; a missing worker becomes `WorkerLostError`."""
        try:
            self.room.barrier.wait()
            self.room.slots[self.worker_index] = value
            self.room.barrier.wait()
            values = list(self.room.slots)
            self.room.barrier.wait()
        except threading.BrokenBarrierError as error:
            self.worker_lost(where, error, sorted(set(range(self.num_workers)) - self.room.alive))
        return values

    def all_reduce(self, value, op="sum"):
        parts = np.stack(self._exchange(np.asarray(value), f"all-reduce ({op})"))
        return policy.reduce_gathered(parts, op)

    def broadcast_object(self, value, root=0):
        return self._exchange(value, "broadcast")[root]

    def barrier(self, name="barrier"):
        self._exchange(name, f"barrier {name!r}")

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers

    def scope(self):
        return contextlib.nullcontext()

    def run(self, fn, args=(), kwargs=None):
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op, value, axis):
        return self.all_reduce(np.asarray(value), "sum")

    def experimental_local_results(self, value):
        return (value,)

    def experimental_distribute_dataset(self, dataset, options=None):
        return dataset

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        return dataset_fn(None)


def on_workers(workers: int, body, timeout: float = WAIT_SECONDS) -> list:
    """Runs `body(backend)` on every thread-worker; returns results (or exceptions) in order."""
    room = ThreadRoom(workers, timeout)
    results: list = [None] * workers

    def work(index):
        backend = ThreadBackend(room, index, workers)
        try:
            backend.join()
            results[index] = body(backend)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[index] = error

    threads = [threading.Thread(target=work, args=(index,), daemon=True) for index in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * WAIT_SECONDS)
    assert not any(thread.is_alive() for thread in threads), "a thread-worker hung"
    return results


def test_port_defaults_gather_broadcast_and_agree():
    def body(backend):
        gathered = backend.all_gather(np.array([backend.worker_index * 10, 1]))
        arrays = backend.broadcast_arrays([np.full(2, backend.worker_index)], root=2)
        return gathered.tolist(), arrays[0].tolist(), backend.agreed_seed(backend.worker_index + 7)

    results = on_workers(3, body)
    assert results == [([[0, 1], [10, 1], [20, 1]], [2, 2], 7)] * 3


def test_same_rows_pass_and_uneven_rows_fail_on_every_worker():
    even = on_workers(2, lambda backend: policy.check_same_rows(backend, np.zeros((6, 2)), "x"))
    assert even == [None, None]
    uneven = on_workers(2, lambda backend: policy.check_same_rows(
        backend, np.zeros((6 + backend.worker_index, 2)), "x"))
    assert all(isinstance(error, ValueError) for error in uneven), uneven
    assert "6" in str(uneven[0]) and "7" in str(uneven[0])


def test_different_first_batches_warn_on_every_worker():
    def body(backend):
        digest = f"{backend.worker_index + 1:016x}"
        policy.check_same_rows(backend, None, "a tf.data dataset", digest=digest)

    # `catch_warnings` is process-wide, so it wraps all thread-workers at once.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert on_workers(2, body) == [None, None]
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 2, messages
    assert all("start with different global batches" in message for message in messages)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_workers(2, lambda backend: policy.check_same_rows(backend, None, "same", digest="ab" * 8))
    assert not caught


class Variable:
    def __init__(self, name, value, aggregation="sum"):
        self.name, self.value, self.aggregation = name, np.asarray(value, np.float32), aggregation

    def assign(self, value):
        self.value = np.asarray(value, np.float32)


def test_global_metric_state_reduces_by_the_shared_rule_and_restores():
    def body(backend):
        index = backend.worker_index
        metric = types.SimpleNamespace(variables=[
            Variable("total", [1.0 + index, 2.0]), Variable("count", [3.0]),
            Variable("max", [float(index)]), Variable("min", [float(5 - index)]),
            Variable("seed", [float(index)], aggregation="only_first_replica")])
        model = types.SimpleNamespace(metrics=[metric])
        with policy.GlobalMetricState(model, backend):
            inside = [variable.value.tolist() for variable in metric.variables]
        after = [variable.value.tolist() for variable in metric.variables]
        return inside, after

    results = on_workers(3, body)
    inside = results[0][0]
    assert inside == [[6.0, 6.0], [9.0], [2.0], [3.0], [0.0]]
    assert all(result[0] == inside for result in results)
    assert results[1][1] == [[2.0, 2.0], [3.0], [1.0], [4.0], [1.0]]


def test_lost_worker_is_named_in_the_one_format():
    def body(backend):
        if backend.worker_index == 1:
            backend.room.alive.discard(1)   # worker 1 "dies" before the collective
            return "gone"
        try:
            backend.barrier("epoch end")
        finally:
            faulthandler.cancel_dump_traceback_later()

    results = on_workers(2, body, timeout=1.0)
    error = results[0]
    assert isinstance(error, WorkerLostError), error
    assert error.lost_workers == [1] and error.where == "barrier 'epoch end'"
    assert str(error).startswith("keras_mwms worker 0: lost worker 1 (worker:1 at localhost:2001) "
                                 "during barrier 'epoch end'")
    assert "BackupAndRestore" in str(error)


def test_patch_rows_install_and_close_restores():
    backend, strategy = ThreadBackend(ThreadRoom(1), 0, 1), object()
    active.begin(strategy, backend, lambda session: session.install(backend.patch_table()))
    assert patched_internals.step("b") == "distributed step on b"
    active.end(strategy)
    assert patched_internals.step("b") == "step on b"
    assert active.active_backend() is None and active.changed_state() == []


def test_a_strategy_that_fails_to_start_leaves_nothing_patched():
    backend, strategy = ThreadBackend(ThreadRoom(1), 0, 1), object()

    def setup(session):
        session.install(backend.patch_table())
        raise RuntimeError("the next table cannot be installed")

    with pytest.raises(RuntimeError, match="cannot be installed"):
        active.begin(strategy, backend, setup)
    assert patched_internals.step("b") == "step on b" and active.active_strategy() is None


def test_patch_signature_check_refuses_a_changed_target():
    holder = types.SimpleNamespace(step=lambda data: data)
    table = PatchTable("threads", [Patch("needs-batch", holder, lambda original: original,
                                         "a test", attribute="step", keras_versions=ANY_KERAS,
                                         parameters=("batch",))])
    with pytest.raises(RuntimeError, match="lacks batch"):
        table.install()
    assert not table.installed


def test_policy_imports_no_ml_framework():
    code = ("import sys\n"
            "import keras_mwms.backends.policy, keras_mwms.backends.patches, keras_mwms.backends.base\n"
            "import tests.test_policy\n"
            "loaded = sorted({'keras', 'tensorflow', 'jax', 'torch'} & set(sys.modules))\n"
            "print(loaded)\n")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip() == "[]", completed.stdout


@pytest.mark.parametrize("requested, gpus, nccl_usable, expected, warns", [
    ("AUTO", 0, None, "RING", False),
    ("AUTO", 2, None, "NCCL", False),
    ("AUTO", 2, False, "RING", False),      # GPUs, but a build without NCCL
    ("RING", 2, None, "RING", False),
    ("NCCL", 1, None, "NCCL", False),
    ("NCCL", 0, None, "RING", True),        # TF and JAX fall back, saying so
    ("NCCL", 1, False, "RING", True),
])
def test_one_rule_picks_ring_or_nccl(requested, gpus, nccl_usable, expected, warns):
    from keras_mwms.communication import CommunicationImplementation as Impl

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = policy.choose_implementation(Impl[requested], gpus, "Fake", "sockets", nccl_usable=nccl_usable)
    assert chosen is Impl[expected]
    messages = [str(w.message) for w in caught]
    assert bool(messages) == warns, messages
    if warns:
        assert "Fake collectives use RING (sockets)" in messages[0] and "NCCL was requested" in messages[0]


def test_batch_norm_moments_are_global_unless_per_worker_is_chosen(monkeypatch):
    """One rule for every backend; the environment variable only fills an argument left None."""
    monkeypatch.delenv(BATCH_NORM_STATISTICS_ENV, raising=False)
    ordinary, synchronized = types.SimpleNamespace(synchronized=False), types.SimpleNamespace(synchronized=True)
    default, per_worker = CommunicationOptions(), CommunicationOptions(batch_norm_statistics="per-worker")
    assert (default.batch_norm_statistics, per_worker.batch_norm_statistics) == ("global", "per_worker")
    assert policy.global_batch_norm_moments(ordinary, default)
    assert not policy.global_batch_norm_moments(ordinary, per_worker)
    assert policy.global_batch_norm_moments(synchronized, per_worker)
    monkeypatch.setenv(BATCH_NORM_STATISTICS_ENV, "per_worker")
    assert CommunicationOptions().batch_norm_statistics == "per_worker"
    assert CommunicationOptions(batch_norm_statistics="global").batch_norm_statistics == "global"
    monkeypatch.setenv(BATCH_NORM_STATISTICS_ENV, "local")
    with pytest.raises(ValueError, match=f"{BATCH_NORM_STATISTICS_ENV}='local' is not .*'per_worker'"):
        CommunicationOptions()
