"""Every tag's decoder, fed any JSON payload: a value or UnknownTagError, nothing else.

The existing fuzz builds rows from the encoder's shapes; this one aims at each tag's payload
directly, with numbers at the edges (huge ints, 1e308, booleans), which is where a stored
``timedelta`` of 1e300 days escaped as OverflowError.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomflow.runtime import codec

EDGE_NUMBERS = st.one_of(
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**18, 999_999_999, 1_000_000_000, 86_400 * 10**9]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 1e300, 5e-324]),
    st.booleans(),
)
SCALARS = st.one_of(st.none(), EDGE_NUMBERS, st.text(max_size=20))
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
CLASS_NAMES = st.sampled_from(
    ["loomflow.messages:Message", "loomflow.messages:Usage", "loomflow.tools:ToolOutcome", "x:Y"]
)
PAYLOADS = st.one_of(
    JSON,
    st.lists(EDGE_NUMBERS, min_size=3, max_size=3),  # the shape timedelta expects
    st.fixed_dictionaries({"cls": CLASS_NAMES, "fields": JSON}),
    st.fixed_dictionaries({"cls": CLASS_NAMES, "value": JSON}),
)


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(tag=st.sampled_from(sorted(codec._DECODERS)), payload=PAYLOADS)
def test_each_tag_decodes_any_payload_or_says_it_is_malformed(tag: str, payload: Any) -> None:
    with contextlib.suppress(codec.UnknownTagError):  # anything else fails the test
        codec.decode({"$t": tag, "v": payload})


_HASH_MODULUS = 2**61 - 1  # an int's hash is the int modulo this (not randomised, as str's is)


@pytest.mark.parametrize("tag", ["set", "frozenset", "dict"])
def test_a_row_of_colliding_hashes_is_damaged_not_a_hang(tag: str) -> None:
    # Before: 40,000 ints that all hash alike (a 1 MB row) took 32 s to decode, and a row
    # at the 8 MiB cap most of an hour: a writer of the database could stall every resume.
    crafted = [k * _HASH_MODULUS for k in range(40_000)]
    payload = [[k, 0] for k in crafted] if tag == "dict" else crafted
    started = time.perf_counter()
    with pytest.raises(codec.UnknownTagError, match="share one hash"):
        codec.loads(json.dumps({"$t": tag, "v": payload}))
    assert time.perf_counter() - started < 2
    # What the encoder writes reads back as before, however large.
    ordinary: set[int] = set(range(100_000))
    assert codec.loads(codec.dumps(ordinary)) == ordinary
    assert codec.loads(codec.dumps({k: 1 for k in range(0, 10**6, 7)}))[7] == 1
