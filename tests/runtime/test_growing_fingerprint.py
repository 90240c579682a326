"""A growing first argument is fingerprinted from a kept SHA-256 state, byte for byte as a list.

The agent's model call fingerprints its transcript every turn; the kept state makes that cost
the new messages only. Journals written before it must replay, so the fingerprint of every
snapshot has to equal the one of the same plain list, whatever happened to the list between
snapshots (growth, an item replaced, the list cut short).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomflow.messages import Message, ModelResponse, ModelSettings, ToolCall, Usage
from loomflow.runtime import codec
from loomflow.runtime._store import fingerprint

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)
messages = st.one_of(
    st.builds(Message.user, st.text(max_size=20)),
    st.builds(Message.tool_result, st.text(min_size=1, max_size=5), st.text(max_size=20)),
    st.builds(
        lambda text, args: Message.assistant(text, [ToolCall(id="c", name="t", arguments=args)]),
        st.text(max_size=10),
        st.dictionaries(st.text(max_size=4), json_values, max_size=3),
    ),
)
items = st.one_of(messages, json_values)
# What happens to the list before the next snapshot.
changes = st.one_of(
    st.tuples(st.just("append"), st.lists(items, max_size=3)),
    st.tuples(st.just("replace"), items),
    st.tuples(st.just("cut"), st.integers(0, 5)),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(items, max_size=4),
    st.lists(changes, min_size=1, max_size=8),
    st.lists(json_values, max_size=2),
    st.dictionaries(st.text(max_size=4), json_values, max_size=2),
)
def test_every_snapshot_fingerprints_as_the_plain_list(
    start: list[Any], steps: list[tuple[str, Any]], rest: list[Any], kwargs: dict[str, Any]
) -> None:
    hasher = codec.GrowingHasher()
    current = list(start)
    for kind, arg in steps:
        if kind == "append":
            current.extend(arg)
        elif kind == "replace" and current:
            current[len(current) // 2] = arg
        elif kind == "cut":
            del current[arg:]
        snapshot = hasher.snapshot(current)
        assert snapshot == current
        expected = fingerprint((list(current), *rest), kwargs)
        assert fingerprint((snapshot, *rest), kwargs) == expected
        # Its text as a plain list everywhere else (journaled, or not first).
        assert codec.canonical_bytes(snapshot) == codec.canonical_bytes(list(current))
        assert codec.encode(snapshot) == codec.encode(list(current))


def test_the_model_call_inputs_of_a_transcript() -> None:
    hasher = codec.GrowingHasher()
    transcript = [Message.system("You help."), Message.user("hi")]
    tools: list[Any] = []
    for turn in range(5):
        snapshot = hasher.snapshot(transcript)
        plain = fingerprint((list(transcript), tools, ModelSettings()), {})
        assert fingerprint((snapshot, tools, ModelSettings()), {}) == plain
        transcript = [*transcript, Message.assistant(f"turn {turn}")]


def test_a_too_deep_later_argument_is_refused_as_with_a_list() -> None:
    deep: Any = []
    for _ in range(codec.MAX_DEPTH + 5):
        deep = [deep]
    snapshot = codec.GrowingHasher().snapshot([Message.user("x")])
    with pytest.raises(codec.NestingTooDeepError):
        fingerprint((snapshot, deep), {})
    with pytest.raises(codec.NestingTooDeepError):
        fingerprint(([Message.user("x")], deep), {})


def _reference(value: Any) -> bytes:
    """The canonical encoding as the json module prints the tagged encoding."""
    return json.dumps(
        codec.encode(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


responses = st.builds(
    lambda text, args, tokens: ModelResponse(
        text=text,
        tool_calls=[ToolCall(id="c1", name="t", arguments=args)],
        usage=Usage(input_tokens=tokens, output_tokens=tokens // 2),
        model="m",
    ),
    st.text(max_size=10),
    st.dictionaries(st.text(max_size=4), json_values, max_size=3),
    st.integers(0, 10_000),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(messages, responses, json_values), max_size=4))
def test_values_and_objects_print_as_the_json_encoder_prints_their_encoding(
    value: list[Any],
) -> None:
    # Messages and plain objects are printed field by field and key by key; what they print
    # must stay the json module's canonical text, or journals written before would not replay.
    assert codec.canonical_bytes(value) == _reference(value)


def test_a_message_fingerprint_is_the_one_earlier_releases_wrote() -> None:
    # Pinned from the commit before the field-by-field printing: journals it wrote hold it.
    call = ToolCall(id="c3", name="lookup", arguments={"page": 3, "key": "k", "n": None, "b": True})
    transcript = [Message.user("hi \u00e9"), Message.assistant("", [call])]
    assert fingerprint((transcript, ModelSettings()), {}) == (
        "fdbe5ae6a146e997c636721f928899bc8b5926c8e620b027afe53e6d59552f75"
    )
