"""The PyTorch backend: `torch.distributed` collectives under Keras' torch trainer.

Keras 3.15.1 has no multi-process support on torch, so this adapter supplies all of it:

| module | what |
|---|---|
| `engine` | join `torch.distributed` at the chief's address, the collective port, ordered teardown |
| `faults` | the lost-worker hook: gloo/nccl errors, the check-in on the TCPStore (the flow is `keras_mwms.backends.faults`) |
| `scope` | variables created in `strategy.scope()` take the chief's values at its exit |
| `surface` | `TorchBackend`: the engine, the scope and the tf.distribute-style surface |
| `patches` | the private-Keras patches (`PATCHES`, `patch_table`), installed while the strategy is open |
| `data` | global batches of any input → this worker's shard |
| `step` | the distributed train and test steps |
| `gradients` | global-batch gradients, synchronized BatchNormalization |
| `metrics` | global metric results and logs |
| `overlap` | gradient all-reduces started during `backward()` |
| `fused_adam` | Keras' Adam update without temporaries, bit for bit |
| `recompile_limit` | a warning when TorchDynamo stops compiling a model's train step |
| `state` | keras_mwms' state of Keras models and optimizers |

Example:

>>> TorchBackend.name
'torch'
"""

from keras_mwms.backends.torch.surface import TorchBackend

__all__ = ["TorchBackend"]
