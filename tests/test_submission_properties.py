"""Property-based submissions, generated from the schema: whatever a client sends, the door either
admits a valid JobSpec or refuses it with a reason; no value overflows past it, and the profiler's
check of an admitted one against the cluster never fails, it answers."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.bus import Bus
from shared.cluster import load_cluster
from shared.hardware import types_named
from shared.schema.base import MAX_GPUS, MAX_ID
from shared.schema.jobs import JobSpec
from shared.submissions import submission_problem
from sim.profiles import profile_source

CLUSTER = load_cluster("sia-hetero-64")
MODELS = profile_source(use_zoo=True).types
DECODE = Bus.__new__(Bus)  # the bus's decoding alone, without a connection
DECODE._decoders = {}

# Any id a msgpack client can send (ints too can only be 64-bit on the wire).
ids = st.one_of(
    st.text(max_size=140),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,130}", fullmatch=True),
    st.from_regex(r"[a-z]{1,8}\n", fullmatch=True),
)
counts = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.booleans(),
    st.none(),
)
documents = st.fixed_dictionaries(
    {"id": ids, "application": st.one_of(st.sampled_from(sorted(MODELS)), st.text(max_size=12))},
    optional={
        "requested_gpus": counts,
        "min_gpus": counts,
        "requested_batch": counts,
        "rigid": st.one_of(st.booleans(), counts),
        "strong_scaling": st.booleans(),
        "launcher": st.one_of(st.sampled_from(["goodput", "torchrun"]), st.text(max_size=8)),
        "gpu_types": st.lists(
            st.one_of(
                st.sampled_from(CLUSTER.gpu_types), st.sampled_from(["T4", "a100", "RTX 2080 Ti"]), st.text(max_size=8)
            ),
            max_size=4,
        ),
        "submit_s": st.one_of(st.floats(allow_nan=True), st.none()),
        "version": st.integers(-1, 3),
        "gpus": st.integers(0, 9),
    },
)


@settings(max_examples=400, deadline=None)
@given(documents)
def test_a_submission_is_a_valid_jobspec_or_refused_with_a_reason(document):
    data = msgspec.msgpack.encode(document)
    try:
        spec = DECODE.decode(data, JobSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        assert str(error)
        return
    # What passed the door is inside its bounds: a whole id, counts a KV write and a solver can hold.
    assert spec.id == document["id"] and len(spec.id) <= MAX_ID and "\n" not in spec.id
    assert 1 <= spec.requested_gpus <= MAX_GPUS and 1 <= spec.min_gpus <= MAX_GPUS
    assert "gpus" not in document
    msgspec.msgpack.encode(spec)
    problem = submission_problem(spec, CLUSTER, MODELS, live=True)
    if problem is None:
        assert spec.application in MODELS and spec.submit_s is None
        assert all(types_named(name, CLUSTER.gpu_types) for name in spec.gpu_types)  # a key or a hardware name
        assert spec.requested_gpus <= CLUSTER.total_gpus
    else:
        assert isinstance(problem, str) and problem


@given(st.integers(1, 64).map(float))
def test_an_integral_float_is_a_gpu_count(gpus):
    spec = DECODE.decode(msgspec.msgpack.encode({"id": "j", "application": "cifar10", "requested_gpus": gpus}), JobSpec)
    assert spec.requested_gpus == int(gpus) and isinstance(spec.requested_gpus, int)
