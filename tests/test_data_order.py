"""The resumable data order's pure logic: permutations, positions, resume, ledger replay, triggers.

Multi-worker behaviour (kills, restarts, other worker counts) is in `tests/test_exact_resume.py`
and `tests/test_elastic_resume.py`; here one process checks the rules they rely on.
"""

from __future__ import annotations

import numpy as np
import pytest

from keras_mwms.example_ledger import effective_steps
from keras_mwms.resume.data_order import DataOrder, epoch_permutation
from keras_mwms.resume.resumable_inputs import wants_resumable_order


def test_each_epoch_is_a_permutation_fixed_by_seed_and_epoch_alone():
    for epoch in range(4):
        order = epoch_permutation(11, epoch, 97)
        assert sorted(order.tolist()) == list(range(97))
        np.testing.assert_array_equal(order, epoch_permutation(11, epoch, 97))
    assert epoch_permutation(11, 0, 97).tolist() != epoch_permutation(11, 1, 97).tolist()
    assert epoch_permutation(11, 0, 97).tolist() != epoch_permutation(12, 0, 97).tolist()
    # The raw Philox stream NumPy keeps stable across releases: a backup restores this order.
    assert epoch_permutation(1, 0, 8).tolist() == epoch_permutation(1, 0, 8).tolist()


@pytest.mark.parametrize("units,per_step,drop,steps", [(60, 8, False, 8), (60, 8, True, 7), (64, 8, True, 8)])
def test_stream_positions_cover_every_unit_once_per_epoch(units, per_step, drop, steps):
    order = DataOrder(seed=5, units=units, units_per_step=per_step, drop_remainder=drop)
    assert order.steps_per_epoch == steps
    for epoch in range(3):
        ids = np.concatenate([order.units_at(order.position(epoch, step)) for step in range(steps)])
        expected = list(range(units)) if not drop else sorted(epoch_permutation(5, epoch, units)[:steps * per_step])
        assert sorted(ids.tolist()) == sorted(expected)
        assert order.locate(order.position(epoch, steps - 1)) == (epoch, steps - 1)


def test_resume_takes_the_backup_seed_and_position():
    saved = DataOrder(seed=123, units=60, units_per_step=8)
    state = saved.state(1, 5)
    restored = DataOrder(seed=999, units=60, units_per_step=8)
    step, message = restored.resume(state, 1, 5)
    assert (step, message) == (5, None)
    assert restored.seed == 123 and restored.locate(restored.start) == (1, 5)
    np.testing.assert_array_equal(restored.units_at(restored.start), saved.units_at(saved.position(1, 5)))


def test_a_changed_global_batch_resumes_at_the_last_boundary_and_says_so():
    state = DataOrder(seed=1, units=60, units_per_step=8).state(0, 5)   # 40 rows trained
    order = DataOrder(seed=2, units=60, units_per_step=12)
    step, message = order.resume(state, 0, 5)
    assert step == 3                                                     # rows 36.. again
    assert "global batch changed from 8 to 12" in message and "4 row(s)" in message
    assert message.count("\n") == 0


def test_a_different_input_size_is_said():
    state = DataOrder(seed=1, units=60, units_per_step=8).state(0, 2)
    step, message = DataOrder(seed=1, units=50, units_per_step=8).resume(state, 0, 2)
    assert step == 2 and "the input changed since the backup" in message


def test_effective_steps_drop_what_a_crash_lost():
    lines = [{"event": "begin", "epoch": 0, "step": 0},
             *({"epoch": 0, "step": step, "ids": [step]} for step in range(5)),
             {"event": "begin", "epoch": 0, "step": 3},                      # backup at step 3
             *({"epoch": 0, "step": step, "ids": [10 + step]} for step in range(3, 6))]
    steps = effective_steps(lines)
    assert [steps[(0, step)]["ids"][0] for step in range(6)] == [0, 1, 2, 13, 14, 15]


def test_only_resumable_callbacks_change_the_order():
    class Backup:
        keras_mwms_resumable_order = True

    class CallbackList:
        callbacks = [object(), Backup()]

    assert wants_resumable_order([Backup()]) and wants_resumable_order(CallbackList())
    assert not wants_resumable_order([object()]) and not wants_resumable_order(None)


def test_a_reshuffling_tf_data_input_resumes_approximately_and_says_why():
    tf = pytest.importorskip("tensorflow")
    from keras_mwms.resume import resumable_inputs

    class Backup:
        keras_mwms_resumable_order = True

    class Model:
        pass

    class Port:
        @staticmethod
        def broadcast_object(value, root=0):
            return value

    model = Model()
    rows = tf.data.Dataset.range(10)
    cases = {"reshuffles": rows.shuffle(10, seed=1).batch(2),
             "unseeded": rows.shuffle(10, reshuffle_each_iteration=False).batch(2),
             "exact": rows.shuffle(10, seed=1, reshuffle_each_iteration=False).batch(2)}
    for name, dataset in cases.items():
        arguments = {"x": dataset, "callbacks": [Backup()]}
        resumable_inputs.prepare_fit(Port(), model, arguments)
        assert arguments["x"] is dataset   # tf.data is never replaced
        step, pull, message = resumable_inputs.resume(model, None, 1, 2)
        assert (step, pull) == (2, True)
        if name == "exact":
            assert message is None
        else:
            assert message.startswith("BackupAndRestore: this fit reads a tf.data.Dataset"), message
            assert ("reshuffle_each_iteration" if name == "reshuffles" else "without a seed") in message
    # Nothing to warn about at the very start of training.
    assert resumable_inputs.resume(model, None, 0, 0)[2] is None
