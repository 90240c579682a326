"""AnthropicModel against a local server speaking the Messages API wire format."""

from __future__ import annotations

import json
import re
import traceback

import anthropic
import pytest

from loomflow.errors import InvalidArgumentError, ModelError, ModelRetryExhaustedError
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
from loomflow.models import AnthropicModel, Backoff, Model, _sdk, complete
from loomflow.models._retry import error_class
from loomflow.testing.providers import Failure, FakeAnthropicAPI, Reply

MODEL = "claude-opus-4-7"
WEATHER = ToolSpec(
    name="get_weather",
    description="Weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
CALL = ToolCall(id="toolu_01", name="get_weather", arguments={"city": "Paris", "days": 2})


def make(api: FakeAnthropicAPI, fast: Backoff, **options: object) -> AnthropicModel:
    return AnthropicModel(
        MODEL,
        base_url=api.base_url,
        api_key="sk-test",
        backoff=fast,
        **options,  # type: ignore[arg-type]
    )


async def drain(model: AnthropicModel, messages: list[Message]) -> list[ModelChunk]:
    return [c async for c in model.stream(messages, tools=[WEATHER], settings=ModelSettings())]


async def test_text_streams_as_deltas_and_ends_with_the_response(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    anthropic_api.add(Reply(text=["Hel", "lo ", "world"], input_tokens=21, output_tokens=3))
    async with make(anthropic_api, fast) as model:
        chunks = await drain(model, [Message.user("hi")])
    assert chunks[:-1] == [TextDelta(text="Hel"), TextDelta(text="lo "), TextDelta(text="world")]
    assert chunks[-1] == ModelResponse(
        text="Hello world",
        usage=Usage(input_tokens=21, output_tokens=3),
        finish_reason="stop",
        model=MODEL,
    )
    assert anthropic_api.last_request.body["stream"] is True


async def test_tool_use_round_trip(anthropic_api: FakeAnthropicAPI, fast: Backoff) -> None:
    anthropic_api.add(Reply(text="Let me check.", tool_calls=[CALL]), Reply(text="Sunny."))
    async with make(anthropic_api, fast) as model:
        chunks = await drain(model, [Message.system("Be helpful."), Message.user("Paris?")])
        deltas = [c for c in chunks if isinstance(c, ToolCallDelta)]
        assert deltas[0] == ToolCallDelta(index=0, id="toolu_01", name="get_weather")
        assert "".join(d.arguments_delta for d in deltas) == '{"city": "Paris", "days": 2}'
        first = chunks[-1]
        assert isinstance(first, ModelResponse)
        assert first.tool_calls == [CALL]
        assert first.finish_reason == "tool_calls"

        transcript = [
            Message.system("Be helpful."),
            Message.user("Paris?"),
            first.to_message(),
            Message.tool_result("toolu_01", "sunny, 21C", name="get_weather"),
            Message.tool_result("toolu_02", "no such tool", is_error=True),
            Message.user("Thanks"),
        ]
        second = await complete(model, transcript, tools=[WEATHER])
    assert second.text == "Sunny."

    body = anthropic_api.last_request.body
    assert body["system"] == "Be helpful."
    assert body["tools"] == [
        {
            "name": "get_weather",
            "description": "Weather for a city",
            "input_schema": WEATHER.parameters,
        }
    ]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][1]["content"] == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": CALL.arguments},
    ]
    # Tool results and the next user text share one user turn, results first.
    assert body["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny, 21C"},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_02",
            "content": "no such tool",
            "is_error": True,
        },
        {"type": "text", "text": "Thanks"},
    ]


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
        ("pause_turn", "pause_turn"),
    ],
)
async def test_stop_reasons_map_to_finish_reasons(
    anthropic_api: FakeAnthropicAPI, fast: Backoff, stop_reason: str, finish_reason: str
) -> None:
    anthropic_api.add(Reply(text="x", stop_reason=stop_reason))
    async with make(anthropic_api, fast) as model:
        response = await complete(model, [Message.user("hi")])
    assert response.finish_reason == finish_reason


async def test_settings_reach_the_request(anthropic_api: FakeAnthropicAPI, fast: Backoff) -> None:
    anthropic_api.add(Reply(text="ok"))
    async with make(anthropic_api, fast) as model:
        await complete(
            model, [Message.user("hi")], settings=ModelSettings(max_tokens=77, temperature=0.3)
        )
    body = anthropic_api.last_request.body
    assert (body["model"], body["max_tokens"], body["temperature"]) == (MODEL, 77, 0.3)
    assert "tools" not in body


async def test_environment_base_url_and_key_are_honoured(
    anthropic_api: FakeAnthropicAPI, monkeypatch: pytest.MonkeyPatch, fast: Backoff
) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", anthropic_api.base_url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-from-env")
    anthropic_api.add(Reply(text="from env"))
    async with AnthropicModel(MODEL, backoff=fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "from env"
    headers = anthropic_api.last_request.headers
    assert "sk-from-env" in (headers.get("x-api-key", "") + headers.get("authorization", ""))


async def test_a_ready_client_is_used_and_left_open(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    client = anthropic.AsyncAnthropic(base_url=anthropic_api.base_url, api_key="sk-own")
    anthropic_api.add(Failure(503), Reply(text="one"), Reply(text="two"))
    model = AnthropicModel(MODEL, client=client, backoff=fast)
    assert (await complete(model, [Message.user("hi")])).text == "one"
    await model.aclose()
    assert not client.is_closed()
    # Only our retry ran: the SDK's own retries are off on the adapter's copy.
    assert anthropic_api.request_count == 2
    assert (await complete(model, [Message.user("again")])).text == "two"
    await client.close()


@pytest.mark.parametrize("status", [529, 503, 500, 429])
async def test_transient_statuses_are_retried_until_success(
    anthropic_api: FakeAnthropicAPI, fast: Backoff, status: int
) -> None:
    anthropic_api.add(Failure(status), Failure(status), Reply(text="finally"))
    async with make(anthropic_api, fast) as model:
        response = await complete(model, [Message.user("hi")])
    assert response.text == "finally"
    assert anthropic_api.request_count == 3
    assert all(r.headers["x-stainless-retry-count"] == "0" for r in anthropic_api.requests)


async def test_an_overloaded_error_event_before_output_is_retried(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    anthropic_api.add(Failure(529, "Overloaded", in_stream=True), Reply(text="ok"))
    async with make(anthropic_api, fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "ok"
    assert anthropic_api.request_count == 2


async def test_retries_exhausted_raise_a_typed_error(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    anthropic_api.add(*[Failure(529, "Overloaded")] * 3)
    async with make(anthropic_api, fast, max_retries=2) as model:
        with pytest.raises(ModelRetryExhaustedError) as info:
            await complete(model, [Message.user("hi")])
    error = info.value
    assert (error.provider, error.model, error.status, error.attempts) == (
        "anthropic",
        MODEL,
        529,
        3,
    )
    assert "overloaded_error: Overloaded" in str(error)
    assert isinstance(error.__cause__, anthropic.APIStatusError)
    assert anthropic_api.request_count == 3


async def test_a_bad_request_fails_at_once(anthropic_api: FakeAnthropicAPI, fast: Backoff) -> None:
    anthropic_api.add(Failure(400, "messages: field required"), Reply(text="unused"))
    async with make(anthropic_api, fast) as model:
        with pytest.raises(ModelError) as info:
            await complete(model, [Message.user("hi")])
    assert not isinstance(info.value, ModelRetryExhaustedError)
    assert info.value.status == 400
    assert "invalid_request_error: messages: field required" in str(info.value)
    assert anthropic_api.request_count == 1


async def test_no_retry_once_output_has_been_yielded(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # message_start, ping, content_block_start, one text delta; then the connection drops.
    anthropic_api.add(Reply(text=["partial ", "answer"], cut_after=4), Reply(text="unused"))
    seen: list[ModelChunk] = []
    async with make(anthropic_api, fast) as model:
        with pytest.raises(ModelError) as info:
            async for chunk in model.stream(
                [Message.user("hi")], tools=[], settings=ModelSettings()
            ):
                seen.append(chunk)
    assert seen == [TextDelta(text="partial ")]
    assert "not retried" in str(info.value)
    assert not isinstance(info.value, ModelRetryExhaustedError)
    assert anthropic_api.request_count == 1


async def test_a_drop_before_any_output_is_retried(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    anthropic_api.add(Reply(text="lost", cut_after=2), Reply(text="whole"))
    async with make(anthropic_api, fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "whole"
    assert anthropic_api.request_count == 2


async def test_a_stream_that_ends_without_message_stop_is_incomplete(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # Bodies complete as HTTP but missing message_stop: with no text out yet it is retried;
    # the last one is exhausted.
    anthropic_api.add(*[Reply(text="x", end_after=2)] * 2)
    async with make(anthropic_api, fast, max_retries=1) as model:
        with pytest.raises(ModelRetryExhaustedError, match="before message_stop"):
            await complete(model, [Message.user("hi")])
    assert anthropic_api.request_count == 2


async def test_connection_refused_is_retried_then_typed(fast: Backoff) -> None:
    with FakeAnthropicAPI() as api:
        url = api.base_url  # a port that was just free and is now closed
    async with AnthropicModel(
        MODEL, base_url=url, api_key="k", max_retries=1, backoff=fast
    ) as model:
        with pytest.raises(ModelRetryExhaustedError) as info:
            await complete(model, [Message.user("hi")])
    assert info.value.status is None
    assert info.value.attempts == 2


async def test_adapter_satisfies_the_protocol(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    async with make(anthropic_api, fast) as model:
        assert isinstance(model, Model)
        assert (model.provider, model.name) == ("anthropic", MODEL)


async def test_malformed_tool_arguments_are_a_model_error(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    anthropic_api.add(Reply(tool_calls=[CALL], raw_arguments=['{"city": "Par']))
    async with make(anthropic_api, fast) as model:
        with pytest.raises(ModelError, match="not a JSON object") as info:
            await complete(model, [Message.user("hi")])
    assert not isinstance(info.value, ModelRetryExhaustedError)
    assert anthropic_api.request_count == 1


# -- streams the Messages API never sends ---------------------------------------------------


def _event(kind: str, data: dict[str, object]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def _start(usage: dict[str, object] | None = None) -> bytes:
    message = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1} if usage is None else usage,
    }  # fmt: skip
    return _event("message_start", {"message": message})


def _block(index: int, block: dict[str, object]) -> bytes:
    return _event("content_block_start", {"index": index, "content_block": block})


def _delta(index: int, delta: dict[str, object]) -> bytes:
    return _event("content_block_delta", {"index": index, "delta": delta})


def _end(stop_reason: object = "end_turn", blocks: int = 1) -> list[bytes]:
    return [
        *(_event("content_block_stop", {"index": i}) for i in range(blocks)),
        _event(
            "message_delta",
            {
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": 3},
            },
        ),
        _event("message_stop", {}),
    ]


TEXT = {"type": "text", "text": ""}


def _tool_use(input: object = None, id: object = "toolu_1") -> dict[str, object]:
    return {"type": "tool_use", "id": id, "name": "get_weather", "input": input or {}}


# The SDK itself warns, copying the block, that its input is not the object it expects.
@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
@pytest.mark.parametrize("tool_input", [[1, 2, 3], "only-tmp", 7], ids=["list", "string", "number"])
async def test_a_tool_input_that_is_not_an_object_is_a_model_error(
    anthropic_api: FakeAnthropicAPI, fast: Backoff, tool_input: object
) -> None:
    # The whole input in the start event, no input_json deltas. It once ran the tool with {}
    # (its defaults), arguments the model never sent; streamed as text it was already refused.
    body = [_start(), _block(0, _tool_use(tool_input)), *_end("tool_use")]
    anthropic_api.add(Reply(raw_stream=body))
    async with make(anthropic_api, fast) as model:
        with pytest.raises(ModelError, match="came with arguments that are not a JSON object"):
            await drain(model, [Message.user("hi")])
    assert anthropic_api.request_count == 1


async def test_a_tool_input_object_in_the_start_event_is_used(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    body = [_start(), _block(0, _tool_use({"city": "Oslo"})), *_end("tool_use")]
    anthropic_api.add(Reply(raw_stream=body))
    async with make(anthropic_api, fast) as model:
        response = (await drain(model, [Message.user("hi")]))[-1]
    assert isinstance(response, ModelResponse)
    assert response.tool_calls == [
        ToolCall(id="toolu_1", name="get_weather", arguments={"city": "Oslo"})
    ]


MALFORMED_STREAMS = {
    # Each: (the body, what the error says).
    "delta before its block": (
        [_start(), _delta(0, {"type": "text_delta", "text": "x"}), *_end()[1:]],
        r"IndexError",
    ),
    "no message_start": ([_block(0, TEXT), *_end()], "AssertionError"),
    "invalid input_json_delta": (
        [
            _start(),
            _block(0, _tool_use()),
            _delta(0, {"type": "input_json_delta", "partial_json": '{"a":2,]'}),
            *_end("tool_use"),
        ],
        "Unable to parse tool parameter JSON",
    ),
    "body not UTF-8": (
        [
            _start(),
            _block(0, TEXT),
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"a\xffb"}}\n\n',
            *_end(),
        ],
        "UnicodeDecodeError",
    ),
    "stop_reason a number": (
        [_start(), _block(0, TEXT), _delta(0, {"type": "text_delta", "text": "ok"}), *_end(5)],
        "stop_reason is 5, not a string",
    ),
    "tool_use id null": (
        [_start(), _block(0, _tool_use(id=None)), *_end("tool_use")],
        r"content_block\.id is missing or null, not a string",
    ),
    "text a number": (
        [_start(), _block(0, TEXT), _delta(0, {"type": "text_delta", "text": 42}), *_end()],
        "TypeError",
    ),
    "negative block index": (
        [_start(), _block(-1, _tool_use()), *_end("tool_use")],
        r"content_block_start\.index is -1",
    ),
    "input_json_delta for a text block": (
        [
            _start(),
            _block(0, TEXT),
            _delta(0, {"type": "input_json_delta", "partial_json": "{}"}),
            *_end(),
        ],
        "content block 0, which is not a tool_use block",
    ),
    "a block started twice": (
        # The second start reset the call's arguments: one tool call came out twice, once
        # with {} although the model never sent empty arguments.
        [
            _start(),
            _block(0, _tool_use()),
            _delta(0, {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}),
            _block(0, _tool_use()),
            _delta(0, {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}),
            *_end("tool_use"),
        ],
        "content block 0 started twice",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED_STREAMS))
async def test_a_malformed_stream_is_a_model_error_and_not_retried(
    anthropic_api: FakeAnthropicAPI, fast: Backoff, case: str
) -> None:
    # These escaped as IndexError, AssertionError, ValueError, UnicodeDecodeError (from the
    # SDK) or pydantic's ValidationError (building loomflow objects) instead of a ModelError.
    body, says = MALFORMED_STREAMS[case]
    anthropic_api.add(Reply(raw_stream=body), Reply(text="unused"))
    async with make(anthropic_api, fast, max_retries=2) as model:
        with pytest.raises(ModelError, match="malformed response stream") as info:
            await drain(model, [Message.user("hi")])
    error = info.value
    assert type(error) is ModelError  # not retried, so not ModelRetryExhaustedError
    assert (error.provider, error.model, error.status) == ("anthropic", MODEL, None)
    assert re.search(says, str(error)), str(error)
    assert anthropic_api.request_count == 1


async def test_a_bug_in_the_adapter_is_not_taken_for_a_malformed_stream(
    anthropic_api: FakeAnthropicAPI, fast: Backoff, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only what the SDK raises while reading the stream is translated: loomflow's own code
    # raising a TypeError is a bug, and surfaces as one.
    def broken(*args: object, **kwargs: object) -> ModelResponse:
        raise TypeError("a bug")

    monkeypatch.setattr(AnthropicModel, "_response", broken)
    anthropic_api.add(Reply(text="fine"))
    async with make(anthropic_api, fast) as model:
        with pytest.raises(TypeError, match="a bug"):
            await drain(model, [Message.user("hi")])


async def test_a_stream_without_usage_is_marked_unreported(
    anthropic_api: FakeAnthropicAPI,
    fast: Backoff,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_sdk, "_unreported", set())  # warned once per model and process
    anthropic_api.add(Reply(text="hi", report_usage=False), Reply(text="hi", report_usage=False))
    anthropic_api.add(Reply(text="hi"))
    # Input figures only are missing: the call's cost is still unknown.
    anthropic_api.add(Reply(raw_stream=[_start({"output_tokens": 1}), _block(0, TEXT), *_end()]))
    async with AnthropicModel(
        "claude-sonnet-4-5", base_url=anthropic_api.base_url, api_key="k", backoff=fast
    ) as model:
        with caplog.at_level("WARNING", logger="loomflow.models"):
            first = await complete(model, [Message.user("hi")])
            second = await complete(model, [Message.user("hi")])
        reported = await complete(model, [Message.user("hi")])
        no_input = await complete(model, [Message.user("hi")])
    assert (first.usage_reported, first.usage) == (False, Usage())
    assert second.usage_reported is False
    assert reported.usage_reported is True
    assert (no_input.usage_reported, no_input.usage.output_tokens) == (False, 3)
    warned = [r for r in caplog.records if "without reporting its token usage" in r.message]
    assert len(warned) == 1  # once per model
    assert "claude-sonnet-4-5" in warned[0].message


async def test_a_drop_after_message_stop_keeps_the_whole_answer(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # The connection reset after message_stop, before the body's own end (a proxy closing
    # early): the answer was whole and billed, yet the call failed, and a resume paid for it
    # again. One event earlier, the answer is cut and the call still fails.
    body = [_start(), _block(0, TEXT), _delta(0, {"type": "text_delta", "text": "all here"})]
    body += _end()
    anthropic_api.add(Reply(raw_stream=[*body, b": more\n\n"], cut_after=len(body)))
    anthropic_api.add(Reply(raw_stream=body, cut_after=len(body) - 1), Reply(text="unused"))
    async with make(anthropic_api, fast) as model:
        response = await complete(model, [Message.user("hi")])
        assert (response.text, response.finish_reason) == ("all here", "stop")
        assert response.usage == Usage(input_tokens=10, output_tokens=3)
        assert anthropic_api.request_count == 1
        with pytest.raises(ModelError, match="not retried"):
            await complete(model, [Message.user("hi")])
    assert anthropic_api.request_count == 2


async def test_an_in_stream_error_with_a_status_code_is_retried_as_that_status(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # A gateway in front of the Messages API that reports a rate limit by its status code in
    # the error event: it failed at once, where the same 429 as HTTP status is retried.
    event = b'event: error\ndata: {"type":"error","error":{"code":"429","message":"slow down"}}\n\n'
    anthropic_api.add(Reply(raw_stream=[event]), Reply(text="ok"))
    async with make(anthropic_api, fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "ok"
    assert anthropic_api.request_count == 2


async def test_a_blank_text_beside_tool_calls_is_not_sent_back(
    anthropic_api: FakeAnthropicAPI, fast: Backoff
) -> None:
    # Claude may write only "\n\n" before its tool calls. Sent back as a text block, the next
    # request was refused (400: text content blocks must contain non-whitespace text), and so
    # was every later one of the run.
    anthropic_api.add(Reply(text="\n\n", tool_calls=[CALL]), Reply(text="Sunny."))
    async with make(anthropic_api, fast) as model:
        first = await complete(model, [Message.user("Paris?")], tools=[WEATHER])
        assert first.text == "\n\n"
        transcript = [
            Message.user("Paris?"),
            first.to_message(),
            Message.tool_result("toolu_01", "sunny", name="get_weather"),
        ]
        assert (await complete(model, transcript, tools=[WEATHER])).text == "Sunny."
    assert anthropic_api.last_request.body["messages"][1]["content"] == [
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": CALL.arguments}
    ]


@pytest.mark.parametrize("credential", ["api_key", "auth_token"])
async def test_an_error_that_echoes_the_credential_does_not_repeat_it(
    anthropic_api: FakeAnthropicAPI, fast: Backoff, credential: str
) -> None:
    # Some gateways quote the key they refused; the error goes to logs and the audit trail.
    key = "sk-ant-0123456789abcdef"
    anthropic_api.add(Failure(401, f"invalid x-api-key {key}"))
    client = anthropic.AsyncAnthropic(base_url=anthropic_api.base_url, **{credential: key})
    async with client, AnthropicModel(MODEL, client=client, backoff=fast) as model:
        with pytest.raises(ModelError) as info:
            await complete(model, [Message.user("hi")])
    assert key not in str(info.value)
    assert key not in info.value.detail
    assert "invalid x-api-key [api key]" in info.value.detail
    assert key not in "".join(traceback.format_exception(info.value))  # nor chained in


def test_a_timeout_that_cannot_work_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="timeout"):
        AnthropicModel(MODEL, base_url="http://127.0.0.1:9", api_key="k", timeout=-1)


@pytest.mark.parametrize(
    ("kind", "status"),
    [
        ("invalid_request_error", 400),
        ("authentication_error", 401),
        ("permission_error", 403),
        ("not_found_error", 404),
        ("request_too_large", 413),
    ],
)
async def test_an_in_stream_request_error_is_a_client_error_not_a_lost_connection(
    anthropic_api: FakeAnthropicAPI, fast: Backoff, kind: str, status: int
) -> None:
    # It carried no status, so the error metric counted it as a lost connection.
    anthropic_api.add(Failure(200, "prompt is too long", error_type=kind, in_stream=True))
    async with make(anthropic_api, fast) as model:
        with pytest.raises(ModelError, match="prompt is too long") as info:
            await complete(model, [Message.user("hi")])
    assert type(info.value) is ModelError
    assert info.value.status == status
    assert error_class(info.value.status, info.value) == "client"
    assert anthropic_api.request_count == 1
