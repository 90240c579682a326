"""Message and ToolCall have printers of their own (a transcript prints one per entry): they
must print byte for byte what the general field-by-field printer prints, and what the json
module prints of the encoding, or journals written before would not replay."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from loomflow.errors import InvalidArgumentTypeError
from loomflow.messages import Message, ToolCall
from loomflow.runtime import codec
from loomflow.runtime.codec import _FAST_PRINTS, _Printer

# Unicode of every kind a transcript meets: accents, emoji, a surrogate pair spelled as two
# code points, a lone surrogate (half an emoji), controls and quotes JSON escapes.
texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ["", "é", "\U0001f600", "\ud83d\ude00", "\ud83d", "a\udce9b", '"\\\n\t\x00', "\u2028"]
    ),
)
arguments = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**64 + 1, -(10**30), 0.1, -0.0, 1e16, 1.5e-300, float("inf")])
    | st.floats(allow_nan=False)
    | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=10,
)
calls = st.builds(ToolCall, id=texts, name=texts, arguments=st.dictionaries(texts, arguments))
messages = st.one_of(
    st.builds(Message, role=st.sampled_from(["system", "user"]), content=texts),
    st.builds(Message.assistant, texts, st.lists(calls, max_size=3)),
    st.builds(
        Message.tool_result,
        texts.filter(bool),
        texts,
        name=st.none() | texts,
        is_error=st.booleans(),
    ),
)


def _general(value: Any, *, sort: bool, depth: int = 0) -> str:
    """What a printer without the classes' own printers (and nothing kept) prints."""
    saved = dict(_FAST_PRINTS)
    _FAST_PRINTS.clear()
    try:
        whole = codec._canonical_json if sort else codec._compact
        return _Printer(whole, sort=sort).text(value, depth)
    finally:
        _FAST_PRINTS.update(saved)


def _json(value: Any, *, sort: bool) -> str:
    return json.dumps(
        codec.encode(value), sort_keys=sort, separators=(",", ":"), ensure_ascii=False
    )


def test_message_and_tool_call_have_their_own_printers() -> None:
    assert _FAST_PRINTS.get(Message) is codec._print_message
    assert _FAST_PRINTS.get(ToolCall) is codec._print_tool_call


@settings(max_examples=400, deadline=None)
@given(st.one_of(messages, calls, st.lists(messages, max_size=4)))
def test_their_printers_print_what_the_general_one_prints(value: Any) -> None:
    for sort in (True, False):
        fresh = _Printer(codec._canonical_json if sort else codec._compact, sort=sort)
        for depth in (0, 3, 40):
            assert fresh.text(value, depth) == _general(value, sort=sort, depth=depth)
        assert fresh.text(value, 0) == _json(value, sort=sort)
    # And through the public entry points (the kept texts of the module's printers).
    assert codec.canonical_bytes(value) == codec._utf8(_json(value, sort=True))
    assert codec.dumps(value) == codec._utf8(_json(value, sort=False))


def test_a_message_with_a_nested_call_prints_as_pinned() -> None:
    # Pinned text: what journals already hold for this message (sorted, and as stored).
    call = ToolCall(id="c1", name="f", arguments={"b": [1, {"z": 2**70}], "a": 0.5, "é": None})
    message = Message.assistant("hi \U0001f600", [call])
    head = '{"$t":"model","v":{"cls":"loomflow.messages:'
    assert codec.canonical_bytes(message).decode() == (
        head + 'Message","fields":{"content":"hi \U0001f600","is_error":false,"name":null,'
        '"role":"assistant","tool_call_id":null,"tool_calls":[' + head + 'ToolCall","fields":'
        '{"arguments":{"a":0.5,"b":[1,{"z":1180591620717411303424}],"é":null},"id":"c1",'
        '"name":"f"}}}]}}}'
    )
    assert codec.dumps(message).decode() == (
        head
        + 'Message","fields":{"role":"assistant","content":"hi \U0001f600","tool_calls":['
        + head
        + 'ToolCall","fields":{"id":"c1","name":"f","arguments":{"b":[1,{"z":'
        '1180591620717411303424}],"a":0.5,"é":null}}}}],"tool_call_id":null,"name":null,'
        '"is_error":false}}}'
    )


@pytest.mark.parametrize(
    "odd",
    [
        # Built without validation: fields holding what validation would not leave there.
        Message.model_construct(role="user", content=7, tool_calls=[], tool_call_id=None),
        Message.model_construct(role="tool", content="x", tool_calls=(), tool_call_id=3),
        Message.model_construct(role="user", content="x", tool_calls=[], is_error=1),
        ToolCall.model_construct(id=1, name="t", arguments={}),
        ToolCall.model_construct(id="c", name="t", arguments=[1, 2]),
    ],
)
def test_fields_validation_would_not_leave_print_as_the_general_printer_prints_them(
    odd: BaseModel,
) -> None:
    for sort in (True, False):
        fresh = _Printer(codec._canonical_json if sort else codec._compact, sort=sort)
        assert fresh.text(odd, 0) == _general(odd, sort=sort)


@pytest.mark.parametrize("calls", [[], [ToolCall(id="c", name="t", arguments={"a": [[1]]})]])
def test_a_message_too_deep_is_refused_as_the_general_printer_refuses_it(
    calls: list[ToolCall],
) -> None:
    message = Message.assistant("x", calls)
    for sort in (True, False):
        whole = codec._canonical_json if sort else codec._compact
        for depth in range(codec.MAX_DEPTH - 6, codec.MAX_DEPTH + 1):
            try:
                expected: Any = _general(message, sort=sort, depth=depth)
            except codec.NestingTooDeepError:
                expected = codec.NestingTooDeepError
            try:
                got: Any = _Printer(whole, sort=sort).text(message, depth)
            except codec.NestingTooDeepError:
                got = codec.NestingTooDeepError
            assert got == expected, depth


def test_a_subclass_prints_field_by_field_under_its_own_name() -> None:
    class Note(Message):
        model_config = ConfigDict(frozen=True)

    note = Note(role="user", content="n")
    assert codec.canonical_bytes(note) == codec._utf8(_json(note, sort=True))
    assert b"Note" in codec.dumps(note)


def test_a_class_with_other_fields_gets_no_printer_of_its_own() -> None:
    class Other(BaseModel):
        model_config = ConfigDict(frozen=True)
        id: str
        name: str

    codec.mark_immutable(Other)
    with pytest.raises(InvalidArgumentTypeError, match="no printer of its own"):
        codec.print_fast(Other)


def _nested(levels: int, inner: str) -> bytes:
    return ("[" * levels + inner + "]" * levels).encode()


_USAGE = '"cls":"loomflow.messages:Usage"'


@pytest.mark.parametrize(
    ("row", "refusal"),
    [
        (b'{"$t":"model","v":[1]}', "malformed 'model' value: expected an object, not list"),
        (
            b'{"$t":"model","v":{' + _USAGE.encode() + b',"fields":[1]}}',
            "malformed 'model' value: expected an object, not list",
        ),
        (b'{"$t":"model","v":{' + _USAGE.encode() + b"}}", "malformed 'model' value: 'fields'"),
        (b'{"$t":"model","v":{"fields":{}}}', "malformed 'model' value: 'cls'"),
        (
            b'{"$t":"model","v":{' + _USAGE.encode() + b',"fields":{"input_tokens":-1}}}',
            "'loomflow.messages:Usage' refused the stored fields",
        ),
        (
            _nested(100, '{"$t":"model","v":{"cls":"x:Y","fields":{}}}'),
            "nested more than 100 containers deep",
        ),
        (
            _nested(99, '{"$t":"model","v":{"cls":"x:Y","fields":{"a":[]}}}'),
            "nested more than 100 containers deep",
        ),
    ],
)
def test_crafted_model_rows_are_refused_as_before(row: bytes, refusal: str) -> None:
    # The model decoder checks its payload inline (every stored message comes through it):
    # the refusals are the ones the shared checks gave.
    with pytest.raises(codec.UnknownTagError) as refused:
        codec.loads(row)
    assert str(refused.value).startswith(refusal)


def test_model_rows_at_the_depth_limit_still_decode() -> None:
    for levels, fields, leaf in ((99, "{}", {}), (98, '{"a":[]}', {"a": []})):
        row = _nested(levels, '{"$t":"model","v":{"cls":"x:Y","fields":' + fields + "}}")
        value: Any = codec.loads(row)
        for _ in range(levels):
            value = value[0]
        assert value == leaf
