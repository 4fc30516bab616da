"""The flat path's traffic, piece by piece (`keras_mwms/backends/jax/step_payload.py`).

Pure JAX in this process, no Keras model and no gang: several workers are simulated by summing
(or stacking) the vectors each would send, which is what the all-reduce (all-gather) returns.
The whole step is checked against one process by the JAX gangs (tests/test_backend_jax.py,
test_accumulation.py, test_compression.py, test_user_scripts.py).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from keras_mwms.backends import policy  # noqa: E402
from keras_mwms.backends.jax.step_payload import (  # noqa: E402
    FlatLayout,
    MicroStepCounter,
    PayloadReader,
    accumulated_payload,
    from_wire,
    gather_and_reduce,
    mark_float16_overflow,
    pack,
    to_wire,
    unflatten,
    vector_dtypes,
)

pytestmark = pytest.mark.jax

EXACT, HALF = dict(rtol=1e-6), dict(rtol=1e-2, atol=1e-3)   # float32 sums; float16 ones round
ROWS = [5.0, 0.0, 3.0]   # uneven shards, one worker without rows (it steps on a zero-weight row)


def all_reduce(per_worker: list[tuple]) -> list:
    """What the flat all-reduce returns: each vector summed over workers, in worker order."""
    return [sum(vectors[1:], vectors[0]) for vectors in zip(*per_worker)]


def worker_values(worker: int) -> dict:
    rng = np.random.default_rng(worker)
    return {"kernel": jnp.asarray(rng.normal(size=(2, 3)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
            "half": jnp.asarray(rng.normal(size=(4,)), jnp.float16),
            "moving_mean": jnp.asarray(rng.normal(size=(3,)), jnp.float32),
            "count": jnp.asarray(float(worker + 1), jnp.float32)}


def test_vector_dtypes_keep_first_seen_order_and_always_carry_float32():
    assert vector_dtypes(["float16", "float64"], ["float64", "int32"]) == ["float16", "float64", "int32", "float32"]
    assert vector_dtypes(["float32", "float16"], []) == ["float32", "float16"]


def test_layout_splits_summed_from_gathered_metric_states():
    layout = FlatLayout(dtypes=["float32"], reductions=["sum", "max", "sum", "first"])
    assert (layout.summed, layout.gathered) == ([0, 2], [1, 3])


def test_packed_sums_read_back_as_the_row_weighted_global_mean():
    layout = FlatLayout(dtypes=vector_dtypes(["float32", "float32", "float16"], ["float32"]),
                        statistics=[0], reductions=["sum"])
    sent = []
    for worker, rows in enumerate(ROWS):
        values = worker_values(worker)
        sent.append(pack(layout, [values["kernel"], values["bias"], values["half"]], [values["moving_mean"]],
                         [values["count"]], jnp.float32(rows)))
    assert [str(vector.dtype) for vector in sent[0]] == ["float32", "float16"]
    reader = PayloadReader(layout, all_reduce(sent))
    like = worker_values(0)
    read = {name: reader.take(like[name], gradient=True) for name in ("kernel", "bias", "half")}
    read["moving_mean"] = reader.take(like["moving_mean"])
    read["count"] = reader.take(like["count"], scale=False)
    assert float(reader.total_rows) == sum(ROWS)
    for name in ("kernel", "bias", "half", "moving_mean"):
        expected = sum(np.asarray(worker_values(w)[name], np.float64) * rows for w, rows in enumerate(ROWS)) / sum(ROWS)
        assert read[name].shape == like[name].shape and read[name].dtype == like[name].dtype
        np.testing.assert_allclose(read[name], expected, **HALF if name == "half" else EXACT)
    assert float(read["count"]) == 1.0 + 2.0 + 3.0   # summed metric states: not weighted, not divided


def test_loss_share_is_undone_on_the_gradients_only():
    # Under a LossScaleOptimizer each of 2 workers differentiates half its shard's mean loss.
    layout, gradient, statistic = FlatLayout(dtypes=["float32"], statistics=[0], share=0.5), 3.0, 4.0
    sent = [pack(layout, [jnp.array([gradient * layout.share])], [jnp.array([statistic])], [], jnp.float32(rows))
            for rows in (2.0, 6.0)]
    reader = PayloadReader(layout, all_reduce(sent))
    assert reader.take(jnp.zeros(1), gradient=True).tolist() == [gradient]
    assert reader.take(jnp.zeros(1)).tolist() == [statistic]


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_compressed_gradients_travel_in_16_bits_and_everything_else_exact(wire):
    layout = FlatLayout(dtypes=["float32"], wires={"float32": wire}, statistics=[0])
    gradients = [jnp.asarray(np.random.default_rng(w).normal(size=(8,)), jnp.float32) for w in range(3)]
    statistic = jnp.asarray([1.0 + 2 ** -20], jnp.float32)   # not representable in 16 bits
    sent = [pack(layout, [gradients[w]], [statistic], [], jnp.float32(1)) for w in range(3)]
    exact, compressed = sent[0]
    assert exact.dtype == jnp.float32 and compressed.size == 8
    assert str(compressed.dtype) == ("uint16" if wire == "bfloat16" else "float16")
    # fp16 is all-reduced in fp16; bf16's bits are all-gathered and summed here in worker order.
    exact_sum, compressed_sum = all_reduce(sent)
    reduced = jnp.stack([vectors[1] for vectors in sent]) if wire == "bfloat16" else compressed_sum
    reader = PayloadReader(layout, [exact_sum, reduced])
    mean = reader.take(jnp.zeros(8, jnp.float32), gradient=True)
    assert mean.dtype == jnp.float32
    rounded = sum(np.asarray(g.astype(wire).astype(jnp.float32), np.float64) for g in gradients) / 3
    np.testing.assert_allclose(mean, rounded, **HALF if wire == "float16" else EXACT)
    assert reader.take(statistic).tolist() == statistic.tolist()


def test_bf16_sum_runs_in_worker_order_in_float32():
    parts = [jnp.array([1.0], jnp.float32), jnp.array([2.0 ** -9], jnp.float32), jnp.array([-1.0], jnp.float32)]
    gathered = jnp.stack([to_wire(part, "bfloat16") for part in parts])
    assert from_wire(gathered, "float32", "bfloat16").tolist() == [2.0 ** -9]   # bf16 alone would lose it
    assert from_wire(jnp.array([3.0], jnp.float16), "float32", "float16").dtype == jnp.float32


def test_float16_overflow_marks_only_flagged_gradients_at_the_float16_edge():
    edge = policy.FLOAT16_OVERFLOW
    gradient = jnp.array([edge - 1.0, edge, -edge, 1.0], jnp.float32)
    flagged, kept = mark_float16_overflow([gradient, gradient], [True, False])
    assert flagged.tolist() == [edge - 1.0, np.inf, np.inf, 1.0]
    assert kept.tolist() == gradient.tolist()


def test_accumulation_shares_add_up_to_the_mean_of_the_global_micro_batches():
    # 2 workers, K = 3 micro-steps with uneven rows: each micro-step hands Keras this worker's
    # share rows·g/R; the K-th all-reduces accumulators + share: Σ_k (global mean g_k).
    rows_by_step = [(4.0, 2.0), (1.0, 5.0), (3.0, 3.0)]
    rng = np.random.default_rng(0)
    like = [jnp.zeros((2, 2), jnp.float32), jnp.zeros((3,), jnp.float16), jnp.zeros((1,), jnp.float32)]
    gradients = [[[jnp.asarray(rng.normal(size=v.shape), v.dtype) for v in like] for _ in range(2)]
                 for _ in rows_by_step]
    accumulators = [[jnp.zeros_like(v) for v in like] for _ in range(2)]
    for step, rows in enumerate(rows_by_step[:-1]):
        for worker in range(2):
            share = [g * rows[worker] / sum(rows) for g in gradients[step][worker]]
            accumulators[worker] = [a + s for a, s in zip(accumulators[worker], share)]
    rows = rows_by_step[-1]
    payloads = [accumulated_payload([g * rows[w] for g in gradients[-1][w]], accumulators[w], jnp.float32(sum(rows)))
                for w in range(2)]
    assert [str(vector.dtype) for vector in payloads[0]] == ["float32", "float16"]
    total = unflatten(all_reduce(payloads), like)
    for index, variable in enumerate(like):
        expected = sum(sum(np.asarray(gradients[k][w][index], np.float64) * r[w] for w in range(2)) / sum(r)
                       for k, r in enumerate(rows_by_step))
        assert total[index].shape == variable.shape and total[index].dtype == variable.dtype
        np.testing.assert_allclose(total[index], expected, **HALF if variable.dtype == jnp.float16 else EXACT)


def test_gathered_metric_states_reduce_in_one_all_gather():
    calls = []

    def three_workers(flat):
        calls.append(flat.dtype)
        return np.stack([flat, flat + 1, flat - 5])

    peak, first = np.array([2.0, 7.0], np.float32), np.array(3.0, np.float32)
    maxima, firsts, minima = gather_and_reduce([peak, first, peak], ["max", "first", "min"], three_workers)
    assert calls == [np.float64]
    assert (maxima.tolist(), firsts.tolist(), minima.tolist()) == ([3.0, 8.0], [3.0], [-3.0, 2.0])


def test_micro_step_counter_reads_the_device_only_for_a_foreign_state():
    reads = []

    class Iterations:
        def __init__(self, value):
            self.value = value

        def __int__(self):
            reads.append(self.value)
            return self.value

    counter = MicroStepCounter(position=1)
    state = ["momentum", Iterations(4)]
    assert counter.current(state) == 4 and counter.current(state) == 4
    after = ["momentum", Iterations(5)]
    counter.advanced(after=after)
    assert counter.current(after) == 5                           # the last apply's state: no read
    assert counter.current(["momentum", Iterations(0)]) == 0    # restored: read again
    assert reads == [4, 0]
