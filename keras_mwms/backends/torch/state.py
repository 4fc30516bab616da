"""keras_mwms' state of Keras models and optimizers on torch, kept beside them (`ObjectState`).

Per model (`STATE.of(model)`; its backend is `backend_of(model)`, the tag of
`keras_mwms.backends.model_scope`: untagged models are left to Keras):

| name | what |
|---|---|
| `synced` | the chief's variables were broadcast to it |
| `batch_norm_statistics` | its unsynchronized BatchNormalization moving statistics (collected once per `fit`) |
| `overlap` | its `OverlappedGradients` (gradient buckets reduced during backward) |
| `step_metric_sums` | the global metric states summed in the step's last gradient bucket |
| `metric_rides` | how many steps' metric states rode in a gradient bucket (a diagnostic count) |
| `global_logs` | a custom step's logs, made global when the step ended |
| `train_function`, `test_function` | the distributed step functions made for it |
| `compile_options` | its compiled train step got `keras_mwms.backends.torch.compile_options` |

Per optimizer: `model` (a weak reference to the model it trains), `fused_steps` (Adam updates
run by `keras_mwms.backends.torch.fused_adam`), `adam_scratch` (that update's two buffers).

Example:

>>> class Model: pass
>>> model = Model()
>>> backend_of(model) is None, diagnostics(model)
(True, {'overlap_buckets': 0, 'metric_states_in_gradient_bucket': 0, 'fused_adam_steps': 0, 'compile_options': 0})
"""

from __future__ import annotations

from typing import Any

from keras_mwms import active
from keras_mwms.backends import model_scope
from keras_mwms.backends.patches import ObjectState

STATE = ObjectState()


def _close_and_forget() -> None:
    """A strategy's `close()`: every model's gradient hooks removed (they hold its engine), then
    every object's state forgotten."""
    for namespace in STATE.namespaces():
        overlap = getattr(namespace, "overlap", None)
        if overlap is not None:
            overlap.close()
    STATE.clear()


active.register(__name__, "STATE", reset=_close_and_forget, state=STATE.__len__)


def backend_of(model: Any) -> Any:
    """The backend of a model created in `strategy.scope()`; None for any other model."""
    return model_scope.backend_of(model)


def model_of(optimizer: Any) -> Any:
    """The model (created in `strategy.scope()`) that `optimizer` trains, or None."""
    reference = STATE.get(optimizer, "model")
    return reference() if reference is not None else None


def diagnostics(model: Any) -> dict[str, int]:
    """Counters of the torch fast paths a model took (read by the tests and benchmarks).

    `overlap_buckets`: gradient buckets reduced during backward (0: none);
    `metric_states_in_gradient_bucket`: steps whose metric states were summed in the last
    gradient bucket; `fused_adam_steps`: Adam updates run by the in-place update;
    `compile_options`: 1 if its compiled train step got `backends.torch.compile_options`.
    """
    overlap = STATE.get(model, "overlap")
    optimizer = getattr(model, "optimizer", None)
    return {
        "overlap_buckets": len(overlap.buckets) if overlap is not None else 0,
        "metric_states_in_gradient_bucket": int(STATE.get(model, "metric_rides", 0)),
        "fused_adam_steps": int(STATE.get(optimizer, "fused_steps", 0)) if optimizer is not None else 0,
        "compile_options": int(STATE.get(model, "compile_options", False)),
    }
