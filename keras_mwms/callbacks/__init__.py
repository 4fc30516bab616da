"""Drop-in multi-worker replacements for Keras callbacks (same constructor arguments).

While a strategy is active, Keras' own `ModelCheckpoint`, `BackupAndRestore`, `CSVLogger` and
`TensorBoard` run as these (`keras_mwms.callbacks.worker_aware`), so an unchanged script
works too.

Example:

```python
callbacks = [keras_mwms.callbacks.BackupAndRestore("/tmp/backup"),
             keras_mwms.callbacks.ModelCheckpoint("/tmp/ckpt/best.keras", save_best_only=True)]
```
"""

from keras_mwms.callbacks.backup_and_restore import (
    BackupAndRestore,
    BackupAndRestoreError,
    TrainingPreempted,
)
from keras_mwms.callbacks.csv_logger import CSVLogger
from keras_mwms.callbacks.model_checkpoint import ModelCheckpoint
from keras_mwms.callbacks.tensorboard import TensorBoard

__all__ = ["BackupAndRestore", "BackupAndRestoreError", "CSVLogger", "ModelCheckpoint", "TensorBoard", "TrainingPreempted"]
