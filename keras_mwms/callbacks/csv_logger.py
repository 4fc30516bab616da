"""Chief-only `CSVLogger`: one log file per job, each row written once."""

from __future__ import annotations

import keras

from keras_mwms.callbacks import coordination


class CSVLogger(keras.callbacks.CSVLogger):
    """`keras.callbacks.CSVLogger` whose file is written by the chief only.

    The logs are global under keras_mwms (identical on every worker), so the chief's file is
    the job's log: the file one process of plain Keras writes, header once, one row per epoch.
    The other workers write nothing. (Keras' own class run on every worker of a job whose
    workers share the path writes the header and every row once per worker.)

    Example:

    ```python
    model.fit(x, y, epochs=5, callbacks=[keras_mwms.callbacks.CSVLogger("/shared/log.csv")])
    ```

    Args:
        filename: the CSV file the chief writes, e.g. `"run/log.csv"`.
        separator: the string between the values of a row. Defaults to `","`.
        append: `True` appends to an existing file (continuing a training), `False`
            overwrites it. Defaults to `False`.
    """

    def on_train_begin(self, logs=None):
        if coordination.is_chief():
            super().on_train_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        if coordination.is_chief():
            super().on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None):
        if coordination.is_chief():
            super().on_train_end(logs)
