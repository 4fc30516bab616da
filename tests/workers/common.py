"""Shared pieces of the worker scenario scripts: data, models, result dumps.

A scenario script runs in every worker (and, without TF_CONFIG, as the single-process
reference), trains with fixed data and seeds, and writes `<out>/w<index>.npz` (final weights)
and `<out>/w<index>.json` (history, evaluate, timings, anything the test asserts on).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

START = time.time()
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NUM_FEATURES = 12
NUM_CLASSES = 3
# `keras_internals()` before this process's strategy started, for a lifecycle check after it
# closes (set by the script or `jobs.py` that starts the strategy).
KERAS_BEFORE_THE_STRATEGY: dict | None = None


def worker_index() -> int:
    """This process's rank from TF_CONFIG (0 for the single-process reference)."""
    from keras_mwms.startup.cluster import TFConfigClusterResolver

    return TFConfigClusterResolver().worker_index or 0


def log(*parts) -> None:
    print(f"[t={time.time() - START:6.1f}s]", *parts, flush=True)


def regression_data(rows: int = 256, seed: int = 7):
    """Deterministic float32 regression data, identical on every worker."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, NUM_FEATURES)).astype("float32")
    w = rng.normal(size=(NUM_FEATURES, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.05 * rng.normal(size=(rows, 1))).astype("float32")
    return x, y


def fit_on_a_process_pool(strategy) -> None:
    """One epoch on a `keras.utils.PyDataset(workers=2, use_multiprocessing=True)`: its pool's
    forked children must let the worker exit once the script ends (before, on TensorFlow and JAX,
    they kept the runtime's SIGTERM handler, ignored the pool's terminate, and the worker waited
    for them forever: `keras_mwms.backends.forked_children`)."""
    import keras

    x, y = regression_data(rows=64)
    with strategy.scope():
        model = keras.Sequential([keras.Input((NUM_FEATURES,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(workers=2, use_multiprocessing=True)

        def __len__(self):
            return 4

        def __getitem__(self, index):
            return x[16 * index:16 * index + 16], y[16 * index:16 * index + 16]

    model.fit(Batches(), epochs=1, verbose=0)


def classification_data(rows: int = 256, seed: int = 11):
    """Deterministic classification data (int labels in 0..NUM_CLASSES-1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, NUM_FEATURES)).astype("float32")
    w = rng.normal(size=(NUM_FEATURES, NUM_CLASSES)).astype("float32")
    y = (x @ w).argmax(-1).astype("int32")
    return x, y


def mlp(outputs: int = 1, hidden: int = 16, batch_norm: bool = False, dropout: float = 0.0,
        synchronized: bool = True, custom_train_step: bool = False):
    """A small MLP; create it inside `strategy.scope()`. `custom_train_step`: a Sequential
    subclass whose `train_step` overrides Keras' (calling it), as user models do."""
    import keras

    layers = [keras.Input((NUM_FEATURES,)), keras.layers.Dense(hidden, activation="relu")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(synchronized=synchronized))
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers += [keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(outputs)]
    return (_custom_train_step_class() if custom_train_step else keras.Sequential)(layers)


def _custom_train_step_class():
    import keras

    class CustomTrainStep(keras.Sequential):
        def train_step(self, *args):
            return super().train_step(*args)

    return CustomTrainStep



def save_result(out_dir: str, index: int, model=None, **results) -> None:
    """Writes the model's weights to `w<index>.npz` and `results` to `w<index>.json`."""
    import numpy as np

    os.makedirs(out_dir, exist_ok=True)
    if model is not None:
        np.savez(os.path.join(out_dir, f"w{index}.npz"), *model.get_weights())
    results.setdefault("seconds", time.time() - START)
    with open(os.path.join(out_dir, f"w{index}.json"), "w") as handle:
        json.dump(results, handle, indent=1, default=float)


def load_weights(out_dir: str, index: int) -> list:
    import numpy as np

    with np.load(os.path.join(out_dir, f"w{index}.npz")) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def load_result(out_dir: str, index: int) -> dict:
    with open(os.path.join(out_dir, f"w{index}.json")) as handle:
        return json.load(handle)


def max_weight_difference(a: list, b: list) -> float:
    """max |a - b| over all weights; inf if the shapes differ."""
    import numpy as np

    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    return max((float(np.abs(x - y).max()) for x, y in zip(a, b) if x.size), default=0.0)


# -- the strategy's lifecycle: close() leaves the process as the strategy found it ----------

def _stored(owner, attribute):
    """An attribute as stored (looked up along the MRO for a class), None where it is missing."""
    if isinstance(owner, type):
        return next((vars(klass)[attribute] for klass in owner.__mro__ if attribute in vars(klass)), None)
    return getattr(owner, attribute, None)


def keras_internals() -> dict:
    """Every private Keras attribute this backend patches or calls (`keras_api.targets`), as
    stored now: taken before the strategy, compared after `close()`."""
    import keras

    from keras_mwms.backends.keras_api import targets

    found = {}
    for target in targets.ALL:
        if keras.backend.backend() in target.needed_by and target.exists():
            found[str(target)] = _stored(*target.resolve())
    return found


def patches_installed() -> list:
    """`(owner, attribute, original)` of every patch the open strategy installed (all its tables)."""
    from keras_mwms import active

    return [row for table in active.current_session().tables for row in table.originals()]


def lifecycle_problems(internals_before: dict, installed: list) -> list[str]:
    """After `close()`: what is not as before the strategy (empty when all is).

    Every state holder registered with `keras_mwms.active` back at its pristine state, no
    session open, every Keras attribute a table patched back to its original, every private
    Keras attribute as it was before the strategy.
    """
    from keras_mwms import active

    problems = [f"process state {name} was not reset" for name in active.changed_state()]
    if active.current_session() is not None:
        problems.append("a session is still open")
    for owner, attribute, original in installed:
        own = vars(owner).get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
        if own is not original:
            problems.append(f"{getattr(owner, '__name__', owner)}.{attribute} is still patched")
    now = keras_internals()
    problems += [f"{name} changed" for name, stored in internals_before.items() if now.get(name) is not stored]
    return problems
