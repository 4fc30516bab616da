"""The Keras 3.15.1 patches keras_mwms applies on the JAX backend, each named and guarded.

Installed by `JaxBackend.join()` and removed by `leave()`. Every patch checks that a keras_mwms
JAX backend is active and otherwise calls the original Keras code unchanged.

* `broadcast-initial-values` — Keras places a new replicated variable with `jax.device_put`,
  which across processes asserts the value is equal everywhere ("not the same on each
  process", keras-team/keras#19246-style seed mismatch) and aborts when workers seed
  differently. We broadcast the chief's value instead (tf.distribute's MWMS does the same).
* `global-batches` — `fit`/`evaluate`/`predict` refuse numpy input on several processes, hang on
  uneven shards and crash on a partial last batch (auto-sharding needs equal local shapes).
  We read the global batch on every worker and build the global arrays ourselves
  (`keras_mwms.backends.jax_data`); `_distribute_data` lets such arrays through untouched.
* `predict-gathers-outputs` — `predict` fails with "Fetching value for jax.Array that spans
  non-addressable devices"; we all-gather each batch's outputs, in order, to every worker.
* `chief-progress-bar` — only the chief prints progress; the logs stay global everywhere.
* `worker-lost` — a gloo failure caused by a dead peer becomes `WorkerLostError` naming it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from keras_mwms.backends.base import require_tested_keras

_state: dict[str, Any] = {"backend": None, "originals": {}}


def active_backend():
    """The joined `JaxBackend`, or None when keras_mwms is not in charge."""
    return _state["backend"]


def install(backend) -> None:
    """Applies every patch (idempotent) and makes `backend` the one the patches serve."""
    require_tested_keras("jax: broadcast-initial-values, global-batches, predict-gathers-outputs")
    _state["backend"] = backend
    if _state["originals"]:
        return
    from keras.src.backend.jax import distribution_lib as jax_distribution_lib
    from keras.src.backend.jax import trainer as jax_trainer

    originals = _state["originals"]
    originals["distribute_tensor"] = jax_distribution_lib.distribute_tensor
    originals["_distribute_data"] = jax_trainer._distribute_data
    for name in ("fit", "evaluate", "predict", "make_predict_function"):
        originals[name] = getattr(jax_trainer.JAXTrainer, name)

    jax_distribution_lib.distribute_tensor = _distribute_tensor
    jax_trainer._distribute_data = _distribute_data
    jax_trainer.JAXTrainer.fit = functools.wraps(originals["fit"])(_fit)
    jax_trainer.JAXTrainer.evaluate = functools.wraps(originals["evaluate"])(_evaluate)
    jax_trainer.JAXTrainer.predict = functools.wraps(originals["predict"])(_predict)
    jax_trainer.JAXTrainer.make_predict_function = _make_predict_function


def uninstall(backend) -> None:
    """Restores Keras' originals once `backend` leaves."""
    if _state["backend"] is not backend:
        return
    _state["backend"] = None
    originals = _state["originals"]
    if not originals:
        return
    from keras.src.backend.jax import distribution_lib as jax_distribution_lib
    from keras.src.backend.jax import trainer as jax_trainer

    jax_distribution_lib.distribute_tensor = originals.pop("distribute_tensor")
    jax_trainer._distribute_data = originals.pop("_distribute_data")
    for name in ("fit", "evaluate", "predict", "make_predict_function"):
        setattr(jax_trainer.JAXTrainer, name, originals.pop(name))


# -- broadcast-initial-values -------------------------------------------------------------
def _distribute_tensor(tensor, layout):
    import jax
    from jax.sharding import NamedSharding
    from keras.src.distribution import TensorLayout
    from keras.src.utils import jax_utils

    original = _state["originals"]["distribute_tensor"]
    backend = active_backend()
    if backend is None or backend.num_workers == 1 or jax_utils.is_in_jax_tracing_scope(tensor):
        return original(tensor, layout)
    if isinstance(tensor, jax.Array) and isinstance(tensor.sharding, NamedSharding):
        return original(tensor, layout)
    sharding = layout.backend_layout if isinstance(layout, TensorLayout) else layout
    if not (isinstance(sharding, NamedSharding) and sharding.is_fully_replicated):
        return original(tensor, layout)
    value = backend.broadcast_array(np.asarray(tensor))
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


# -- global-batches -----------------------------------------------------------------------
def _distribute_data(data, layouts=None):
    import jax
    from jax.sharding import NamedSharding
    from keras.src import tree

    leaves = [leaf for leaf in tree.flatten(data) if leaf is not None]
    if leaves and all(isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
                      for leaf in leaves):
        return data
    return _state["originals"]["_distribute_data"](data, layouts)


def _adapter_for(backend, x, y=None, sample_weight=None, batch_size=None, steps=None,
                 shuffle=False, class_weight=None):
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    from keras_mwms.backends import jax_data

    if isinstance(x, DataAdapter):
        return x
    if isinstance(x, jax_data.DistributedDataset):
        source = jax_data.LocalPartSource(x)
    else:
        seed = backend.agreed_seed() if shuffle else 0
        source = jax_data.make_source(x, y, sample_weight, batch_size, steps, shuffle, class_weight, seed)
    return jax_data.make_global_batch_adapter(source, _placer(backend))


class _IdentityPlacer:
    """One device: plain Keras places the numpy batches itself."""

    @staticmethod
    def place(batch):
        return batch

    place_local_part = place


def _placer(backend):
    from keras_mwms.backends.jax_data import GlobalArrayPlacer

    if backend.mesh is None:
        return _IdentityPlacer()
    return GlobalArrayPlacer(backend.mesh, backend.distribution.batch_dim_name,
                             backend.num_workers, backend.worker_index)


def _quiet_unless_chief(backend, verbose):
    return verbose if backend.is_chief else 0


def _reporting_lost_workers(backend, where, call):
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - jaxlib's runtime errors have no stable public type
        backend.raise_if_worker_lost(error, where)
        raise


def _fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
         validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
         sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
         validation_batch_size=None, validation_freq=1):
    original = _state["originals"]["fit"]
    backend = active_backend()
    if backend is None:
        return original(self, x, y, batch_size, epochs, verbose, callbacks, validation_split,
                        validation_data, shuffle, class_weight, sample_weight, initial_epoch,
                        steps_per_epoch, validation_steps, validation_batch_size, validation_freq)
    from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

    from keras_mwms import strategy

    facade = strategy.get_strategy()
    if facade is not None:
        facade.check_tf_config_unchanged()
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=validation_split)
    train = _adapter_for(backend, x, y, sample_weight, batch_size, steps_per_epoch, shuffle, class_weight)
    if validation_data is not None:
        val_x, val_y, val_sample_weight = data_adapter_utils.unpack_x_y_sample_weight(validation_data)
        validation_data = (_adapter_for(backend, val_x, val_y, val_sample_weight,
                                        validation_batch_size or batch_size, validation_steps),)
    return _reporting_lost_workers(backend, "model.fit", lambda: original(
        self, train, None, None, epochs, _quiet_unless_chief(backend, verbose), callbacks, 0.0,
        validation_data, False, None, None, initial_epoch, steps_per_epoch, validation_steps, None,
        validation_freq))


def _evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
              callbacks=None, return_dict=False, **kwargs):
    original = _state["originals"]["evaluate"]
    backend = active_backend()
    if backend is None:
        return original(self, x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict,
                        **kwargs)
    data = _adapter_for(backend, x, y, sample_weight, batch_size, steps)
    return _reporting_lost_workers(backend, "model.evaluate", lambda: original(
        self, data, None, None, _quiet_unless_chief(backend, verbose), None, steps, callbacks,
        return_dict, **kwargs))


def _predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    original = _state["originals"]["predict"]
    backend = active_backend()
    if backend is None:
        return original(self, x, batch_size, verbose, steps, callbacks)
    data = _adapter_for(backend, x, None, None, batch_size, steps)
    return _reporting_lost_workers(backend, "model.predict", lambda: original(
        self, data, None, _quiet_unless_chief(backend, verbose), steps, callbacks))


# -- predict-gathers-outputs --------------------------------------------------------------
def _make_predict_function(self, force=False):
    result = _state["originals"]["make_predict_function"](self, force)
    backend = active_backend()
    step = self.predict_function
    if backend is None or backend.mesh is None or getattr(step, "_keras_mwms_gathers", False):
        return result
    gather = _full_output_gatherer(backend.mesh)

    def gathering_step(state, iterator):
        import jax

        outputs, state = step(state, iterator)
        return jax.tree.map(gather, outputs), state

    gathering_step._keras_mwms_gathers = True
    self.predict_function = gathering_step
    return result


def _full_output_gatherer(mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    replicate = jax.jit(lambda value: value, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def gather(value):
        if not isinstance(value, jax.Array):
            return value
        if value.is_fully_addressable:
            return np.asarray(value)
        if not value.is_fully_replicated:
            value = replicate(value)
        return np.asarray(value.addressable_data(0))

    return gather
