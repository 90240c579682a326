"""The provider-neutral message types: validation, helpers and journal round trips."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from loomflow.messages import (
    Message,
    ModelChunk,
    ModelResponse,
    ModelSettings,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from loomflow.runtime import codec

CALL = ToolCall(id="call_1", name="lookup", arguments={"q": "tea", "n": 2, "opts": {"x": [1]}})

SAMPLES: list[Any] = [
    CALL,
    Usage(input_tokens=3, output_tokens=4),
    Message.system("be brief"),
    Message.user("hi"),
    Message.assistant("sure", [CALL]),
    Message.tool_result("call_1", "boom", name="lookup", is_error=True),
    ToolSpec(name="lookup", description="find", parameters={"type": "object"}),
    ModelSettings(max_tokens=10, temperature=0.2),
    TextDelta(text="he"),
    ToolCallDelta(index=0, id="call_1", name="lookup", arguments_delta='{"q"'),
    ModelResponse(
        text="done",
        tool_calls=[CALL],
        usage=Usage(input_tokens=1, output_tokens=2),
        finish_reason="tool_calls",
        model="m",
    ),
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_every_message_type_round_trips_through_the_codec(value: Any) -> None:
    restored = codec.loads(codec.dumps(value))
    assert restored == value
    assert type(restored) is type(value)


def test_a_whole_stream_round_trips_in_order() -> None:
    chunks: list[ModelChunk] = [
        TextDelta(text="a"),
        ToolCallDelta(index=0, id="c", name="t"),
        ModelResponse(text="a"),
    ]
    assert codec.loads(codec.dumps(chunks)) == chunks


def test_fingerprint_bytes_are_stable_for_equal_inputs() -> None:
    one = [Message.user("hi"), Message.assistant("", [CALL])]
    two = [Message.user("hi"), Message.assistant("", [CALL.model_copy()])]
    assert codec.canonical_bytes(one) == codec.canonical_bytes(two)


def test_usage_adds_up() -> None:
    total = Usage(input_tokens=1, output_tokens=2) + Usage(input_tokens=10, output_tokens=20)
    assert total == Usage(input_tokens=11, output_tokens=22)
    assert total.total_tokens == 33
    assert sum([Usage(input_tokens=1), Usage(output_tokens=1)]) == Usage(
        input_tokens=1, output_tokens=1
    )


def test_helpers_build_the_right_roles() -> None:
    assert Message.system("s").role == "system"
    assert Message.user("u").role == "user"
    reply = Message.assistant(tool_calls=[CALL])
    assert (reply.role, reply.content, reply.tool_calls) == ("assistant", "", [CALL])
    result = Message.tool_result("call_1", "42", name="lookup")
    assert (result.role, result.tool_call_id, result.is_error) == ("tool", "call_1", False)


def test_response_becomes_an_assistant_message() -> None:
    response = ModelResponse(text="t", tool_calls=[CALL])
    assert response.to_message() == Message.assistant("t", [CALL])


@pytest.mark.parametrize(
    "fields",
    [
        {"role": "user", "tool_calls": [CALL]},
        {"role": "tool", "content": "x"},
        {"role": "user", "tool_call_id": "c"},
        {"role": "assistant", "is_error": True},
        {"role": "robot"},
    ],
)
def test_inconsistent_messages_are_rejected(fields: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        Message(**fields)


def test_values_are_frozen() -> None:
    message = Message.user("hi")
    with pytest.raises(pydantic.ValidationError):
        message.content = "changed"


def test_settings_are_checked() -> None:
    with pytest.raises(pydantic.ValidationError):
        ModelSettings(max_tokens=0)
    with pytest.raises(pydantic.ValidationError):
        ModelSettings(temperature=3.0)
