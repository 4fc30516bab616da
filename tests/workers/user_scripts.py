"""Scripts written the way Keras users write them, each a *variant*, dumped for the tests.

Runs in every worker of a gang, and with `--plain` as the reference: one process of plain
Keras, without keras_mwms imported at all. Every variant builds its own model from the same
seed, trains on the same global batches and writes `OUT/<variant>/w<index>.npz` (final weights)
and `OUT/<variant>/w<index>.json` (history, evaluate, predictions, captured output, warnings,
and the error if it raised). One variant's exception is recorded and the next one runs, so one
gang serves every assertion.

    python user_scripts.py OUT [--plain] [--only VARIANT,VARIANT] [--log-level LEVEL]

`--log-level ERROR` silences keras_mwms as a user does, before importing it:
`logging.getLogger("keras_mwms").setLevel(logging.ERROR)`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--plain", action="store_true", help="plain Keras, one process (the reference)")
parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
parser.add_argument("--log-level", help="the level of the keras_mwms logger (default: keras_mwms' INFO)")
parser.add_argument("--lifecycle", action="store_true",
                    help="only check_lifecycle(), which closes the strategy (the default without --only: after "
                         "the variants)")

# Set by `run_job`: the strategy (None: plain Keras), the command line, this worker.
strategy = None
arguments = None
INDEX, IS_CHIEF = 0, True

import keras  # noqa: E402
import numpy as np  # noqa: E402

BACKEND = keras.backend.backend()
ROWS, BATCH, EPOCHS = 100, 16, 2     # 6 full global batches and a last one of 4 rows
SEED = 1234


def scope():
    return contextlib.nullcontext() if strategy is None else strategy.scope()


def regression(rows: int = ROWS):
    return common.regression_data(rows)


def classification(rows: int = ROWS):
    return common.classification_data(rows)


def mlp(outputs: int = 1):
    return common.mlp(outputs=outputs)


def fit_arrays(model, x, y, **kwargs):
    kwargs.setdefault("batch_size", BATCH)
    kwargs.setdefault("epochs", EPOCHS)
    kwargs.setdefault("shuffle", False)
    kwargs.setdefault("verbose", 0)
    return model.fit(x, y, **kwargs).history


# -- the variants ---------------------------------------------------------------------------
# Each returns (model or list of weights, dict of results to dump).

def variant_sgd_arrays():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model, {"history": fit_arrays(model, x, y)}


def variant_save_on_chief():
    """TensorFlow's tutorial idiom: only the chief saves, then plain Keras reloads the file."""
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer="adam", loss="mse")
    history = fit_arrays(model, x, y)
    results = {"history": history}
    if IS_CHIEF:
        folder = os.path.join(arguments.out, "save_on_chief")
        os.makedirs(folder, exist_ok=True)
        model.save(os.path.join(folder, "model.keras"))
        model.save_weights(os.path.join(folder, "model.weights.h5"))
        reloaded = keras.models.load_model(os.path.join(folder, "model.keras"))
        results["reloaded_max_difference"] = max(
            float(np.abs(a - b).max()) for a, b in zip(reloaded.get_weights(), model.get_weights()))
        results["chief_predict"] = model.predict(x[:5], verbose=0).tolist()
        fresh = mlp()
        fresh.load_weights(os.path.join(folder, "model.weights.h5"))
        results["weights_file_max_difference"] = max(
            float(np.abs(a - b).max()) for a, b in zip(fresh.get_weights(), model.get_weights()))
    return model, results


def variant_generator():
    x, y = regression()

    def batches():
        while True:
            for start in range(0, ROWS, BATCH):
                yield x[start:start + BATCH], y[start:start + BATCH]

    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    steps = -(-ROWS // BATCH)
    history = model.fit(batches(), steps_per_epoch=steps, epochs=EPOCHS, verbose=0).history
    return model, {"history": history}


def variant_generator_then_tfdata():
    """An endless generator of views of the user's arrays, then a tf.data and a PyDataset fit of
    the same arrays in the same process (before the fix, on TensorFlow with several workers, the
    generator fit overwrote targets in the arrays: its epoch 2 and both later fits trained on them)."""
    import tensorflow as tf

    rows, batch = 256, 32
    x, y = regression(rows)
    untouched = (x.copy(), y.copy())

    def batches():
        while True:
            for start in range(0, rows, batch):
                yield x[start:start + batch], y[start:start + batch]

    def fresh_model():
        keras.utils.set_random_seed(SEED)
        with scope():
            model = mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model

    history = {}
    model = fresh_model()
    steps = rows // batch
    for key, values in model.fit(batches(), steps_per_epoch=steps, epochs=EPOCHS, verbose=0).history.items():
        history[f"generator_{key}"] = values
    model = fresh_model()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    for key, values in model.fit(dataset, epochs=EPOCHS, verbose=0).history.items():
        history[f"tfdata_{key}"] = values
    model = fresh_model()
    pydataset = _batches_pydataset(x, y, batch=batch)
    for key, values in model.fit(pydataset, epochs=EPOCHS, shuffle=False, verbose=0).history.items():
        history[f"pydataset_{key}"] = values
    changed = int((x != untouched[0]).sum() + (y != untouched[1]).sum())
    return model, {"history": history, "array_values_changed": changed}


def variant_on_batch_loops():
    """train_on_batch with sample and class weights, test_on_batch, predict_on_batch, on batches
    of 13 rows (uneven on 2 and 3 workers); every worker passes the whole batch."""
    x, y = classification()
    weights = np.linspace(0.2, 2.0, ROWS).astype("float32")
    with scope():
        model = mlp(common.NUM_CLASSES)
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                      weighted_metrics=[keras.metrics.SparseCategoricalCrossentropy(from_logits=True)],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    logs: dict = {}
    rows = 13
    for step in range(6):
        part = slice(step * rows, (step + 1) * rows)
        if step % 2:
            trained = model.train_on_batch(x[part], y[part], class_weight={0: 0.5, 1: 1.0, 2: 2.0},
                                           return_dict=True)
        else:
            trained = model.train_on_batch(x[part], y[part], sample_weight=weights[part], return_dict=True)
        tested = model.test_on_batch(x[part], y[part], sample_weight=weights[part], return_dict=True)
        for prefix, values in (("train", trained), ("test", tested)):
            for key, value in values.items():
                logs.setdefault(f"{prefix}_{key}", []).append(float(value))
    logs["predict_on_batch"] = np.asarray(model.predict_on_batch(x[:rows])).ravel().tolist()
    return model, {"history": logs}


def variant_timeseries_lstm():
    """keras.utils.timeseries_dataset_from_array (time axis unknown in its element spec) into
    a functional LSTM whose Input fixes it."""
    rng = np.random.default_rng(5)
    series = rng.normal(size=(120, 3)).astype("float32")
    window = 12
    dataset = keras.utils.timeseries_dataset_from_array(
        series[:-window], series[window:, :1], sequence_length=window, batch_size=BATCH)
    with scope():
        inputs = keras.Input((window, 3))
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(8)(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model, {"history": model.fit(dataset, epochs=EPOCHS, verbose=0).history}


def _clipped(**clip):
    x, y = regression()
    x = x * 4.0    # large gradients, so the clipping is active
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05, **clip), loss="mse")
    return model, {"history": fit_arrays(model, x, y)}


def variant_clipnorm():
    return _clipped(clipnorm=0.05)


def variant_global_clipnorm():
    return _clipped(global_clipnorm=0.05)


def variant_clipvalue():
    return _clipped(clipvalue=0.002)


def variant_accumulation_sgd():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
                      loss="mse", metrics=["mae"])
    return model, {"history": fit_arrays(model, x, y)}


def variant_accumulation_adam():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
                      loss="mse")
    return model, {"history": fit_arrays(model, x, y)}


def _custom_model_class():
    """The train_step of Keras' "Customizing what happens in fit()" guide of this backend."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        class CustomModel(keras.Model):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                gradients = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(gradients, self.trainable_variables)
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                    else:
                        metric.update_state(y, y_pred)
                return {m.name: m.result() for m in self.metrics}

    elif BACKEND == "jax":
        import jax

        class CustomModel(keras.Model):
            def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                         training=False):
                y_pred, non_trainable_variables = self.stateless_call(
                    trainable_variables, non_trainable_variables, x, training=training)
                loss = self.compute_loss(x, y, y_pred)
                return loss, (y_pred, non_trainable_variables)

            def train_step(self, state, data):
                trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
                x, y = data
                grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
                (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
                    trainable_variables, non_trainable_variables, x, y, training=True)
                trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                    optimizer_variables, grads, trainable_variables)
                new_metrics_vars, logs = [], {}
                for metric in self.metrics:
                    these = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
                    if metric.name == "loss":
                        these = metric.stateless_update_state(these, loss)
                    else:
                        these = metric.stateless_update_state(these, y, y_pred)
                    logs[metric.name] = metric.stateless_result(these)
                    new_metrics_vars += these
                return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                              new_metrics_vars)

    else:
        import torch

        class CustomModel(keras.Model):
            def train_step(self, data):
                x, y = data
                self.zero_grad()
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
                loss.backward()
                trainable_weights = list(self.trainable_weights)
                gradients = [v.value.grad for v in trainable_weights]
                with torch.no_grad():
                    self.optimizer.apply(gradients, trainable_weights)
                for metric in self.metrics:
                    if metric.name == "loss":
                        metric.update_state(loss)
                    else:
                        metric.update_state(y, y_pred)
                return {m.name: m.result() for m in self.metrics}

    return CustomModel


def variant_custom_train_step():
    x, y = regression()
    with scope():
        inputs = keras.Input((common.NUM_FEATURES,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = _custom_model_class()(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = fit_arrays(model, x, y)
    return model, {"history": history}


def _two_optimizer_model_class():
    """The shape of keras.io's GAN step (`compile(d_optimizer=..., g_optimizer=...)`): two
    optimizers, each updating its own tower from its own loss, one after the other in one
    `train_step`; deterministic (no latent noise), so one process's weights are comparable."""

    class TwoOptimizers(keras.Model):
        def __init__(self):
            super().__init__()
            self.first = keras.layers.Dense(8, activation="relu")
            self.second = keras.layers.Dense(1)
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def call(self, x):
            return self.second(self.first(x))

        def compile(self, first_optimizer, second_optimizer):
            super().compile()
            self.first_optimizer, self.second_optimizer = first_optimizer, second_optimizer

        @property
        def metrics(self):
            return [self.loss_tracker]

        def _loss(self, x, y):
            return keras.ops.mean(keras.ops.square(self(x, training=True) - y))

        def train_step(self, data):
            x, y = data
            for optimizer, tower in ((self.second_optimizer, self.second), (self.first_optimizer, self.first)):
                weights = list(tower.trainable_weights)
                if BACKEND == "tensorflow":
                    import tensorflow as tf

                    with tf.GradientTape() as tape:
                        loss = self._loss(x, y)
                    optimizer.apply(tape.gradient(loss, weights), weights)
                else:
                    import torch

                    self.zero_grad()
                    loss = self._loss(x, y)
                    loss.backward()
                    with torch.no_grad():
                        optimizer.apply([weight.value.grad for weight in weights], weights)
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    return TwoOptimizers


def variant_two_optimizers():
    """A custom `train_step` with a second optimizer (TensorFlow and torch; a JAX step is
    stateless: its optimizers' states are the step's to carry). Before: on torch only the
    model's `optimizer` all-reduced, so the workers drifted apart."""
    x, y = regression()
    if BACKEND == "jax":
        return [], {"skipped": "jax"}
    with scope():
        model = _two_optimizer_model_class()()
        model(x[:1])   # builds both towers
        model.compile(keras.optimizers.SGD(0.05), keras.optimizers.Adam(0.01))
        # Built before fit: TensorFlow cannot create their variables inside the traced step.
        model.first_optimizer.build(model.first.trainable_weights)
        model.second_optimizer.build(model.second.trainable_weights)
    history = fit_arrays(model, x, y)
    return model, {"history": history}


def variant_fit_without_targets():
    """keras.io's VAE shape: `fit(x)` with no `y`, a custom `train_step` that takes `data` as the
    batch itself (a deterministic autoencoder: no sampling). Before: torch handed the step a
    one-element list `[x]` when `shuffle=False`, with one worker too ("Arguments target and
    output must have the same shape")."""
    x, _ = regression()
    if BACKEND == "jax":
        return [], {"skipped": "jax"}

    class AutoEncoder(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder = keras.layers.Dense(4, activation="tanh")
            self.decoder = keras.layers.Dense(common.NUM_FEATURES)
            self.loss_tracker = keras.metrics.Mean(name="reconstruction_loss")

        def call(self, inputs):
            return self.decoder(self.encoder(inputs))

        @property
        def metrics(self):
            return [self.loss_tracker]

        def _loss(self, data):
            return keras.ops.mean(keras.ops.square(self(data, training=True) - data))

        def train_step(self, data):
            if not hasattr(data, "shape"):
                raise TypeError(f"train_step got {type(data).__name__}, not the batch itself")
            weights = list(self.trainable_weights)
            if BACKEND == "tensorflow":
                import tensorflow as tf

                with tf.GradientTape() as tape:
                    loss = self._loss(data)
                self.optimizer.apply(tape.gradient(loss, weights), weights)
            else:
                import torch

                self.zero_grad()
                loss = self._loss(data)
                loss.backward()
                with torch.no_grad():
                    self.optimizer.apply([weight.value.grad for weight in weights], weights)
            self.loss_tracker.update_state(loss)
            return {"reconstruction_loss": self.loss_tracker.result()}

    with scope():
        model = AutoEncoder()
        model(x[:1])
        model.compile(optimizer=keras.optimizers.Adam(0.01))
    history = model.fit(x, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    return model, {"history": history}


def _batches_pydataset(x, y, shuffle_kwargs=None, batch=BATCH):
    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__(**(shuffle_kwargs or {}))

        def __len__(self):
            return -(-len(x) // batch)

        def __getitem__(self, index):
            rows = slice(index * batch, (index + 1) * batch)
            return x[rows], y[rows]

    return Batches()


def variant_pydataset_shuffle():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(_batches_pydataset(x, y), epochs=EPOCHS, shuffle=True, verbose=0).history
    return model, {"history": history}


def variant_tfdata_worker_seeds():
    """tf.data shuffled with a different seed on each worker: must not pass silently."""
    import tensorflow as tf

    x, y = regression()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(ROWS, seed=10 + INDEX).batch(BATCH)
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(dataset, epochs=1, verbose=0).history
    return model, {"history": history}


def variant_backup_and_restore():
    """Keras' own BackupAndRestore, every worker given the same directory."""
    x, y = regression()
    folder = os.path.join(arguments.out, "backup_and_restore", "backup")
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = fit_arrays(model, x, y, epochs=3, callbacks=[keras.callbacks.BackupAndRestore(folder)])
    return model, {"history": history}


class EpochCountingCheckpoint(keras.callbacks.ModelCheckpoint):
    """A user's subclass of Keras' ModelCheckpoint, with a hook of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epochs_seen = []

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self.epochs_seen.append(epoch)


def variant_keras_callbacks():
    """Keras' own ModelCheckpoint (best-only `.keras`; per-epoch `.weights.h5` by a user's
    subclass), CSVLogger and TensorBoard, every worker given the same paths. The chief dumps
    what the checkpoints hold; the test compares the files with plain Keras'."""
    return _file_writing_callbacks("keras_callbacks", chief_only=False)


def variant_chief_only_callbacks():
    """`variant_keras_callbacks`' callbacks given to the chief alone, as Horovod scripts do
    (`callbacks = [...] if is_chief else []`): the other workers' lists are empty."""
    return _file_writing_callbacks("chief_only_callbacks", chief_only=True)


def _file_writing_callbacks(name: str, chief_only: bool):
    x, y = regression()
    folder = os.path.join(arguments.out, name, "files")
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    best = keras.callbacks.ModelCheckpoint(os.path.join(folder, "best.keras"), save_best_only=True)
    every = EpochCountingCheckpoint(os.path.join(folder, "epoch-{epoch:02d}.weights.h5"),
                                    save_weights_only=True)
    csv_logger = keras.callbacks.CSVLogger(os.path.join(folder, "log.csv"))
    board = keras.callbacks.TensorBoard(os.path.join(folder, "logs"))
    user_objects = [best, every, csv_logger, board]
    given = user_objects if IS_CHIEF or not chief_only else []
    history = fit_arrays(model, x, y, epochs=3, validation_split=0.25, callbacks=given)
    results = {"history": history}
    if given:
        results.update({"best": float(best.best), "epochs_seen": every.epochs_seen,
                        "classes": [f"{type(c).__module__}.{type(c).__qualname__}" for c in user_objects],
                        "log_dir": os.path.relpath(board.log_dir, folder)})
    if IS_CHIEF:
        checkpoints = {"best.keras": keras.models.load_model(os.path.join(folder, "best.keras"))}
        for epoch in range(1, 4):
            checkpoints[f"epoch-{epoch:02d}.weights.h5"] = mlp()
            checkpoints[f"epoch-{epoch:02d}.weights.h5"].load_weights(
                os.path.join(folder, f"epoch-{epoch:02d}.weights.h5"))
        results["checkpoints"] = {name: [weight.tolist() for weight in saved.get_weights()]
                                  for name, saved in checkpoints.items()}
    return model, results


def variant_weights_after_build():
    """Seeded differently per worker; the weights right after building must already agree."""
    keras.utils.set_random_seed(SEED + INDEX)
    with scope():
        model = mlp()
        model.compile(optimizer="sgd", loss="mse")
    return model, {}


def variant_verbose2():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = fit_arrays(model, x, y, verbose=2)
    return model, {"history": history, "printed": printed.getvalue()}


def variant_functional_dict():
    x, y = regression()
    with scope():
        first = keras.Input((8,), name="first")
        second = keras.Input((common.NUM_FEATURES - 8,), name="second")
        joined = keras.layers.Concatenate()([keras.layers.Dense(8, activation="relu")(first), second])
        model = keras.Model({"first": first, "second": second}, keras.layers.Dense(1)(joined))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    inputs = {"first": x[:, :8], "second": x[:, 8:]}
    return model, {"history": fit_arrays(model, inputs, y)}


def variant_two_outputs():
    """Two outputs, each with its own loss and weight: the per-output losses in the logs
    (`out1_loss`, `out2_loss`) must be one process's, uneven splits included (before: 0.3 % off
    on TensorFlow with 3 workers, the total loss exact)."""
    x, y = regression()
    with scope():
        inputs = keras.Input((x.shape[1],))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = keras.Model(inputs, {"out1": keras.layers.Dense(1, name="out1")(hidden),
                                     "out2": keras.layers.Dense(1, name="out2")(hidden)})
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss={"out1": "mse", "out2": "mae"},
                      loss_weights={"out1": 1.0, "out2": 0.5})
    history = fit_arrays(model, x, {"out1": y, "out2": 2 * y})
    evaluated = model.evaluate(x, {"out1": y, "out2": 2 * y}, batch_size=BATCH, verbose=0, return_dict=True)
    return model, {"history": history, "evaluate": evaluated}


def variant_sample_weight():
    x, y = regression()
    weights = np.linspace(0.2, 2.0, ROWS).astype("float32")
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", weighted_metrics=["mae"])
    return model, {"history": fit_arrays(model, x, y, sample_weight=weights)}


def variant_class_weight():
    x, y = classification()
    with scope():
        model = mlp(common.NUM_CLASSES)
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # With validation_split: Keras splits first, so the validation rows carry no class weights.
    return model, {"history": fit_arrays(model, x, y, class_weight={0: 0.5, 1: 1.0, 2: 2.0},
                                         validation_split=0.25)}


def variant_validation_split():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model, {"history": fit_arrays(model, x, y, validation_split=0.25)}


def variant_early_stopping_reduce_lr():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.3), loss="mse")
    callbacks = [keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=0.01),
                 keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, factor=0.5, min_delta=0.05)]
    history = fit_arrays(model, x, y, epochs=8, callbacks=callbacks)
    return model, {"history": history, "epochs_run": len(history["loss"])}


def variant_embedding_lstm():
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 50, size=(ROWS, 6)).astype("int32")
    labels = (tokens.sum(-1) % 2).astype("int32")
    with scope():
        model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(50, 8),
                                  keras.layers.LSTM(8), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, {"history": fit_arrays(model, tokens, labels)}


def variant_position_embedding_adam():
    """keras.io's Transformer text classifier's `TokenAndPositionEmbedding` (a position `Embedding`
    looked up with `ops.arange` inside `call()`), with Adam. Before: on TensorFlow every worker's
    gradient of the position table held every position, the all-gather repeated them, and
    Keras' sparse Adam squared each copy apart (0.01-0.14 from one process, silently)."""
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 50, size=(ROWS, 6)).astype("int32")
    labels = (tokens.sum(-1) % 2).astype("int32")

    class TokenAndPositionEmbedding(keras.layers.Layer):
        def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
            super().__init__(**kwargs)
            self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
            self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

        def call(self, x):
            positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
            return self.token_emb(x) + self.pos_emb(positions)

    with scope():
        inputs = keras.Input((6,), dtype="int32")
        embedded = TokenAndPositionEmbedding(6, 50, 8)(inputs)
        pooled = keras.layers.GlobalAveragePooling1D()(embedded)
        model = keras.Model(inputs, keras.layers.Dense(2)(pooled))
        model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, {"history": fit_arrays(model, tokens, labels)}


def variant_summed_loss():
    """A loss reduced by sum (`reduction="sum"`, `reduction=None`, a `Loss` subclass summing),
    which keras_mwms cannot yet split over workers: on several workers `fit` and `evaluate`
    refuse it on every worker, naming the loss and the fix (before: 2 on TensorFlow, 8 on torch
    and JAX where one process's SGD step gives 16, silently). The fix it names, the default
    reduction with the SGD learning rate times the global batch size, then trains as one
    process's summed loss does (96 rows: full batches only, where the two are the same steps)."""
    x, y = regression(96)
    several = strategy is not None and strategy.num_workers > 1

    class SumOfSquares(keras.losses.Loss):
        def __init__(self, name="sum_of_squares", reduction="sum"):
            super().__init__(name=name, reduction=reduction)

        def call(self, y_true, y_pred):
            return keras.ops.square(y_true - y_pred)[:, 0]

    refused = {}
    forms = {"sum": keras.losses.MeanSquaredError(reduction="sum"),
             "none": keras.losses.MeanSquaredError(reduction=None), "subclass": SumOfSquares()}
    for form, loss in forms.items():
        with scope():
            model = mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.05 / BATCH), loss=loss)
        try:
            fit_arrays(model, x, y, epochs=1)
            if form == "sum":
                model.evaluate(x, y, batch_size=BATCH, verbose=0)
            refused[form] = None
        except Exception as error:   # reduction=None: plain Keras' torch and JAX need a scalar loss
            refused[form] = f"{type(error).__name__}: {error}"
    with scope():
        model = mlp()
        if several:   # the fix the error names
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        else:
            model.compile(optimizer=keras.optimizers.SGD(0.05 / BATCH),
                          loss=keras.losses.MeanSquaredError(reduction="sum"))
    fit_arrays(model, x, y)
    return model, {"refused": refused}


def variant_layer_state():
    """A custom layer keeping non-trainable state updated in `call()` (keras.io's "examples seen"
    counter, a running mean): with `aggregation="sum"` the count must be one process's total
    of rows, with `aggregation="mean"` the running mean one process's (before: TensorFlow's
    count grew exponentially, torch and JAX kept each worker's own)."""
    x, y = regression()

    class Tracking(keras.layers.Layer):
        def build(self, input_shape):
            self.seen = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                        aggregation="sum", name="seen")
            self.running = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False,
                                           aggregation="mean", name="running")

        def call(self, inputs, training=False):
            if training:
                rows = keras.ops.cast(keras.ops.shape(inputs)[0], "float32")
                self.seen.assign(self.seen + rows)
                self.running.assign(0.9 * self.running + 0.1 * keras.ops.mean(inputs, axis=0))
            return inputs

    with scope():
        inputs = keras.Input((x.shape[1],))
        tracking = Tracking()
        outputs = keras.layers.Dense(1)(tracking(inputs))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = fit_arrays(model, x, y)
    return model, {"history": history, "seen": float(keras.ops.convert_to_numpy(tracking.seen)),
                   "running": keras.ops.convert_to_numpy(tracking.running).tolist()}


def variant_custom_max_metric():
    """Registered custom `Metric`s whose state is a running maximum (its variable named as a
    user names it, `running_max`) or a running minimum declared in `keras_mwms_reductions`,
    compiled with the model: their logs must be one process's on every worker (before:
    TensorFlow and JAX logged the sum of the workers' maxima, torch each worker's own; a
    declaration was not seen through Keras' compiled metrics)."""
    x, y = regression()

    @keras.saving.register_keras_serializable(package="user_scripts")
    class LargestError(keras.metrics.Metric):
        def __init__(self, name="largest_error", **kwargs):
            super().__init__(name=name, **kwargs)
            self.running_max = self.add_variable(shape=(), initializer="zeros", name="running_max")

        def update_state(self, y_true, y_pred, sample_weight=None):
            error = keras.ops.max(keras.ops.abs(keras.ops.cast(y_true, "float32") - y_pred))
            self.running_max.assign(keras.ops.maximum(self.running_max, error))

        def result(self):
            # A new tensor: Keras' torch fit reads a returned variable lazily, after validation.
            return self.running_max * 1.0

    @keras.saving.register_keras_serializable(package="user_scripts")
    class SmallestPrediction(keras.metrics.Metric):
        """A running minimum whose variable's name says nothing: declared for keras_mwms."""
        keras_mwms_reductions = {"floor": "min"}

        def __init__(self, name="smallest_prediction", **kwargs):
            super().__init__(name=name, **kwargs)
            self.floor = self.add_variable(shape=(), initializer=keras.initializers.Constant(1e9), name="floor")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.floor.assign(keras.ops.minimum(self.floor, keras.ops.min(y_pred)))

        def result(self):
            return self.floor * 1.0

    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
                      metrics=[LargestError(), SmallestPrediction()])
    history = fit_arrays(model, x, y, validation_split=0.25)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return model, {"history": history, "evaluate": evaluated}


def variant_weight_decay():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=0.05), loss="mse")
    return model, {"history": fit_arrays(model, x, y)}


def variant_ema():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.9), loss="mse")
    return model, {"history": fit_arrays(model, x, y)}


def variant_loss_scale():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
                      loss="mse")
    return model, {"history": fit_arrays(model, x, y)}


class LossScaleHistory(keras.callbacks.Callback):
    """The dynamic loss scale and the applied-step count after every batch."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self.steps.append([float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)),
                               int(keras.ops.convert_to_numpy(optimizer.iterations))])


def _mixed_precision(policy, make_optimizer=None, input_scale=1.0):
    """Trains the MLP under a global dtype policy (restored after); Keras wraps the optimizer
    in a LossScaleOptimizer for mixed_float16 by itself."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        x, y = regression()
        with scope():
            model = mlp()
            # In the scope: TensorFlow applies a LossScaleOptimizer only of its own strategy.
            optimizer = make_optimizer() if make_optimizer else keras.optimizers.SGD(0.05)
            model.compile(optimizer=optimizer, loss="mse")
        history = LossScaleHistory()
        results = {"history": fit_arrays(model, x * input_scale, y, callbacks=[history])}
        if policy == "mixed_float16":
            results["loss_scale"] = history.steps
        return model, results
    finally:
        keras.mixed_precision.set_global_policy("float32")


def variant_mixed_float16():
    return _mixed_precision("mixed_float16")


def variant_mixed_float16_overflow():
    # Starts far too high: the first steps overflow and are skipped while the scale halves.
    # Small inputs keep the overflow in per-row values rather than in sums over the batch.
    def make_optimizer():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 20,
                                                   dynamic_growth_steps=4)

    return _mixed_precision("mixed_float16", make_optimizer, input_scale=0.01)


def variant_mixed_bfloat16():
    return _mixed_precision("mixed_bfloat16")


def variant_evaluate_predict_uneven():
    x, y = regression()
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = fit_arrays(model, x, y)
    evaluated = model.evaluate(x[:37], y[:37], batch_size=8, verbose=0, return_dict=True)
    predicted = model.predict(x[:37], batch_size=8, verbose=0)
    return model, {"history": history, "evaluate": evaluated, "predict": predicted.tolist()}


def variant_batch_smaller_than_workers():
    x, y = regression(8)
    with scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model, {"history": fit_arrays(model, x, y, batch_size=1, epochs=1)}


def _moving_statistics(model) -> dict:
    layers = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
    return {"moving_mean": [keras.ops.convert_to_numpy(layer.moving_mean).tolist() for layer in layers],
            "moving_variance": [keras.ops.convert_to_numpy(layer.moving_variance).tolist() for layer in layers]}


def variant_batchnorm_smallest():
    """Issue 31's smallest script: Dense(4) -> BatchNormalization() -> Dense(1), 64 rows, one
    epoch in global batches of 16; every worker's moving statistics and predictions."""
    x, y = regression(64)
    with scope():
        model = keras.Sequential([keras.Input((common.NUM_FEATURES,)), keras.layers.Dense(4),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = fit_arrays(model, x, y, epochs=1)
    return model, {"history": history, **_moving_statistics(model),
                   "predict": model.predict(x[:8], verbose=0).tolist()}


def variant_batchnorm_default():
    """An ordinary BatchNormalization (synchronized left False), classification with accuracy."""
    x, y = classification()
    with scope():
        model = common.mlp(common.NUM_CLASSES, batch_norm=True, synchronized=False)
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = fit_arrays(model, x, y)
    return model, {"history": history, **_moving_statistics(model)}


def variant_batchnorm_per_worker():
    """`batchnorm_default` with CommunicationOptions(batch_norm_statistics="per_worker"): each
    worker normalizes over its shard (not one process's result), one set of moving statistics."""
    if strategy is None:
        return variant_batchnorm_default()
    import dataclasses

    default = strategy.backend.options
    strategy.backend.options = dataclasses.replace(default, batch_norm_statistics="per_worker")
    try:
        return variant_batchnorm_default()
    finally:
        strategy.backend.options = default


def variant_batchnorm_transfer_learning():
    """keras.io's transfer-learning recipe on a base with BatchNormalization: pretrain the base,
    freeze it, call it with training=False under a new head (with its own BatchNormalization),
    fit; unfreeze, recompile inside the scope with a low learning rate, fit again."""
    x, y = classification()
    with scope():
        base = keras.Sequential([keras.Input((common.NUM_FEATURES,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.BatchNormalization(), keras.layers.Dense(8, activation="relu")],
                                name="base")
        pretraining = keras.Sequential([base, keras.layers.Dense(1)])
        pretraining.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = {"pretrain_loss": fit_arrays(pretraining, x, x[:, :1], epochs=1)["loss"]}
    base.trainable = False
    with scope():
        inputs = keras.Input((common.NUM_FEATURES,))
        features = keras.layers.BatchNormalization()(base(inputs, training=False))
        model = keras.Model(inputs, keras.layers.Dense(common.NUM_CLASSES)(features))
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history["frozen"] = fit_arrays(model, x, y, epochs=1)
    base.trainable = True
    with scope():
        model.compile(optimizer=keras.optimizers.SGD(1e-3), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history["fine_tuned"] = fit_arrays(model, x, y, epochs=1)
    flat = {f"{phase}_{key}": values for phase, logs in history.items() if isinstance(logs, dict)
            for key, values in logs.items()}
    flat["pretrain_loss"] = history["pretrain_loss"]
    return model, {"history": flat, **_moving_statistics(model)}


class _NudgeOnWorker1(keras.callbacks.Callback):
    """Worker 1 alone adds 1e-3 to the BatchNormalization moving mean at `hook` (`"epoch_end"`:
    the first epoch's); every worker reads and assigns (worker 0 its own value), so a collective
    a read may be stays paired."""

    def __init__(self, hook: str):
        super().__init__()
        self.hook, self.saved = hook, None

    def _variable(self):
        return next(layer for layer in self.model.layers
                    if isinstance(layer, keras.layers.BatchNormalization)).moving_mean

    def _nudge(self):
        self.saved = np.array(keras.ops.convert_to_numpy(self._variable().value))
        self._variable().assign(self.saved + (1e-3 if INDEX == 1 else 0.0))

    def restore(self):
        """Back to the chief's value (the nudge may have been trained on since)."""
        if self.saved is not None:
            own = np.array(keras.ops.convert_to_numpy(self._variable().value))
            chief = own if strategy is None else _coordination().broadcast_from_chief(own)
            self._variable().assign(chief)

    def on_train_end(self, logs=None):
        if self.hook == "train_end":
            self._nudge()

    def on_epoch_end(self, epoch, logs=None):
        if self.hook == "epoch_end" and epoch == 0:
            self._nudge()


def _coordination():
    from keras_mwms.callbacks import coordination

    return coordination


def variant_one_worker_nudges_state():
    """The safety net: worker 1 alone changes a moving mean at the end of a fit, then at the end
    of a first epoch, after the epoch's check (`keras_mwms.callbacks.agreement`); every worker
    must raise WorkersDifferError naming it, after the fit and at the next epoch's check before
    its ModelCheckpoint save (the plain reference nudges nothing). The chief's value is put back
    after each, so the weights still equal plain Keras'."""
    x, y = regression()
    callbacks = keras.callbacks if strategy is None else keras_mwms_module().callbacks
    checkpoint = os.path.join(arguments.out, "one_worker_nudges_state", f"w{INDEX}.weights.h5")
    with scope():
        # JAX trains BatchNormalization on global arrays (DataParallel): global moments already.
        model = common.mlp(batch_norm=True, synchronized=strategy is not None and BACKEND != "jax")
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    caught = []
    for hook, epochs, extra in (("train_end", 1, []),
                                ("epoch_end", 2, [callbacks.ModelCheckpoint(checkpoint, save_weights_only=True)])):
        nudge = _NudgeOnWorker1(hook)
        try:
            fit_arrays(model, x, y, epochs=epochs, callbacks=[nudge, *extra])
        except RuntimeError as error:
            caught.append({"type": type(error).__name__, "message": str(error),
                           "variable": getattr(error, "variable", None), "workers": getattr(error, "workers", None)})
        nudge.restore()
    return model, {"caught": caught, "moving_mean_path": nudge._variable().path}


VARIANTS = {name[len("variant_"):]: function for name, function in sorted(globals().items())
            if name.startswith("variant_")}


def run_variant(name: str) -> None:
    keras.utils.set_random_seed(SEED)
    folder = os.path.join(arguments.out, name)
    results: dict = {}
    weights = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model, results = VARIANTS[name]()
            weights = model if isinstance(model, list) else model.get_weights()
        except Exception as error:     # recorded for the test; the next variant still runs
            results = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
            common.log(f"variant {name} raised:", results["traceback"])
    results["warnings"] = [str(warning.message) for warning in caught]
    os.makedirs(folder, exist_ok=True)
    if weights is not None:
        np.savez(os.path.join(folder, f"w{INDEX}.npz"), *weights)
    common.save_result(folder, INDEX, **results)
    common.log(f"variant {name} done")


class _InterruptMidEpoch(keras.callbacks.Callback):
    """Keras' BackupAndRestore docstring's interruption, in the second epoch's fourth step."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 3:
            raise RuntimeError("Interrupting!")


def interrupted_and_resumed_fit(owner, name: str) -> dict:
    """A fit backed up every 2 steps, interrupted mid-epoch and resumed: every per-strategy
    piece of state is used (resume's pending skip, the ledger, the wire counts, the tables)."""
    keras.utils.set_random_seed(SEED)
    x, y = regression()
    with owner.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    backup = keras.callbacks.BackupAndRestore(os.path.join(arguments.out, "lifecycle", name), save_freq=2)
    with contextlib.suppress(RuntimeError):
        fit_arrays(model, x, y, callbacks=[backup, _InterruptMidEpoch()])
    history = fit_arrays(model, x, y, callbacks=[backup])
    from keras_mwms import active

    return {"resumed_epochs": len(history["loss"]), "loss": history["loss"],
            "tables": [table.name for table in active.current_session().tables]}


def check_lifecycle() -> None:
    """`close()` leaves the process as the strategy found it (`keras_mwms.active`); one worker
    then starts a second strategy in the same process, a notebook's pattern, and closes it too.
    Dumped to OUT/lifecycle/w<index>.json (tests/test_user_scripts.py); skipped with --only."""
    results = {"first": interrupted_and_resumed_fit(strategy, "first")}
    installed = common.patches_installed()
    strategy.close()
    results["after_close"] = common.lifecycle_problems(common.KERAS_BEFORE_THE_STRATEGY, installed)
    if strategy.num_workers == 1:
        again = keras_mwms_module().MultiWorkerMirroredStrategy()
        results["second"] = interrupted_and_resumed_fit(again, "second")
        installed = common.patches_installed()
        again.close()
        results["after_second_close"] = common.lifecycle_problems(common.KERAS_BEFORE_THE_STRATEGY, installed)
    common.save_result(os.path.join(arguments.out, "lifecycle"), INDEX, **results)


def run_job(the_strategy, argv: list[str]) -> None:
    """The variants of the command line `argv` (without the script) in `the_strategy` (None:
    plain Keras); with `--lifecycle`, only `check_lifecycle`, which closes the strategy
    (`tests/workers/jobs.py` runs it last in a warm process)."""
    global strategy, arguments, INDEX, IS_CHIEF
    strategy, arguments = the_strategy, parser.parse_args(argv)
    INDEX = 0 if strategy is None else strategy.worker_index
    IS_CHIEF = INDEX == 0
    if arguments.lifecycle:
        if strategy is not None:
            check_lifecycle()
        return
    for variant_name in (arguments.only.split(",") if arguments.only else VARIANTS):
        run_variant(variant_name)
    common.log("all variants done")


def main() -> None:
    """`python user_scripts.py OUT [--plain] ...`: a fresh process, the variants then (without
    `--only`) the lifecycle check."""
    argv = sys.argv[1:]
    options = parser.parse_args(argv)
    if options.log_level:   # before keras_mwms is imported, as a user silencing it does
        logging.getLogger("keras_mwms").setLevel(options.log_level)
    the_strategy = None
    if not options.plain:
        common.KERAS_BEFORE_THE_STRATEGY = common.keras_internals()   # for check_lifecycle()
        # Before any TensorFlow operation (TF can only configure collectives before the first).
        the_strategy = keras_mwms_module().MultiWorkerMirroredStrategy()
    run_job(the_strategy, argv)
    if the_strategy is not None and not options.only and not options.lifecycle:
        run_job(the_strategy, [*argv, "--lifecycle"])


def keras_mwms_module():
    import keras_mwms

    return keras_mwms


if __name__ == "__main__":
    main()
