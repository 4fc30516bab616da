"""keras_mwms: TensorFlow's MultiWorkerMirroredStrategy for Keras 3 on every backend.

Example:

```python
import keras, keras_mwms

strategy = keras_mwms.MultiWorkerMirroredStrategy()     # reads TF_CONFIG, meets its peers
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(x, y, batch_size=64)                          # 64 is the global batch
```

Run it on two local workers: `python -m keras_mwms.launch --workers 2 train.py`.
"""

from keras_mwms.communication import CommunicationImplementation, CommunicationOptions
from keras_mwms.data import AutoShardPolicy, InputContext
from keras_mwms.errors import KerasMwmsError, WorkerLostError, WorkersDifferError
from keras_mwms.resolvers import (
    ClusterEnvironmentError,
    MPIClusterResolver,
    SlurmClusterResolver,
    TorchrunClusterResolver,
)
from keras_mwms.startup.cluster import (
    ClusterSpec,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    TFConfigError,
)
from keras_mwms.startup.rendezvous import RendezvousError
from keras_mwms.strategy import MultiWorkerMirroredStrategy
from keras_mwms.version import __version__


def __getattr__(name):
    # `keras_mwms.callbacks` imports Keras (which fixes the backend), so load it on first use.
    if name == "callbacks":
        import importlib

        return importlib.import_module("keras_mwms.callbacks")
    raise AttributeError(f"module 'keras_mwms' has no attribute {name!r}")


__all__ = [
    "AutoShardPolicy",
    "ClusterEnvironmentError",
    "ClusterSpec",
    "CommunicationImplementation",
    "CommunicationOptions",
    "InputContext",
    "KerasMwmsError",
    "MPIClusterResolver",
    "MultiWorkerMirroredStrategy",
    "RendezvousError",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TFConfigError",
    "TorchrunClusterResolver",
    "WorkerLostError",
    "WorkersDifferError",
    "__version__",
    "callbacks",
]
