"""`keras_mwms.data`: what a tf.data input's first-batch digest reads (the rest of the data
contract is exercised by the gangs of `tests/test_user_scripts.py`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.multiworker import REPO, worker_env

SCRIPT = """
import gc
import numpy as np
import tensorflow as tf
from keras_mwms.data import first_batch_digest

rows = tf.data.Dataset.from_tensor_slices(np.arange(100.0))
cached = first_batch_digest(rows.cache().batch(8))
assert cached == first_batch_digest(rows.cache().batch(8))
assert cached != first_batch_digest(rows.map(lambda value: value + 1.0).cache().batch(8))
gc.collect()
print("digests", cached)
"""


@pytest.mark.tensorflow
def test_the_digest_of_a_cached_pipeline_reads_below_the_cache_without_tf_warning():
    """Reading a first batch through `cache()` made TF warn "did not fully read the dataset
    being cached" where plain Keras prints nothing (issue 31)."""
    env = {**os.environ, **worker_env("tensorflow")}
    env.pop("TF_CPP_MIN_LOG_LEVEL")    # warnings on, as a user has them
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and "digests" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "did not fully read the dataset being cached" not in result.stderr, result.stderr[-3000:]
