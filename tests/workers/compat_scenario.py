"""The compat.v1 strategy surface and known multi-worker pitfalls, on 2 real workers.

Writes `<out>/w<index>.json` with every observed value; tests/test_compat_v1.py asserts.

    python compat_scenario.py OUT      # or as a job of tests/workers/jobs.py: run_job(strategy, [OUT])
"""

import sys

import common


def run_job(strategy, argv: list[str]) -> None:
    """Observes the surface in `strategy` and writes `<argv[0]>/w<index>.json`."""
    import keras
    import numpy as np

    out = argv[0]
    index = strategy.worker_index
    results = {"task_type": strategy.cluster_resolver.task_type,
               "task_id": strategy.cluster_resolver.task_id,
               "num_accelerators": strategy.cluster_resolver.num_accelerators()}

    def numpy(value):
        return keras.ops.convert_to_numpy(value).tolist()

    # A partial batch: a global batch of 6 rows split [0, 1, 2, 3] / [4, 5]; MEAN divides by 6 rows.
    local = np.array([0.0, 1.0, 2.0, 3.0] if index == 0 else [4.0, 5.0], dtype="float32")
    per_replica = strategy.run(lambda: keras.ops.convert_to_tensor(local))
    results["reduce_sum_axis0"] = numpy(strategy.reduce("SUM", per_replica, axis=0))
    results["reduce_mean_axis0"] = numpy(strategy.reduce("MEAN", per_replica, axis=0))
    same_shape = strategy.run(lambda: keras.ops.convert_to_tensor(np.array([1.0, 2.0], "float32") * (index + 1)))
    results["reduce_mean_none"] = numpy(strategy.reduce("MEAN", same_shape, axis=None))
    results["reduce_sum_none"] = numpy(strategy.reduce("SUM", same_shape, axis=None))

    # make_dataset_iterator + experimental_run over global batches of 4 rows.
    dataset = strategy.experimental_make_numpy_dataset(np.arange(16, dtype="float32").reshape(8, 2)).batch(4)
    iterator = strategy.make_dataset_iterator(dataset)
    first = strategy.experimental_run(lambda batch: batch * 1.0, iterator)
    results["dataset_iterator_first"] = [numpy(part) for part in strategy.experimental_local_results(first)]

    def input_fn(input_context):
        import tensorflow as tf

        rows = tf.data.Dataset.range(12).shard(input_context.num_input_pipelines,
                                               input_context.input_pipeline_id)
        return rows.batch(input_context.get_per_replica_batch_size(4))

    iterator = strategy.make_input_fn_iterator(input_fn)
    first = strategy.experimental_run(lambda batch: batch, iterator)
    results["input_fn_first"] = [numpy(part) for part in strategy.experimental_local_results(first)]
    try:
        strategy.make_input_fn_iterator(input_fn, replication_mode="PER_REPLICA")
        results["bad_mode"] = "accepted"
    except ValueError as error:
        results["bad_mode"] = str(error)

    try:
        import tensorflow as tf

        config = strategy.update_config_proto(tf.compat.v1.ConfigProto())
        results["update_config_proto"] = type(config).__name__
    except NotImplementedError as error:
        results["update_config_proto"] = f"NotImplementedError: {error}"

    # Scripts that branch on `task_type == "worker"`.
    if strategy.cluster_resolver.task_type == "worker":
        results["branch"] = f"worker {strategy.cluster_resolver.task_id}"
    common.save_result(out, index, **results)


def main() -> None:
    import keras_mwms

    run_job(keras_mwms.MultiWorkerMirroredStrategy(), sys.argv[1:])


if __name__ == "__main__":
    main()
