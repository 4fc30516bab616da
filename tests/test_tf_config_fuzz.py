"""Generated malformed TF_CONFIG strings: each is a clear TFConfigError, never a deep traceback."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keras_mwms.startup.cluster import TFConfigError, parse_tf_config

VALID = {"cluster": {"worker": ["localhost:2001", "localhost:2002"]},
         "task": {"type": "worker", "index": 0}}

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)
bad_addresses = st.one_of(
    st.sampled_from(["localhost", ":2001", "localhost:", "localhost:0", "localhost:65536",
                     "localhost:-1", "local host:1", "::1:2001", "[::1]2001", "[nope]:1", "a/b:1",
                     "localhost:2001"]),
    st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2),
)


def mutations():
    """Each draws one mutation of a valid TF_CONFIG that must make it invalid."""
    drop_top = st.sampled_from(["cluster", "task"]).map(
        lambda key: {k: v for k, v in VALID.items() if k != key})
    bad_cluster = junk.filter(lambda v: not isinstance(v, dict) or not v).map(
        lambda value: {**VALID, "cluster": value})
    bad_job_name = st.text(min_size=1, max_size=8).filter(
        lambda name: name not in ("worker", "chief", "evaluator", "ps")).map(
        lambda name: {**VALID, "cluster": {name: ["localhost:1"]}})
    bad_job_value = junk.filter(lambda v: not isinstance(v, list) or not v).map(
        lambda value: {**VALID, "cluster": {"worker": value}})
    bad_address = bad_addresses.map(
        lambda address: {**VALID, "cluster": {"worker": ["localhost:2001", address]}})
    bad_task = junk.filter(lambda v: not isinstance(v, dict)).map(lambda value: {**VALID, "task": value})
    bad_type = st.one_of(st.text(max_size=8).filter(lambda t: t != "worker"), st.integers(), st.none()).map(
        lambda value: {**VALID, "task": {"type": value, "index": 0}})
    bad_index = st.one_of(st.integers().filter(lambda i: not 0 <= i < 2), st.text(max_size=3),
                          st.floats(allow_nan=False), st.booleans(), st.none()).map(
        lambda value: {**VALID, "task": {"type": "worker", "index": value}})
    as_json = st.one_of(drop_top, bad_cluster, bad_job_name, bad_job_value, bad_address, bad_task,
                        bad_type, bad_index).map(json.dumps)
    not_json = st.text(max_size=30).filter(lambda text: not _is_json(text))
    return st.one_of(as_json, not_json, junk.filter(lambda v: not isinstance(v, dict)).map(json.dumps))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(mutations())
def test_every_generated_malformed_config_is_a_clear_error(text):
    try:
        parse_tf_config(text)
    except TFConfigError as error:
        message = str(error)
        assert "TF_CONFIG" in message
        assert len(message) < 2000
    else:
        raise AssertionError(f"accepted a malformed TF_CONFIG: {text!r}")


@pytest.mark.filterwarnings("ignore:TF_CONFIG has keys")
@settings(max_examples=200, deadline=None)
@given(junk)
def test_arbitrary_json_is_either_valid_or_a_clear_error(value):
    try:
        parsed = parse_tf_config(json.dumps(value))
    except TFConfigError as error:
        message = str(error)
        assert "TF_CONFIG" in message
        assert len(message) < 2000
    else:
        # Accepted: then it describes a cluster with this task in it.
        tasks = parsed["cluster"][parsed["task_type"]]
        assert 0 <= parsed["task_id"] < len(tasks), parsed
