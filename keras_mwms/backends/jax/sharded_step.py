"""The JAX DataParallel path's train step with the gradient collective in keras_mwms' hands.

On the DataParallel path (BatchNormalization with global moments, a custom `train_step`,
several devices per worker) Keras' step runs SPMD over global arrays and XLA inserts the
gradient all-reduce inside it: every micro-step of gradient accumulation sends the whole
gradient, in float32. When `gradient_accumulation_steps=K` or `compression` is asked for,
keras_mwms runs the same `model.train_step` inside `jax.shard_map` over the mesh instead:

* each device sees its rows; the trainable variables enter as *device-varying* values, so
  `jax.grad` in the step leaves each device's gradient local (no collective);
* the step's `optimizer.stateless_apply` is intercepted: on a micro-step the device's share of
  the global mean gradient goes to a per-device window buffer (kept by this object, one row per
  device) and Keras' optimizer gets zeros (its accumulators stay zero, its `iterations` count);
  on the K-th (every step without accumulation) the window plus the share is summed over the
  devices in ONE collective, in 16 bits when compressing (`compression`'s rules: fp16 summed by
  `psum`, bf16 all-gathered and summed in float32 in device order), and Keras' apply divides by K
  and updates, as one process;
* BatchNormalization's moments are summed over the devices (`[Σx, Σx²]` and the rows, one small
  `psum`, differentiable: the backward pass sums their cotangents), metric states are combined
  (sums `psum`, max/min `pmax`/`pmin`), so logs, moving statistics and metrics are global.

A batch whose rows do not divide over the devices is replicated (`data.GlobalArrayPlacer`):
every device computes the whole batch, and only the first device's share and metric updates
count (no statistics collective). The step is chosen per call on the host from the optimizer's
micro-step count, so a micro-step's program has no gradient collective at all; each update is
counted in the collective ledger (`gradient all-reduce`) with its bytes (`WIRE`).

The loss must be a mean over the batch (Keras' default reduction), as on the flat path: the
global gradient is the mean of the devices' gradients. A model with random layers (Dropout,
noise) keeps XLA's step, gradients all-reduced every micro-step in float32 (a warning says so
when compression was asked for): in `shard_map` each device would draw its mask from the same
seed, not one process's mask over the global batch.

Example:

>>> wanted(None, 0), wanted("bf16", 0), wanted(None, 4)
(False, True, True)
"""

from __future__ import annotations

import contextlib

import numpy as np

from keras_mwms.backends import policy
from keras_mwms.backends.compression import WIRE, wire_dtype
from keras_mwms.backends.jax.step_payload import MicroStepCounter, from_wire, to_wire
from keras_mwms.backends.keras_api import attributes, optimizer_attributes

_TRACING: list = []   # (axis name, batch sharded) while a sharded step is traced


def wanted(compression: str | None, accumulation_steps: int) -> bool:
    """Whether the DataParallel path should run this module's step instead of XLA's."""
    return bool(compression) or accumulation_steps > 0


def draws_random_numbers(model) -> str | None:
    """The first layer of `model` holding a `keras.random.SeedGenerator` (Dropout, noise), or None.

    In `shard_map` such a layer would draw each device's mask from the same seed, not one
    process's mask over the global batch, so those models keep XLA's step (exact).
    """
    from keras.random import SeedGenerator

    for layer in attributes.flatten_layers(model):
        if any(isinstance(value, SeedGenerator) for value in vars(layer).values()):
            return layer.name
    return None


def tracing_sharded_batch() -> bool:
    """Whether a sharded step whose batch is split over the devices is being traced now."""
    return bool(_TRACING) and _TRACING[-1][1]


def global_moments(inputs, axes: tuple) -> tuple:
    """BatchNormalization's mean and variance over every device's rows (one `psum`), while traced."""
    import jax
    import jax.numpy as jnp

    axis = _TRACING[-1][0]
    rows = float(np.prod([inputs.shape[a] for a in axes]))
    sums = jax.lax.psum(jnp.stack([jnp.sum(inputs, axes), jnp.sum(inputs * inputs, axes)]), axis)
    total = rows * jax.lax.psum(1, axis)
    mean = sums[0] / total
    return mean, jnp.maximum(sums[1] / total - mean * mean, 0.0)


class ShardedTrainStep:
    """`model.train_step` inside `shard_map` with one gradient collective per optimizer step.

    Called with Keras' step state and a batch of global arrays, it returns `(logs, state)`.
    """

    def __init__(self, model, mesh, axis: str, compression: str | None):
        self._model, self._optimizer, self._mesh, self._axis = model, model.optimizer, mesh, axis
        self._devices = int(mesh.devices.size)
        self._steps = policy.accumulation_steps(self._optimizer)
        self._wires = [wire_dtype(compression, str(v.dtype)) for v in model.trainable_variables]
        self._reductions = [policy.metric_reduction(metric, variable)
                            for metric in model.metrics for variable in metric.variables]
        self._micro_steps = MicroStepCounter(next(i for i, variable in enumerate(self._optimizer.variables)
                                                  if variable is optimizer_attributes.iterations_variable(self._optimizer)))
        self._window = None
        self._compiled: dict = {}

    def __call__(self, state, data):
        import jax

        from keras_mwms.diagnostics import LEDGER

        leaves = [leaf for leaf in jax.tree_util.tree_leaves(data)]
        sharded = bool(leaves) and all(not leaf.sharding.is_fully_replicated for leaf in leaves)
        update = not self._steps or (self._micro_steps.current(state[2]) + 1) % self._steps == 0
        if self._steps and self._window is None:
            self._window = self._zeros()
        key = (sharded, update, jax.tree_util.tree_structure(data))
        if key not in self._compiled:
            self._compiled[key] = self._build(sharded, update, data)
        logs, state, self._window = self._compiled[key](state, data, self._window)
        if self._steps:
            self._micro_steps.advanced(after=state[2])
        if update:
            LEDGER.kinds["gradient all-reduce"] += 1
            WIRE.add(sum(int(np.prod(v.shape)) * (2 if wire else np.dtype(str(v.dtype)).itemsize)
                         for v, wire in zip(self._model.trainable_variables, self._wires)))
        return logs, state

    def _zeros(self):
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = NamedSharding(self._mesh, PartitionSpec(self._axis))
        return [jax.device_put(jnp.zeros((self._devices,) + tuple(v.shape), v.dtype), sharding)
                for v in self._model.trainable_variables]

    def _build(self, sharded: bool, update: bool, data):
        import jax
        from jax.sharding import PartitionSpec

        axis = self._axis
        data_spec = jax.tree_util.tree_map(lambda _: PartitionSpec(axis) if sharded else PartitionSpec(), data)
        window_spec = PartitionSpec(axis) if self._steps else PartitionSpec()

        def body(state, batch, window):
            return self._body(state, batch, window, sharded, update)

        mapped = jax.shard_map(body, mesh=self._mesh, in_specs=(PartitionSpec(), data_spec, window_spec),
                               out_specs=(PartitionSpec(), PartitionSpec(), window_spec))
        return jax.jit(mapped, donate_argnums=(2,))

    def _body(self, state, batch, window, sharded: bool, update: bool):
        import jax
        import jax.numpy as jnp

        axis = self._axis
        trainable, non_trainable, optimizer_variables, metrics = state
        first = (jax.lax.axis_index(axis) == 0)
        # A device's weight in the global mean: 1/devices of equal shards, all-or-nothing for a
        # replicated batch (every device computed all of it; the first one counts).
        weight = (1.0 / self._devices) if sharded else first.astype(jnp.float32)
        applied = []

        def stateless_apply(optimizer_vars, grads, _trainable):
            shares = [_varying(g, axis) * jnp.asarray(weight, g.dtype) for g in grads]
            if self._steps:
                totals = [w[0] + s for w, s in zip(window, shares)]
            else:
                totals = shares
            if update:
                grads = [self._sum(total, wire) for total, wire in zip(totals, self._wires)]
                new_window = [jnp.zeros_like(w) for w in window] if self._steps else window
            else:
                grads = [jnp.zeros(g.shape, g.dtype) for g in grads]
                new_window = [t[None] for t in totals]
            applied.append(new_window)
            return original(optimizer_vars, grads, trainable)   # Keras' own, bound below

        with _tracing(axis, sharded), _intercept(self._optimizer, stateless_apply) as original:
            logs, (new_trainable, new_non_trainable, optimizer_variables, new_metrics) = self._model.train_step(
                (jax.lax.pcast(trainable, axis, to="varying"), non_trainable, optimizer_variables, metrics),
                batch)
        if not applied:
            raise ValueError(f"keras_mwms: {type(self._model).__name__}.train_step did not call "
                             "self.optimizer.stateless_apply(optimizer_variables, grads, trainable_variables); "
                             "the JAX DataParallel step with gradient accumulation or compression all-reduces "
                             "the gradients there. Apply the gradients with it, or leave out "
                             "gradient_accumulation_steps and compression.")
        one = lambda value: _varying(value, axis) * jnp.asarray(weight, value.dtype)   # noqa: E731
        new_non_trainable = [_mean_if_varying(new, one, axis) for new in new_non_trainable]
        global_metrics = []
        for old, new, operation in zip(metrics, new_metrics, self._reductions):
            if operation == "sum":   # every device's update counts, of a replicated batch the first's
                delta = _varying(new - old, axis)
                global_metrics.append(old + jax.lax.psum(delta if sharded else delta * first.astype(delta.dtype),
                                                         axis))
            elif operation in ("max", "min"):
                reduce = jax.lax.pmax if operation == "max" else jax.lax.pmin
                global_metrics.append(reduce(_varying(new, axis), axis))
            else:
                global_metrics.append(jax.lax.psum(_varying(new, axis) * first.astype(new.dtype), axis))
        results = self._global_results(global_metrics)
        if isinstance(logs, dict) and set(logs) <= set(results):
            logs = {key: results[key] for key in logs}
        else:
            logs = jax.tree_util.tree_map(lambda value: _mean_if_varying(value, one, axis), logs)
        state = (new_trainable, new_non_trainable, optimizer_variables, global_metrics)
        return logs, state, applied[-1]

    def _sum(self, total, wire):
        import jax

        axis = self._axis
        if wire is None:
            return jax.lax.psum(total, axis)
        gather = _all_gather_invariant() if wire == "bfloat16" else None
        if gather is not None:
            return from_wire(gather(to_wire(total, wire), axis), str(total.dtype), wire)
        return jax.lax.psum(total.astype(wire), axis).astype(total.dtype)

    def _global_results(self, global_metrics):
        from keras import StatelessScope

        with StatelessScope(state_mapping=list(zip(self._model.metrics_variables, global_metrics))):
            return self._model.get_metrics_result()


def _all_gather_invariant():
    """JAX's all-gather whose result is typed the same on every device (private in jax 0.10;
    `jax.lax.all_gather`'s is typed per device, which a replicated output refuses). Without
    it bf16 is summed by `psum` in bf16 (XLA on CPU then sends float32 bytes)."""
    try:
        from jax._src.lax.parallel import all_gather_invariant
    except ImportError:
        return None
    return all_gather_invariant


def _varying(value, axis: str):
    import jax

    return value if axis in jax.typeof(value).manual_axis_type.varying else jax.lax.pcast(value, axis, to="varying")


def _mean_if_varying(value, one, axis: str):
    import jax

    if not hasattr(value, "dtype") or axis not in jax.typeof(value).manual_axis_type.varying:
        return value
    return jax.lax.psum(one(value), axis)


@contextlib.contextmanager
def _tracing(axis: str, sharded: bool):
    _TRACING.append((axis, sharded))
    try:
        yield
    finally:
        _TRACING.pop()


@contextlib.contextmanager
def _intercept(optimizer, replacement):
    """`optimizer.stateless_apply` replaced on the instance while the step is traced."""
    original = optimizer.stateless_apply
    optimizer.stateless_apply = replacement
    try:
        yield original
    finally:
        del optimizer.stateless_apply


def make_sharded_train_step(model, backend) -> ShardedTrainStep:
    """The DataParallel path's step for `model` (see the module docstring)."""
    return ShardedTrainStep(model, backend.mesh, backend.distribution.batch_dim_name, backend.options.compression)
