"""The JAX flat path: local replicated variables and ONE flat all-reduce of the gradients per step.

Why: under `keras.distribution.DataParallel`, XLA inserts a fused all-reduce of every gradient
inside Keras' jitted step; on CPU gloo that is 1.4–6× slower than one all-reduce of a single
flat vector. On this path every worker keeps ordinary single-device variables (identical
everywhere: broadcast from the chief when `strategy.scope()` is left and at the start of every
`fit` and `evaluate`) and Keras' train step is split in three:

1. a jitted **local** step on this worker's rows of the global batch: loss, gradients, metric
   updates; it returns the gradients times the local row count, flattened into one vector per
   dtype (the row count rides in the float32 vector);
2. **one cross-process all-reduce** per dtype, *outside* Keras' jit (a cross-process `pmap`
   called inside another jit silently does not average, so it must not be);
3. a jitted **apply**: divides by the global row count (the exact global-batch gradient even
   for uneven shards, and for a worker with no rows of a short last batch, which steps on a
   zero-weight dummy row) and runs `optimizer.stateless_apply`.

Metrics are updated locally; the summed metric states ride in the step's gradient all-reduce
(max/min/first states take one all-gather), so every step returns GLOBAL batch logs and
callbacks that stop on a logged value (TerminateOnNaN) decide alike on every worker. The local
states are also combined whenever Keras computes results for the logs (end of every epoch, end
of `evaluate`), so History and callbacks see global values everywhere. BatchNormalization
moving statistics ride along in the flat vector (weighted by rows), so they never drift apart;
the batch statistics themselves are per worker, which is why `auto` sends models with
BatchNormalization (and models with their own `train_step`) to the DataParallel path, where
XLA computes them over the global batch exactly as one process.

With `CommunicationOptions(compression=...)` the float32 gradients leave the local step as a
16-bit vector of their own (the row count, metric states and statistics stay in the exact float32
vector): fp16 is summed by `psum` in fp16; bf16 travels as an **all-gather** of its bits and is
summed in float32 in worker order inside the apply, because XLA on CPU widens a bf16 all-reduce
to float32 and would send float32 bytes (`keras_mwms.backends.compression`).

Path choice: `CommunicationOptions(jax_path=...)` — `"auto"` (default), `"flat"` or
`"dataparallel"` (environment override `KERAS_MWMS_JAX_PATH`), see `choose_path`.

Example:

>>> choose_path("auto", can_run=None), choose_path("auto", can_run="it overrides train_step")
('flat', 'dataparallel')
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mwms.backends import layer_state, policy
from keras_mwms.backends.compression import WIRE, wire_dtype
from keras_mwms.backends.jax.step_payload import (
    FlatLayout,
    MicroStepCounter,
    PayloadReader,
    accumulated_payload,
    gather_and_reduce,
    mark_float16_overflow,
    pack,
    unflatten,
    vector_dtypes,
)
from keras_mwms.backends.keras_api import attributes, internals, optimizer_attributes
from keras_mwms.diagnostics import LEDGER

FLAT = "flat"
DATA_PARALLEL = "dataparallel"
SINGLE = "single"
_MIN_BUCKET_WORDS = 256


def choose_path(requested: str, can_run: str | None) -> str:
    """The path a model trains on when the cluster runs the flat path.

    `requested` is `CommunicationOptions.jax_path`; `can_run` is `can_run_flat(model)` (None:
    the flat path reproduces one process exactly).

    * `auto`: the flat path for models it can run exactly (Keras' own `train_step`, no
      BatchNormalization unless per-worker statistics were chosen), the DataParallel path for
      the others;
    * `flat`: the flat path for every model that keeps Keras' own `train_step`
      (BatchNormalization then uses per-worker batch statistics, as TensorFlow's
      MultiWorkerMirroredStrategy does with `synchronized=False`);
    * `dataparallel`: `keras.distribution.DataParallel` over all global devices.

    Example:

    >>> choose_path("flat", can_run="BatchNormalization needs global batch statistics")
    'flat'
    """
    if can_run is None:
        return FLAT
    if can_run.startswith("it overrides") or requested != FLAT:
        return DATA_PARALLEL
    return FLAT


def bucket_words(words: int) -> int:
    """The padded length (a power of two, ≥ 256) of a broadcast, so few shapes get compiled.

    Example:

    >>> bucket_words(1), bucket_words(256), bucket_words(257)
    (256, 256, 512)
    """
    return max(_MIN_BUCKET_WORDS, 1 << max(0, int(words) - 1).bit_length())


class FlatCollectives:
    """Cross-process sums of one flat vector (one XLA collective each; gloo on CPU).

    Built once per backend on a `jax.pmap` over all global devices; each call takes and returns
    process-local arrays, so it composes with jitted local code around it.
    """

    def __init__(self, is_chief: bool):
        import jax

        self._local_devices = jax.local_device_count()
        self._is_chief = is_chief
        self._sum = jax.pmap(lambda value: jax.lax.psum(value, "workers"), axis_name="workers",
                             devices=jax.devices())
        self._gather = jax.pmap(lambda value: jax.lax.all_gather(value, "workers"), axis_name="workers",
                                devices=jax.devices())

    def all_reduce_sum(self, flat: Any) -> Any:
        """Σ over workers of a local 1-D array (one local device), as a local array."""
        if self._local_devices != 1:
            raise RuntimeError("the flat all-reduce serves workers with one local device")
        return self._sum(flat[None]).addressable_data(0)[0]

    def all_gather(self, flat: Any) -> Any:
        """Every worker's local 1-D array stacked in worker order, `(workers, size)`, as a local array."""
        if self._local_devices != 1:
            raise RuntimeError("the flat all-gather serves workers with one local device")
        return self._gather(flat[None]).addressable_data(0)[0]

    def broadcast(self, values: list[np.ndarray]) -> list[np.ndarray]:
        """The chief's arrays on every worker, bit for bit, in ONE collective (any dtypes).

        The bytes of all arrays travel as one int32 vector padded to a power of two: the chief
        sends its words, the others zeros, and an integer sum returns exactly the chief's bits
        (NaN payloads and -0.0 included) with few compiled shapes.
        """
        shapes = [np.shape(value) for value in values]
        values = [np.ascontiguousarray(value) for value in values]  # (0-d arrays come back 1-d)
        raw = b"".join(value.tobytes() for value in values) if self._is_chief else b""
        total = sum(value.nbytes for value in values)
        words = -(-total // 4)
        send = np.zeros((self._local_devices, bucket_words(words)), np.int32)
        if self._is_chief:
            send[0, :words] = np.frombuffer(raw + b"\0" * (words * 4 - total), np.int32)
        received = np.asarray(self._sum(send).addressable_data(0)[0]).tobytes()
        out, offset = [], 0
        for value, shape in zip(values, shapes):
            out.append(np.frombuffer(received[offset:offset + value.nbytes], value.dtype)
                       .reshape(shape).copy())
            offset += value.nbytes
        return out


# -- model state --------------------------------------------------------------------------
def model_state_variables(model) -> list:
    """Every variable of the model, its metrics and its optimizer that has a value, each once."""
    seen, variables = set(), []
    optimizer = getattr(model, "optimizer", None)
    groups = [model.variables, model.metrics_variables]
    if optimizer is not None:
        groups.append(optimizer.variables)  # `iterations` and the learning rate exist before build
    for group in groups:
        for variable in group:
            if id(variable) not in seen and attributes.variable_value(variable) is not None:
                seen.add(id(variable))
                variables.append(variable)
    return variables


def assign_values(variables: list, values: list[np.ndarray]) -> None:
    """Sets each variable to a host value (no communication); a variable that holds a global
    replicated array (DataParallel) gets a global array again, built from the local value."""
    import jax

    for variable, value in zip(variables, values):
        current = attributes.variable_value(variable)
        if isinstance(current, jax.Array) and not current.is_fully_addressable:
            attributes.set_variable_value(variable, jax.make_array_from_callback(
                value.shape, current.sharding, lambda index, value=value: value[index]))
        else:
            variable.assign(value)


def open_accumulators(model) -> list:
    """The accumulators of a gradient accumulation window a fit left open (else []).

    On the flat path each worker accumulates its own share between optimizer steps; a fit that
    ends mid-window leaves shares, which the next fit sums (chief) before it goes on.
    """
    optimizer = getattr(model, "optimizer", None)
    steps = policy.accumulation_steps(optimizer)
    if not steps or not getattr(optimizer, "built", False):
        return []
    if int(np.asarray(optimizer_attributes.iterations_variable(optimizer).value)) % steps == 0:
        return []
    return [variable for variable in optimizer_attributes.accumulated_gradients(optimizer) if variable is not None]


def split_like(flat: np.ndarray, variables: list) -> list[np.ndarray]:
    """`flat` cut into arrays shaped (and typed) like `variables`.

    Example:

    >>> from types import SimpleNamespace as V
    >>> [a.tolist() for a in split_like(np.arange(5.0), [V(shape=(2,), dtype="float32"),
    ...                                                  V(shape=(3,), dtype="float32")])]
    [[0.0, 1.0], [2.0, 3.0, 4.0]]
    """
    out, offset = [], 0
    for variable in variables:
        size = int(np.prod(variable.shape))
        out.append(np.asarray(flat[offset:offset + size]).astype(variable.dtype).reshape(variable.shape))
        offset += size
    return out


def can_run_flat(model, options: Any = None) -> str | None:
    """None if the flat path gives what the user asked for `model`, else the reason why not.

    BatchNormalization needs the global batch (the DataParallel path) unless `options` chose
    per-worker statistics (`CommunicationOptions.batch_norm_statistics="per_worker"`), which
    the flat path gives, with moving statistics averaged across workers.
    """
    from keras.layers import BatchNormalization

    if not internals.keras_own_train_step(model):
        return "it overrides train_step"
    for layer in attributes.flatten_layers(model):
        if isinstance(layer, BatchNormalization) and (
                options is None or policy.global_batch_norm_moments(layer, options)):
            return "BatchNormalization needs global batch statistics"
    return None


def _batch_norm_statistics_indices(model) -> list[int]:
    """BatchNormalization's moving statistics and the layers' own `aggregation="mean"` state
    (`keras_mwms.backends.layer_state`): averaged across workers, weighted by rows."""
    from keras.layers import BatchNormalization

    wanted = list(layer_state.aggregated_state(model)[1])
    for layer in attributes.flatten_layers(model):
        if isinstance(layer, BatchNormalization) and layer.trainable:
            wanted += [layer.moving_mean, layer.moving_variance]
    return _non_trainable_indices(model, wanted)


def _summed_state_indices(model) -> list[int]:
    """The layers' own `aggregation="sum"` state: every worker's change is added after the step."""
    return _non_trainable_indices(model, layer_state.aggregated_state(model)[0])


def _non_trainable_indices(model, variables: list) -> list[int]:
    """Where `variables` sit in `model.non_trainable_variables` (the step state's order)."""
    wanted = {id(variable) for variable in variables}
    return [i for i, variable in enumerate(model.non_trainable_variables) if id(variable) in wanted]


# -- the split train step -----------------------------------------------------------------
def make_flat_train_step(model, collectives: FlatCollectives, guard: Callable[[Callable], Any],
                         all_gather: Callable[[np.ndarray], np.ndarray], compression: str | None = None):
    """Keras' `train_step(state, data)` for `model`, split around one flat all-reduce per dtype.

    The step returns GLOBAL batch logs: summed metric states ride in the same all-reduce as the
    gradients, other states (max/min/first) are all-gathered. `guard(call)` runs a collective
    and turns a lost peer into `WorkerLostError`; `all_gather` stacks host arrays of all workers.
    `compression` (`CommunicationOptions.compression`) sends float32 gradients in 16 bits.

    With `gradient_accumulation_steps=K` (`policy.accumulation_steps`, uncompressed) a
    micro-step all-reduces only its row count, statistics and metric states (labelled
    `guard(call, "row all-reduce")`) and hands Keras this worker's share `rows · g / R` to
    accumulate; the K-th also all-reduces accumulators + share once and zeroes the
    accumulators, so Keras applies `Σ_k g_k / K`, one process's update, bit-identical everywhere.
    """
    step = FlatTrainStep(model, collectives, guard, all_gather, flat_layout(model, compression))

    def train_step(state, data):
        with LEDGER.train_step(caller=3):   # Keras' iterator_step, then fit/train_on_batch
            return step(state, *internals.unpack_x_y_sample_weight(data))

    return train_step


def flat_layout(model, compression: str | None = None) -> FlatLayout:
    """Which of `model`'s step values travel in which flat vector (`step_payload.FlatLayout`)."""
    import jax

    # Metric states summed across workers ride in the gradient all-reduce (batch logs are then
    # global at no extra collective); max/min/first states, if any, take one all-gather per step.
    reductions = [policy.metric_reduction(metric, variable) for metric in model.metrics for variable in metric.variables]
    metric_dtypes = [str(variable.dtype) for variable in model.metrics_variables]
    # Gradient dtypes sent in 16 bits, each as a vector of its own (the others stay exact).
    gradient_dtypes = [str(variable.dtype) for variable in model.trainable_variables]
    wires = {dtype: wire_dtype(compression, dtype) for dtype in dict.fromkeys(gradient_dtypes)
             if wire_dtype(compression, dtype)}
    dtypes = vector_dtypes([dtype for dtype in gradient_dtypes if dtype not in wires],
                           [metric_dtypes[i] for i, op in enumerate(reductions) if op == "sum"])
    # Under a LossScaleOptimizer each worker differentiates 1 / workers of its shard's mean loss:
    # per row, the float16 values of the scaled backward are then one process's, so a step
    # overflows (and is skipped) at the loss scale one process's does. Undone on the gradients.
    from keras.optimizers import LossScaleOptimizer

    scaled_loss = isinstance(model.optimizer, LossScaleOptimizer)
    return FlatLayout(
        dtypes=dtypes, wires=wires, statistics=_batch_norm_statistics_indices(model), reductions=reductions,
        share=1.0 / jax.process_count() if scaled_loss else 1.0,
        # ... and a summed gradient one process computes in float16 is inf beyond float16's range.
        float16=policy.float16_gradients(model) if scaled_loss else [False] * len(model.trainable_variables),
        # Gradient accumulation: micro-steps keep their gradients local, the K-th all-reduces the sum.
        accumulating=policy.accumulation_steps(model.optimizer) if not wires else 0)


class FlatTrainStep:
    """One model's train step on the flat path: a jitted local part, the collectives, a jitted apply.

    Called with Keras' step state and an unpacked batch, it returns `(logs, state)` as Keras'
    `train_step` does (see `make_flat_train_step`); what travels is `layout`'s.
    """

    def __init__(self, model, collectives: FlatCollectives, guard: Callable[..., Any],
                 all_gather: Callable[[np.ndarray], np.ndarray], layout: FlatLayout):
        import jax

        self._model, self._optimizer, self.layout = model, model.optimizer, layout
        self._collectives, self._guard, self._all_gather = collectives, guard, all_gather
        counter = optimizer_attributes.iterations_variable(self._optimizer)
        self._micro_steps = MicroStepCounter(next((i for i, variable in enumerate(self._optimizer.variables)
                                                   if variable is counter), None))
        # Everything committed to this worker's device: otherwise the first steps (variables fresh
        # from numpy are "uncommitted", step outputs are "committed") compile the step three times.
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        self._device, self._summed_state = device, _summed_state_indices(model)
        self._local = jax.jit(self.local_part, in_shardings=device, out_shardings=device)
        self._apply = jax.jit(self.apply_part, donate_argnums=(0, 1, 2), static_argnums=(7,), in_shardings=device,
                              out_shardings=device)
        self._payload = jax.jit(self.update_payload, in_shardings=device, out_shardings=device)

    def __call__(self, state, x, y, sample_weight):
        layout = self.layout
        trainable, non_trainable, optimizer_variables, metrics = state
        rows = policy.rows_of(x)
        if rows == 0:   # no rows of a short last batch: one zero-weight row joins the collectives
            x, y, sample_weight = policy.dummy_row(x), policy.dummy_row(y), np.zeros((1,), np.float32)
        payloads, new_non_trainable, new_metrics, logs, local_gathered, local_grads = self._local(
            trainable, non_trainable, optimizer_variables, metrics, x, y, sample_weight, np.float32(rows))
        sums = self._all_reduce(payloads)
        reduced = self._guard(lambda: gather_and_reduce(
            local_gathered, [layout.reductions[i] for i in layout.gathered], self._all_gather)) if layout.gathered else []
        accumulated, update = self._accumulate(local_grads, sums, optimizer_variables)
        # The layers' summed state: this worker's change (none from a dummy row), read before the
        # apply takes the local values over.
        changes = [np.asarray(new_non_trainable[i]) - np.asarray(non_trainable[i]) if rows
                   else np.zeros_like(np.asarray(non_trainable[i])) for i in self._summed_state]
        trainable, new_non_trainable, optimizer_variables, global_logs = self._apply(
            trainable, new_non_trainable, optimizer_variables, new_metrics, sums, reduced, accumulated, update)
        if self._summed_state:
            new_non_trainable = self._add_every_workers_change(non_trainable, new_non_trainable, changes)
        if layout.accumulating:   # Keras' apply counted one micro-step
            self._micro_steps.advanced(after=optimizer_variables)
        # Batch logs are global, as on TensorFlow and torch: callbacks that stop on a logged value
        # (TerminateOnNaN, a batch-level EarlyStopping) decide alike on every worker. Local logs
        # let one worker stop a step early and the others hang in the next collective.
        if not logs or set(logs) == set(global_logs):
            logs = global_logs
        return logs, (trainable, new_non_trainable, optimizer_variables, new_metrics)

    def _add_every_workers_change(self, before: list, after: list, changes: list) -> list:
        """`aggregation="sum"` state: its value before the step plus every worker's change (one
        all-gather of the changes, summed in worker order: the same on every worker)."""
        import jax

        flat = np.concatenate([change.reshape(-1).astype(np.float32) for change in changes])
        totals = self._guard(lambda: self._all_gather(flat)).sum(axis=0)
        after, offset = list(after), 0
        for i, change in zip(self._summed_state, changes):
            total = totals[offset:offset + change.size].reshape(change.shape)
            offset += change.size
            after[i] = jax.device_put((np.asarray(before[i]) + total).astype(change.dtype), self._device)
        return after

    def loss_share(self, *args, **kwargs):
        """Keras' loss and updates, the loss times `layout.share`."""
        loss, aux = self._model.compute_loss_and_updates(*args, **kwargs)
        share = self.layout.share
        return (loss * share if share != 1.0 else loss), aux

    def local_part(self, trainable, non_trainable, optimizer_variables, metrics, x, y, sample_weight, rows):
        """Jitted: loss, gradients and metric updates on this worker's rows; the vectors to send."""
        import jax
        import jax.numpy as jnp

        layout = self.layout
        grad_fn = jax.value_and_grad(self.loss_share, has_aux=True)
        (_, aux), grads = grad_fn(trainable, non_trainable, metrics, x, y, sample_weight, training=True,
                                  optimizer_variables=optimizer_variables)
        unscaled_loss, y_pred, non_trainable, new_metrics = aux
        logs, new_metrics = attributes.update_metrics_variables(self._model, new_metrics, unscaled_loss, x, y, y_pred,
                                                                sample_weight)
        # A worker with no rows ran on a dummy row: its metric states must not count it.
        metrics = [jnp.where(rows > 0, new, old) for new, old in zip(new_metrics, metrics)]
        local_grads = [grad * rows.astype(grad.dtype) for grad in grads] if layout.accumulating else []
        payloads = pack(layout, grads if not layout.accumulating else (),
                        [non_trainable[i] for i in layout.statistics], [metrics[i] for i in layout.summed], rows)
        return payloads, non_trainable, metrics, logs, [metrics[i] for i in layout.gathered], local_grads

    def apply_part(self, trainable, non_trainable, optimizer_variables, metrics, sums, reduced_gathered,
                   accumulated=None, update=False):
        """Jitted: the global gradients, statistics and metric states read back; the optimizer applied."""
        import jax.numpy as jnp

        layout = self.layout
        reader = PayloadReader(layout, sums)
        if accumulated is None:
            grads = [reader.take(variable, gradient=True) for variable in trainable]
        elif update:   # Σ_w (accumulator + share): Keras adds its zeroed accumulators, divides by K
            grads = unflatten(accumulated, trainable)
            optimizer_variables = list(optimizer_variables)
            for position in self.accumulator_positions():
                optimizer_variables[position] = jnp.zeros_like(optimizer_variables[position])
        else:          # this worker's share: Keras adds it to its accumulators
            grads = [grad / reader.total_rows.astype(grad.dtype) for grad in accumulated]
        grads = mark_float16_overflow(grads, layout.float16)
        non_trainable = list(non_trainable)
        for i in layout.statistics:
            non_trainable[i] = reader.take(non_trainable[i])
        global_metrics = list(metrics)
        for i in layout.summed:
            global_metrics[i] = reader.take(metrics[i], scale=False)
        for i, value in zip(layout.gathered, reduced_gathered):
            global_metrics[i] = value.astype(metrics[i].dtype).reshape(metrics[i].shape)
        trainable, optimizer_variables = self._optimizer.stateless_apply(optimizer_variables, grads, trainable)
        return trainable, non_trainable, optimizer_variables, self.global_results(global_metrics)

    def global_results(self, global_metrics):
        """Metric results from the all-worker state (the local state itself stays local)."""
        from keras import StatelessScope

        with StatelessScope(state_mapping=list(zip(self._model.metrics_variables, global_metrics))):
            return self._model.get_metrics_result()

    def accumulator_positions(self) -> list[int]:
        """Where each trainable variable's accumulator sits in the optimizer's variables."""
        optimizer = self._optimizer
        position = {id(variable): i for i, variable in enumerate(optimizer.variables)}
        return [position[id(optimizer_attributes.accumulator_of(optimizer, variable))]
                for variable in self._model.trainable_variables]

    def update_payload(self, local_grads, sums, optimizer_variables):
        """Jitted: this worker's accumulators plus its share of the last micro-step, one vector per dtype."""
        total_rows = sums[self.layout.dtypes.index("float32")][-1]
        return accumulated_payload(local_grads, [optimizer_variables[position]
                                                 for position in self.accumulator_positions()], total_rows)

    def _all_reduce(self, payloads: tuple) -> list:
        """The step's vectors summed over workers (bf16 ones all-gathered), in one guarded wait."""
        import jax

        exact, collectives = len(self.layout.dtypes), self._collectives
        # Waited for inside the guard (the apply needs it next anyway): the ledger then times
        # the all-reduce itself, not JAX's asynchronous dispatch of it.
        reduce = (lambda call: self._guard(call, "row all-reduce")) if self.layout.accumulating else self._guard
        sums = reduce(lambda: jax.block_until_ready(
            [collectives.all_reduce_sum(payload) for payload in payloads[:exact]]
            + [collectives.all_gather(payload) if wire == "bfloat16" else collectives.all_reduce_sum(payload)
               for payload, wire in zip(payloads[exact:], self.layout.wires.values())]))
        WIRE.add(sum(payload.size * payload.dtype.itemsize for payload in payloads))
        return sums

    def _accumulate(self, local_grads: list, sums: list, optimizer_variables) -> tuple[Any, bool]:
        """`(accumulated, update)` for the apply: `(None, False)` without accumulation, this
        worker's share on a micro-step, the all-reduced accumulators + share on the K-th."""
        import jax

        if not self.layout.accumulating:
            return None, False
        if (self._micro_steps.current(optimizer_variables) + 1) % self.layout.accumulating != 0:
            return local_grads, False
        payload = self._payload(local_grads, sums, optimizer_variables)
        accumulated = self._guard(lambda: jax.block_until_ready(
            [self._collectives.all_reduce_sum(vector) for vector in payload]))
        WIRE.add(sum(vector.size * vector.dtype.itemsize for vector in payload))
        return accumulated, True


def skip_empty_test_step(model, test_step: Callable) -> Callable:
    """`test_step` that leaves the state alone on a worker with no rows in this step."""

    def step(state, data):
        x = data[0] if isinstance(data, (tuple, list)) else data
        if policy.rows_of(x) == 0:
            return {}, state
        return test_step(state, data)

    return step


def iterator_function(model, step: Callable, concatenate_outputs: bool = False) -> Callable:
    """Keras' `(state, iterator) -> (outputs, state)` function around a step of keras_mwms'.

    keras_mwms' steps (the flat train and test steps, the local predict step) run their own
    jitted parts, and collectives or host reads between them, so they must not be jitted whole,
    as Keras 3.16's `_make_function` does with every step. This is Keras 3.15's loop:
    `steps_per_execution` steps a call, fewer where the epoch ends; predict's outputs of those
    steps concatenated.

    Example:

    >>> from types import SimpleNamespace
    >>> run = iterator_function(SimpleNamespace(steps_per_execution=2), lambda state, batch: (batch, state + 1))
    >>> run(0, iter([10, 20, 30])), run(0, iter([30]))
    ((20, 2), (30, 1))
    """
    def iterator_step(state, iterator):
        outputs, state = step(state, next(iterator))
        collected = [outputs]
        try:
            for _ in range(model.steps_per_execution - 1):
                outputs, state = step(state, next(iterator))
                collected.append(outputs)
        except StopIteration:
            pass
        if concatenate_outputs and len(collected) > 1:
            import jax.numpy as jnp
            from keras import tree

            outputs = tree.map_structure(lambda *parts: jnp.concatenate(parts, axis=0), *collected)
        return outputs, state

    return iterator_step


def warn_flat_batch_norm(model, reason: str) -> None:
    """Warns that `model` runs on the flat path although it cannot reproduce one process there."""
    warnings.warn(f"jax_path='flat' (KERAS_MWMS_JAX_PATH=flat): {type(model).__name__} runs on the "
                  f"flat path although {reason}; BatchNormalization uses per-worker batch statistics "
                  "(moving statistics stay identical), so results differ from one process. Use "
                  "jax_path='auto' (KERAS_MWMS_JAX_PATH=auto) for global statistics, or "
                  "batch_norm_statistics='per_worker' to choose per-worker statistics.", stacklevel=4)
