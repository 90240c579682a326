"""Work a replayed turn no longer does, counted, and the answers it gives kept as they were.

A replayed agent turn decodes its stored model call and tool outcome (validated: the rows are
untrusted) and fingerprints its inputs. Counted in Python calls (not timed: the machine is
shared), with the count before the change beside each bound.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from pydantic import BaseModel

from loomflow.messages import ModelResponse, TextDelta, ToolCall, Usage
from loomflow.runtime import codec


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


def test_stored_fields_a_registered_model_refuses_are_still_malformed() -> None:
    raw = codec.dumps(Usage(input_tokens=3, output_tokens=8)).replace(b"8", b'"many"')
    with pytest.raises(codec.UnknownTagError, match="refused the stored fields"):
        codec.loads(raw)
