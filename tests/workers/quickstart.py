"""The README's Quick start with data defined: the healthy run whose printed lines are counted.

    python quickstart.py            # under the launcher: keras_mwms, 2 workers
    python quickstart.py --plain    # one process of plain Keras, keras_mwms not imported
"""

import sys

import numpy as np

PLAIN = "--plain" in sys.argv

import keras  # noqa: E402

if not PLAIN:
    import keras_mwms

    strategy = keras_mwms.MultiWorkerMirroredStrategy()        # reads TF_CONFIG, meets its peers

rng = np.random.default_rng(0)
x = rng.standard_normal((256, 64)).astype("float32")
y = rng.integers(0, 10, 256)
keras.utils.set_random_seed(1)
with (strategy.scope() if not PLAIN else keras.name_scope("plain")):
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=64, epochs=3)                     # 64 is the *global* batch
