"""Metric states and logs made global on torch: every worker logs what one process logs.

Metric state is reduced across workers when results are computed: after every training step
(the batch logs) and at the end of every epoch and of `evaluate`, so History and callbacks
agree everywhere (`GlobalMetrics`). A custom `train_step`/`test_step` (Keras' "customizing
what happens in fit()" guide) returns logs computed from its shard: they are made global at
every step (`global_logs`). Metrics updated from `(y, y_pred)` equal one process; a metric the
step updates once with a scalar (the guide's `metric.update_state(loss)`) averages the
workers' values of each step, which equals one process when every worker holds rows of the
step (a worker with an empty shard of a short last batch adds nothing, so that step weighs
less).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from keras_mwms.backends import policy
from keras_mwms.backends.keras_api import attributes
from keras_mwms.backends.torch.state import STATE

if TYPE_CHECKING:
    from keras_mwms.backends.torch.engine import TorchEngine


def metric_snapshot(model) -> list[torch.Tensor]:
    return [variable.value.data.clone() for variable in model.metrics_variables]


def metric_restore(model, snapshot) -> None:
    with torch.no_grad():
        for variable, saved in zip(model.metrics_variables, snapshot):
            variable.value.data.copy_(saved)


def metric_variables(model) -> list:
    """(metric, variable) pairs of every metric state, in `GlobalMetrics`' order."""
    return [(metric, variable) for metric in model.metrics for variable in metric.variables]



def local_metric_results(model) -> dict:
    """`{metric.name: metric.result()}` of this worker's metric states, detached copies."""
    return {metric.name: materialized(metric.result()) for metric in model.metrics}


def materialized(logs):
    """`logs` with every metric state variable a result returned read now, while `GlobalMetrics`
    holds the global state (a `result()` may return the variable itself)."""
    from keras import tree

    if logs is None:
        return logs
    with torch.no_grad():
        return tree.map_structure(_detached, logs)


def _detached(value):
    # A metric's `result()` may return its state variable itself (`return self.running_max`):
    # copy its value now, or the "result" reads whatever the variable holds later (the local
    # state again once `GlobalMetrics` has put it back).
    if not torch.is_tensor(value) and torch.is_tensor(getattr(value, "value", None)):
        value = value.value
    return value.detach().clone() if torch.is_tensor(value) else value


def _numeric_leaves(value) -> list[torch.Tensor] | None:
    """The leaves of a log value as flat float64 tensors, or None if one is not a number."""
    from keras import tree

    leaves = []
    for leaf in tree.flatten(value):
        if leaf is None or isinstance(leaf, (str, bytes)):
            return None
        try:
            tensor = leaf.detach() if torch.is_tensor(leaf) else torch.as_tensor(leaf)
            leaves.append(tensor.to(torch.float64).reshape(-1))
        except (TypeError, ValueError, RuntimeError):
            return None
    return leaves


def _same_values(value, reference) -> bool:
    mine, theirs = _numeric_leaves(value), _numeric_leaves(reference)
    return (mine is not None and theirs is not None and len(mine) == len(theirs)
            and all(a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
                    for a, b in zip(mine, theirs)))


def _like(value: torch.Tensor, leaf) -> torch.Tensor:
    """`value` in the shape, floating dtype and device of the log leaf it replaces."""
    template = leaf if torch.is_tensor(leaf) else torch.as_tensor(leaf)
    dtype = template.dtype if template.is_floating_point() else torch.get_default_dtype()
    return value.reshape(template.shape).to(device=template.device, dtype=dtype)


def global_logs(model, backend: TorchEngine, logs, rows: int, local_results: dict,
                metric_logs_now: bool = True):
    """A training or test step's logs, identical on every worker and as one process logs them.

    Logs of Keras' own steps are the metric results: reduced as metric states (sum, min/max).
    A custom step (Keras' "customizing what happens in fit()" guides) returns what it likes,
    computed from this worker's shard: a value equal to a metric's local result under that
    metric's name (`{m.name: m.result() for m in self.metrics}`) becomes the metric's global
    result; any other number (the step's own loss, say) the mean over workers weighted by their
    rows, as one process would compute it on the global batch. Which is which is agreed in one
    small all-reduce, so every worker issues the same collectives whatever its values.
    Logs that are exactly the metric results are left to `_get_metrics_result_or_logs`: at
    once for a training step (`metric_logs_now`), when `evaluate` ends for a test step.
    """
    flat_keys = set()
    for name, result in local_results.items():
        flat_keys.update(result if isinstance(result, dict) else (name,))
    if not isinstance(logs, dict) or set(logs) == flat_keys:
        return attributes.metrics_result_or_logs(model, logs) if metric_logs_now else logs
    numeric = {key: leaves for key, value in logs.items()
               if (leaves := _numeric_leaves(value)) is not None}
    flags = [float(key in local_results and _same_values(logs[key], local_results[key]))
             for key in numeric]
    payload = [torch.tensor(flags + [float(rows)], dtype=torch.float64)]
    payload += [leaf * float(rows) for leaves in numeric.values() for leaf in leaves]
    reduced = backend.all_reduce_flat([tensor.to(backend.device) for tensor in payload],
                                      what="custom step log all-reduce")
    agreed, total_rows = reduced[0][:-1], float(reduced[0][-1])
    from_metrics = [key for key, count in zip(numeric, agreed.tolist())
                    if count == backend.num_workers]
    global_results = {}
    if from_metrics and total_rows != rows * backend.num_workers:
        _warn_custom_logs_on_uneven_rows(from_metrics)
    if from_metrics:
        with GlobalMetrics(model, backend):
            global_results = local_metric_results(model)
    result, position = dict(logs), 1
    from keras import tree

    for key, leaves in numeric.items():
        sums = reduced[position:position + len(leaves)]
        position += len(leaves)
        if key in from_metrics:
            result[key] = global_results[key]
        elif total_rows > 0:
            means = [_like(total / total_rows, leaf)
                     for total, leaf in zip(sums, tree.flatten(logs[key]))]
            result[key] = tree.pack_sequence_as(logs[key], means)
    STATE.of(model).global_logs = result
    return result


_warned_custom_logs = [False]


def _warn_custom_logs_on_uneven_rows(keys) -> None:
    """Says once that a custom step's own trackers weigh workers, not rows, on uneven steps.

    A tracker a custom `train_step` updates once per step with its shard's value (the guide's
    `loss_tracker.update_state(loss)`) gets one update per worker; on a step whose global batch
    splits unevenly (a short last batch, a batch not divisible by the workers) one process
    would weigh the rows instead, so the logged value differs slightly from one process. The
    gradients are the global batch's either way.
    """
    if _warned_custom_logs[0]:
        return
    _warned_custom_logs[0] = True
    warnings.warn(
        f"keras_mwms (torch): a custom train_step/test_step logged {sorted(keys)} from trackers "
        "it updates once per step; on this step the workers held different numbers of rows, so "
        "these logs weigh each worker's value equally where one process would weigh rows (the "
        "weights are trained on the global batch all the same). For logs equal to one process, "
        "use a global batch divisible by the number of workers and a dataset size divisible by "
        "the global batch, or Keras' built-in train_step.", stacklevel=2)


class GlobalMetrics:
    """Context: metric state variables hold the global (all-worker) state, then local again.

    Each state variable combines as `keras_mwms.backends.policy.metric_reduction` says: one
    flat all-reduce per reduction (sum, max, min), a broadcast for the chief's. `summed`, when
    given, holds the global states already (summed in the step's last gradient bucket,
    `keras_mwms.backends.torch.gradients.StepExtras`): they are copied in without another
    all-reduce.

    Example (one process: nothing to reduce, the states stay this process's):

    >>> import keras
    >>> from types import SimpleNamespace as Object
    >>> alone = Object(all_reduce_flat=lambda tensors, **kwargs: [t.clone() for t in tensors],
    ...                broadcast_tensors=lambda tensors, **kwargs: None)
    >>> mean = keras.metrics.Mean()
    >>> mean.update_state([1.0, 3.0])
    >>> with GlobalMetrics(Object(metrics=[mean]), alone):
    ...     float(mean.result())
    2.0
    """

    def __init__(self, model, backend: TorchEngine, summed=None):
        self.model = model
        self.backend = backend
        self.summed = summed

    def __enter__(self):
        pairs = metric_variables(self.model)
        self.saved = [variable.value.data.clone() for _, variable in pairs]
        self.pairs = pairs
        if self.summed is not None and len(self.summed) == len(pairs):
            with torch.no_grad():
                for (_, variable), value in zip(pairs, self.summed):
                    variable.value.data.copy_(value)
            return self
        by_op: dict[str, list] = {}
        for metric, variable in pairs:
            by_op.setdefault(policy.metric_reduction(metric, variable), []).append(variable)
        for op, variables in by_op.items():
            tensors = [variable.value.data for variable in variables]
            if op == "first":
                self.backend.broadcast_tensors(tensors, what="metric broadcast")
                continue
            reduced = self.backend.all_reduce_flat(tensors, op=op, what="metric all-reduce")
            with torch.no_grad():
                for tensor, value in zip(tensors, reduced):
                    tensor.copy_(value)
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for (_, variable), saved in zip(self.pairs, self.saved):
                variable.value.data.copy_(saved)
        return False
