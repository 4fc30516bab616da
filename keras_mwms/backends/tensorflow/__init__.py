"""The TensorFlow backend: `tf.distribute.MultiWorkerMirroredStrategy` under Keras 3, repaired.

On TensorFlow the collective engine is TF's own; keras_mwms starts it safely, names lost
peers, and repairs what Keras 3.15.1's TensorFlow trainer gets wrong under it. One job per
module:

- `engine` — `TensorFlowBackend`: join after the rendezvous, the collective port
  (`all_reduce`, `broadcast_object`, `barrier`);
- `faults` — the lost-worker hook: the peers TF's own errors name (the flow is
  `keras_mwms.backends.faults`);
- `patches` — the one table of Keras/TF internals patched (the two Keras crash repairs, the
  trainer wrappers, the row weighting), installed by the strategy and removed at `close()`;
- `fit_hooks` — the `fit` / `evaluate` / `predict` wrappers that keep N workers equivalent to one
  process;
- `step` — row-weighted loss scaling and the all-reduce before the optimizer update;
- `data` — `AutoShardPolicy.OFF` datasets at their full length, and a build batch that consumes
  no data.

Example (in a worker started by `python -m keras_mwms.launch --workers 2 train.py`):

```python
import keras, keras_mwms

strategy = keras_mwms.MultiWorkerMirroredStrategy()        # KERAS_BACKEND=tensorflow
with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=64, epochs=2)                   # 64 = the global batch
```

>>> TensorFlowBackend.name
'tensorflow'
"""

from __future__ import annotations

from keras_mwms.backends.tensorflow.engine import TensorFlowBackend, resolve_engine, tf_cluster_resolver

__all__ = ["TensorFlowBackend", "resolve_engine", "tf_cluster_resolver"]
