"""Work a replayed turn no longer does, counted, and the answers it gives kept as they were.

A replayed agent turn decodes its stored model call and tool outcome (validated: the rows are
untrusted) and fingerprints its inputs. Counted in Python calls (not timed: the machine is
shared), with the count before the change beside each bound.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from loomflow.messages import ModelResponse, TextDelta, ToolCall, Usage
from loomflow.runtime import codec
from loomflow.runtime._names import tool_step, tool_step_name
from loomflow.runtime._store import fingerprint


def _calls(fn: Callable[[], Any], *, printing: Any = None) -> int:
    """Python and C calls made by ``fn``; with ``printing``, only the canonical printer's
    calls that print that very value."""
    made = 0
    text = codec._Printer.text.__code__

    def count(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal made
        if printing is None:
            made += event in ("call", "c_call")
        elif event == "call" and frame.f_code is text and frame.f_locals["value"] is printing:
            made += frame.f_locals["self"] is codec._canonical_printer

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return made


def test_a_stored_model_call_decodes_without_the_long_way_round() -> None:
    call = ToolCall(id="c1", name="lookup", arguments={"key": "k", "page": 1})
    response = ModelResponse(
        tool_calls=[call], usage=Usage(input_tokens=3, output_tokens=8), model="m"
    )
    raw = codec.dumps([TextDelta(text="a"), response])
    assert codec.loads(raw) == [TextDelta(text="a"), response]
    # 104 before: a look-up by name, a class check and pydantic's model_validate frame for
    # each of the five stored models.
    assert _calls(lambda: codec.loads(raw)) <= 80


def test_a_tool_calls_arguments_are_printed_once_for_its_name_and_fingerprint() -> None:
    arguments = {"key": "k", "page": 1, "tags": ["a", None]}
    call = ToolCall(id="c1", name="lookup", arguments=arguments)

    def name_and_fingerprint() -> None:
        _, printed = tool_step(1, 0, call)
        fingerprint((call.name, printed), {})

    assert _calls(name_and_fingerprint, printing=call.arguments) == 1  # twice before


def test_a_model_is_printed_without_building_its_class_name_again() -> None:
    response = ModelResponse(
        tool_calls=[ToolCall(id="c1", name="t", arguments={})], usage=Usage(), model="m"
    )
    codec.dumps(response.model_copy())  # the class layouts, made once per class
    named = 0
    name_of = codec._class_name.__code__

    def count(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal named
        named += event == "call" and frame.f_code is name_of

    sys.setprofile(count)
    try:
        codec.dumps(response)
    finally:
        sys.setprofile(None)
    assert named == 0  # once per model printed before


class Overridden(BaseModel):
    x: int

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Overridden:
        return super().model_validate({"x": obj["x"] + 1}, **kwargs)


codec.register_type(Overridden)


def test_a_registered_model_that_validates_its_own_way_is_still_asked() -> None:
    assert codec.loads(codec.dumps(Overridden(x=1))) == Overridden(x=2)


class StaticallyOverridden(BaseModel):
    x: int

    @staticmethod
    def model_validate(obj: Any, **kwargs: Any) -> StaticallyOverridden:  # type: ignore[override]
        return StaticallyOverridden(x=obj["x"] * 10)


def test_a_model_validate_of_no_bound_method_can_still_be_registered() -> None:
    # Registering read model_validate.__func__, which a staticmethod (or any plain
    # function) has none of: register_type raised AttributeError on a class it took before.
    codec.register_type(StaticallyOverridden)
    assert codec.loads(codec.dumps(StaticallyOverridden(x=2))) == StaticallyOverridden(x=20)


def test_stored_fields_a_registered_model_refuses_are_still_malformed() -> None:
    raw = codec.dumps(Usage(input_tokens=3, output_tokens=8)).replace(b"8", b'"many"')
    with pytest.raises(codec.UnknownTagError, match="refused the stored fields"):
        codec.loads(raw)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text(max_size=4) | st.just("$t")
    return st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(max_size=6)
    | st.sampled_from(["\udce9", "\ud83d\ude00", "$t"]),
    _containers,
    max_leaves=10,
)


def _name(turn: int, slot: int, name: str, arguments: Any) -> str:
    """A tool step's name as releases before the shared print computed it."""
    digest = hashlib.sha256(codec.canonical_bytes([name, arguments])).hexdigest()
    return f"tool_call_{turn}_{slot}_{digest[:16]}"


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=8), st.dictionaries(st.text(max_size=4), json_values))
def test_a_tool_steps_name_and_fingerprint_are_those_of_its_plain_arguments(
    name: str, arguments: dict[str, Any]
) -> None:
    call = ToolCall.model_construct(id="c", name=name, arguments=arguments)
    step, printed = tool_step(3, 1, call)
    assert step == _name(3, 1, name, arguments) == tool_step_name(3, 1, call)
    assert printed == arguments
    assert fingerprint((name, printed), {}) == fingerprint((name, arguments), {})
    assert codec.dumps(printed) == codec.dumps(arguments)  # stored as the dict it is


def test_arguments_nested_to_the_limit_keep_their_name_and_refusal() -> None:
    deep: Any = {}
    for _ in range(codec.MAX_DEPTH - 2):
        deep = {"d": deep}
    call = ToolCall.model_construct(id="c", name="t", arguments=deep)
    # Their name is hashed one list shallower than their fingerprint: it has one, the
    # fingerprint is refused, as before the print was shared.
    step, printed = tool_step(0, 0, call)
    assert step == _name(0, 0, "t", deep)
    assert printed is deep
    with pytest.raises(codec.NestingTooDeepError):
        fingerprint(("t", printed), {})
