"""Every private Keras attribute keras_mwms patches or calls, as a `Target` below an anchor.

The patch tables (`keras_mwms.backends.*.patches`, `resume`, `model_scope`, `callback_list`,
`keras_mwms.diagnostics`) name these constants instead of `"module:Owner.attribute"` strings,
and `keras_mwms.backends.keras_api.usability` checks that every one needed by the active
backend exists before the workers meet. `OPTIONAL` ones serve rows behind a feature test.

Example:

>>> str(TRAINER_FIT), TRAINER_FIT.exists()
('trainer.fit', True)
>>> all(isinstance(target, Target) for target in ALL)
True
"""

from __future__ import annotations

from keras_mwms.backends.keras_api.anchors import (
    BACKEND_OPTIMIZER,
    BASE_OPTIMIZER,
    BASE_TRAINER,
    BATCH_NORMALIZATION,
    CALLBACK_LIST,
    DATA_ADAPTERS,
    DISTRIBUTION_MODULE,
    JAX_UTILS,
    LAYER,
    LOSS_MODULE,
    LOSS_SCALE_OPTIMIZER,
    METRIC,
    MODEL_CHECKPOINT,
    MULTI_OPTIMIZER,
    OPS_PACKAGE,
    STATELESS_SCOPE_MODULE,
    TENSORBOARD,
    TORCH_ADAM,
    TORCH_SGD,
    TRAINER,
    TRAINER_MODULE,
    VARIABLE,
    Target,
)

TF = ("tensorflow",)
JAX = ("jax",)
TORCH = ("torch",)

# -- the trainer (every backend) ------------------------------------------------------------
TRAINER_FIT = Target(TRAINER, "fit")
TRAINER_EVALUATE = Target(TRAINER, "evaluate")
TRAINER_PREDICT = Target(TRAINER, "predict")
TRAINER_PREDICT_ON_BATCH = Target(TRAINER, "predict_on_batch")
TRAINER_TRAIN_STEP = Target(TRAINER, "train_step")
TRAINER_TEST_STEP = Target(TRAINER, "test_step")
TRAINER_MAKE_TRAIN_FUNCTION = Target(TRAINER, "make_train_function")
TRAINER_MAKE_TEST_FUNCTION = Target(TRAINER, "make_test_function")
TRAINER_MAKE_PREDICT_FUNCTION = Target(TRAINER, "make_predict_function", backends=JAX)
TRAINER_METRICS_RESULT_OR_LOGS = Target(TRAINER, "_get_metrics_result_or_logs", backends=JAX + TORCH)
TRAINER_GET_METRICS_RESULT = Target(TRAINER, "get_metrics_result", backends=TF + TORCH)
BASE_TRAINER_INIT = Target(BASE_TRAINER, "__init__")
BASE_TRAINER_COMPUTE_METRICS = Target(BASE_TRAINER, "compute_metrics")
# Keras 3.16's own torch distribution: the DDP wrap, and metric results all-reduced
TORCH_INITIALIZE_DDP = Target(TRAINER, "_initialize_ddp", backends=TORCH)
BASE_TRAINER_GET_METRICS_RESULT = Target(BASE_TRAINER, "get_metrics_result", backends=TORCH)
# TensorFlow: metric states combined by max/min are made per replica (`tensorflow.metric_extremes`)
TF_METRIC_ADD_VARIABLE = Target(METRIC, "add_variable", backends=TF)
EPOCH_ITERATOR_ENUMERATE = Target(TRAINER_MODULE, "EpochIterator._enumerate_iterator")

# -- TensorFlow trainer and optimizer -------------------------------------------------------
TF_MAYBE_SYMBOLIC_BUILD = Target(TRAINER, "_maybe_symbolic_build", backends=TF)
TF_REDUCE_PER_REPLICA = Target(TRAINER_MODULE, "reduce_per_replica", backends=TF)
TF_COLLECTIVE_MULTI_WORKER = Target(TRAINER_MODULE, "_collective_all_reduce_multi_worker", backends=TF)
TF_EPOCH_ITERATOR_INIT = Target(TRAINER_MODULE, "TFEpochIterator.__init__", backends=TF)
TF_BACKEND_APPLY_GRADIENTS = Target(BACKEND_OPTIMIZER, "_backend_apply_gradients", backends=TF)
TF_LOSS_SCALE_APPLY = Target(LOSS_SCALE_OPTIMIZER, "_tf_apply", backends=TF)
SCALE_LOSS_FOR_DISTRIBUTION = Target(LOSS_MODULE, "scale_loss_for_distribution", backends=TF)
UNSCALE_LOSS_FOR_DISTRIBUTION = Target(LOSS_MODULE, "unscale_loss_for_distribution", backends=TF)

# -- layers ----------------------------------------------------------------------------------
BATCH_NORM_INIT = Target(BATCH_NORMALIZATION, "__init__", backends=TORCH)
BATCH_NORM_CALL = Target(BATCH_NORMALIZATION, "call", backends=TF)
BATCH_NORM_MOMENTS = Target(BATCH_NORMALIZATION, "_moments", backends=TF + JAX + TORCH)

# -- data adapters ---------------------------------------------------------------------------
GET_DATA_ADAPTER = Target(DATA_ADAPTERS, "get_data_adapter")
DATA_ADAPTER = Target(DATA_ADAPTERS, "data_adapter.DataAdapter")
ARRAY_DATA_ADAPTER = Target(DATA_ADAPTERS, "array_data_adapter.ArrayDataAdapter")
CAN_CONVERT_ARRAYS = Target(DATA_ADAPTERS, "array_data_adapter.can_convert_arrays")
TRAIN_VALIDATION_SPLIT = Target(DATA_ADAPTERS, "array_slicing.train_validation_split")
UNPACK_X_Y_SAMPLE_WEIGHT = Target(DATA_ADAPTERS, "data_adapter_utils.unpack_x_y_sample_weight")
CLASS_WEIGHT_TO_SAMPLE_WEIGHTS = Target(DATA_ADAPTERS, "data_adapter_utils.class_weight_to_sample_weights")
GENERATOR_ADAPTER = Target(DATA_ADAPTERS, "generator_data_adapter.GeneratorDataAdapter", backends=TF)
GENERATOR_GET_TF_DATASET = Target(DATA_ADAPTERS, "generator_data_adapter.GeneratorDataAdapter.get_tf_dataset",
                                  backends=TF)
TF_DATASET_ADAPTER = Target(DATA_ADAPTERS, "tf_dataset_adapter.TFDatasetAdapter", backends=TF)
PY_DATASET_ADAPTER = Target(DATA_ADAPTERS, "py_dataset_adapter.PyDatasetAdapter")
PY_DATASET_GET_TF_DATASET = Target(DATA_ADAPTERS, "py_dataset_adapter.PyDatasetAdapter.get_tf_dataset",
                                   backends=TF)
PY_DATASET_ON_EPOCH_BEGIN = Target(DATA_ADAPTERS, "py_dataset_adapter.PyDatasetAdapter.on_epoch_begin",
                                   backends=TF)
PY_DATASET_GET_ITERATOR = Target(DATA_ADAPTERS, "py_dataset_adapter.PyDatasetAdapter._get_iterator")

# -- callbacks ---------------------------------------------------------------------------------
CALLBACK_LIST_INIT = Target(CALLBACK_LIST, "__init__")
CALLBACK_LIST_ON_EPOCH_END = Target(CALLBACK_LIST, "on_epoch_end")
CALLBACK_LIST_ON_TRAIN_BEGIN = Target(CALLBACK_LIST, "on_train_begin")
CALLBACK_LIST_ON_TRAIN_END = Target(CALLBACK_LIST, "on_train_end")
CALLBACK_LIST_ON_TEST_BEGIN = Target(CALLBACK_LIST, "on_test_begin")
CALLBACK_LIST_ON_TEST_END = Target(CALLBACK_LIST, "on_test_end")

# -- JAX ---------------------------------------------------------------------------------------
JAX_DISTRIBUTE_TENSOR = Target(DISTRIBUTION_MODULE, "distribution_lib.distribute_tensor", backends=JAX)
JAX_DISTRIBUTE_DATA = Target(TRAINER_MODULE, "_distribute_data", backends=JAX)
VARIABLE_INITIALIZE = Target(VARIABLE, "_initialize", backends=JAX + TORCH)
TF_VARIABLE_DIRECT_ASSIGN = Target(VARIABLE, "_direct_assign", backends=TF)
VARIABLE_INITIALIZE_WITH_INITIALIZER = Target(VARIABLE, "_initialize_with_initializer", backends=JAX)
IN_STATELESS_SCOPE = Target(STATELESS_SCOPE_MODULE, "in_stateless_scope", backends=JAX)
IS_IN_JAX_TRACING_SCOPE = Target(JAX_UTILS, "is_in_jax_tracing_scope")

# -- torch optimizers --------------------------------------------------------------------------
BASE_OPTIMIZER_SCALE_LOSS = Target(BASE_OPTIMIZER, "scale_loss", backends=TORCH)
BASE_OPTIMIZER_APPLY = Target(BASE_OPTIMIZER, "apply", backends=TORCH)
LOSS_SCALE_SCALE_LOSS = Target(LOSS_SCALE_OPTIMIZER, "scale_loss", backends=TORCH)
LOSS_SCALE_APPLY = Target(LOSS_SCALE_OPTIMIZER, "apply", backends=TORCH)
MULTI_OPTIMIZER_APPLY = Target(MULTI_OPTIMIZER, "apply", backends=TORCH)
TORCH_ADAM_CLASS = Target(TORCH_ADAM, "Adam")
TORCH_ADAM_UPDATE = Target(TORCH_ADAM, "Adam._parallel_update_step")
TORCH_SGD_UPDATE = Target(TORCH_SGD, "SGD._parallel_update_step")
# the `ops.cond` Keras 3.12-3.15's optimizer branches its gradient accumulation with, and its Operation
OPS_COND = Target(OPS_PACKAGE, "cond", backends=TORCH)
OPS_COND_OPERATION = Target(OPS_PACKAGE, "core.Cond", backends=TORCH)

# -- private methods and properties called through keras_api.attributes ----------------------
# (their instance attributes exist only on real objects: tests/test_keras_api.py reads those)
OPTIMIZER_GET_VARIABLE_INDEX = Target(BASE_OPTIMIZER, "_get_variable_index")
OPTIMIZER_CLIP_GRADIENTS = Target(BASE_OPTIMIZER, "_clip_gradients", backends=TF)
OPTIMIZER_APPLY_WEIGHT_DECAY = Target(BASE_OPTIMIZER, "_apply_weight_decay", backends=TF)
OPTIMIZER_BACKEND_UPDATE_STEP = Target(BASE_OPTIMIZER, "_backend_update_step", backends=TF)
OPTIMIZER_RESET_ACCUMULATORS = Target(BASE_OPTIMIZER, "_backend_reset_gradient_accumulators", backends=TF)
LOSS_SCALE_HANDLE_FINITE_GRADS = Target(LOSS_SCALE_OPTIMIZER, "_stateful_handle_finite_grads", backends=TF)
LOSS_SCALE_HANDLE_NON_FINITE_GRADS = Target(LOSS_SCALE_OPTIMIZER, "_stateful_handle_non_finite_grads",
                                            backends=TF)
BASE_TRAINER_SYMBOLIC_BUILD = Target(BASE_TRAINER, "_symbolic_build", backends=TF)
BASE_TRAINER_COMPUTE_LOSS = Target(BASE_TRAINER, "_compute_loss", backends=TORCH)
TRAINER_UPDATE_METRICS_VARIABLES = Target(TRAINER, "_update_metrics_variables", backends=JAX)
LAYER_FLATTEN_LAYERS = Target(LAYER, "_flatten_layers")
PY_DATASET_STANDARDIZE_BATCH = Target(DATA_ADAPTERS, "py_dataset_adapter.PyDatasetAdapter._standardize_batch",
                                      backends=TF)
MODEL_CHECKPOINT_SAVE_MODEL = Target(MODEL_CHECKPOINT, "_save_model")
MODEL_CHECKPOINT_GET_FILE_PATH = Target(MODEL_CHECKPOINT, "_get_file_path")
MODEL_CHECKPOINT_SHOULD_SAVE_MODEL = Target(MODEL_CHECKPOINT, "_should_save_model")
TENSORBOARD_TRAIN_WRITER = Target(TENSORBOARD, "_train_writer")

OPTIONAL = (MULTI_OPTIMIZER_APPLY, TORCH_INITIALIZE_DDP)
"""Targets of rows behind a feature test (`KerasHas`): missing is not an error."""

ALL = tuple(value for value in dict(globals()).values() if isinstance(value, Target))
"""Every target, in declaration order."""
