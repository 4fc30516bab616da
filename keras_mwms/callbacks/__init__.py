"""Drop-in multi-worker replacements for Keras callbacks (same constructor arguments).

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
from keras_mwms.callbacks.model_checkpoint import ModelCheckpoint
from keras_mwms.callbacks.tensorboard import TensorBoard

__all__ = ["BackupAndRestore", "BackupAndRestoreError", "ModelCheckpoint", "TensorBoard", "TrainingPreempted"]
