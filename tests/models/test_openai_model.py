"""OpenAIModel against a local server speaking the Chat Completions wire format."""

from __future__ import annotations

import json
import re
import traceback

import openai
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
from loomflow.models import Backoff, Model, OpenAIModel, _sdk, complete
from loomflow.models._retry import error_class
from loomflow.testing.providers import Failure, FakeOpenAIAPI, Reply

MODEL = "gpt-4.1"
WEATHER = ToolSpec(
    name="get_weather",
    description="Weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
CALL = ToolCall(id="call_01", name="get_weather", arguments={"city": "Paris"})
CALL2 = ToolCall(id="call_02", name="get_weather", arguments={"city": "Rome", "days": 3})


def make(api: FakeOpenAIAPI, fast: Backoff, max_retries: int = 3) -> OpenAIModel:
    return OpenAIModel(
        MODEL, base_url=api.base_url, api_key="sk-test", backoff=fast, max_retries=max_retries
    )


async def drain(model: OpenAIModel, messages: list[Message]) -> list[ModelChunk]:
    return [c async for c in model.stream(messages, tools=[WEATHER], settings=ModelSettings())]


async def test_text_streams_as_deltas_and_ends_with_the_response(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    openai_api.add(Reply(text=["Hel", "lo ", "world"], input_tokens=30, output_tokens=4))
    async with make(openai_api, fast) as model:
        chunks = await drain(model, [Message.user("hi")])
    assert chunks[:-1] == [TextDelta(text="Hel"), TextDelta(text="lo "), TextDelta(text="world")]
    assert chunks[-1] == ModelResponse(
        text="Hello world",
        usage=Usage(input_tokens=30, output_tokens=4),
        finish_reason="stop",
        model=MODEL,
    )
    body = openai_api.last_request.body
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


async def test_tool_use_round_trip(openai_api: FakeOpenAIAPI, fast: Backoff) -> None:
    openai_api.add(Reply(tool_calls=[CALL, CALL2]), Reply(text="Sunny in both."))
    async with make(openai_api, fast) as model:
        chunks = await drain(model, [Message.system("Be helpful."), Message.user("Weather?")])
        deltas = [c for c in chunks if isinstance(c, ToolCallDelta)]
        assert deltas[0] == ToolCallDelta(index=0, id="call_01", name="get_weather")
        second_args = "".join(d.arguments_delta for d in deltas if d.index == 1)
        assert json.loads(second_args) == CALL2.arguments
        first = chunks[-1]
        assert isinstance(first, ModelResponse)
        assert first.tool_calls == [CALL, CALL2]
        assert first.finish_reason == "tool_calls"

        transcript = [
            Message.system("Be helpful."),
            Message.user("Weather?"),
            first.to_message(),
            Message.tool_result("call_01", "sunny", name="get_weather"),
            Message.tool_result("call_02", "sunny too", name="get_weather"),
        ]
        second = await complete(model, transcript, tools=[WEATHER])
    assert second.text == "Sunny in both."

    body = openai_api.last_request.body
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": WEATHER.parameters,
            },
        }
    ]
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[2]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in messages[2]["tool_calls"]] == [
        CALL.arguments,
        CALL2.arguments,
    ]
    assert messages[3] == {"role": "tool", "tool_call_id": "call_01", "content": "sunny"}


@pytest.mark.parametrize(
    ("native", "finish_reason"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("tool_calls", "tool_calls"),
        ("function_call", "tool_calls"),
        ("content_filter", "content_filter"),
    ],
)
async def test_finish_reasons_map(
    openai_api: FakeOpenAIAPI, fast: Backoff, native: str, finish_reason: str
) -> None:
    openai_api.add(Reply(text="x", stop_reason=native))
    async with make(openai_api, fast) as model:
        assert (await complete(model, [Message.user("hi")])).finish_reason == finish_reason


async def test_settings_reach_the_request(openai_api: FakeOpenAIAPI, fast: Backoff) -> None:
    openai_api.add(Reply(text="ok"))
    settings = ModelSettings(max_tokens=55, temperature=0.7)
    async with make(openai_api, fast) as model:
        await complete(model, [Message.user("hi")], settings=settings)
    body = openai_api.last_request.body
    assert (body["model"], body["max_completion_tokens"], body["temperature"]) == (MODEL, 55, 0.7)
    assert "tools" not in body


async def test_environment_base_url_and_key_are_honoured(
    openai_api: FakeOpenAIAPI, monkeypatch: pytest.MonkeyPatch, fast: Backoff
) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", openai_api.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    openai_api.add(Reply(text="from env"))
    async with OpenAIModel(MODEL, backoff=fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "from env"
    assert openai_api.last_request.headers["authorization"] == "Bearer sk-from-env"


async def test_a_ready_client_is_used_and_left_open(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    client = openai.AsyncOpenAI(base_url=openai_api.base_url, api_key="sk-own")
    openai_api.add(Failure(502), Reply(text="one"))
    model = OpenAIModel(MODEL, client=client, backoff=fast)
    assert (await complete(model, [Message.user("hi")])).text == "one"
    await model.aclose()
    assert not client.is_closed()
    assert openai_api.request_count == 2
    await client.close()


@pytest.mark.parametrize("status", [503, 500, 429])
async def test_transient_statuses_are_retried_until_success(
    openai_api: FakeOpenAIAPI, fast: Backoff, status: int
) -> None:
    openai_api.add(Failure(status), Failure(status), Reply(text="finally"))
    async with make(openai_api, fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "finally"
    assert openai_api.request_count == 3


async def test_a_server_error_event_before_output_is_retried(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    openai_api.add(Failure(500, "The server had an error", in_stream=True), Reply(text="ok"))
    async with make(openai_api, fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "ok"
    assert openai_api.request_count == 2


async def test_retries_exhausted_raise_a_typed_error(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    openai_api.add(*[Failure(503, "Service unavailable")] * 2)
    async with make(openai_api, fast, max_retries=1) as model:
        with pytest.raises(ModelRetryExhaustedError) as info:
            await complete(model, [Message.user("hi")])
    error = info.value
    assert (error.provider, error.model, error.status, error.attempts) == ("openai", MODEL, 503, 2)
    assert "Service unavailable" in str(error)
    assert isinstance(error.__cause__, openai.APIStatusError)


async def test_a_bad_request_fails_at_once(openai_api: FakeOpenAIAPI, fast: Backoff) -> None:
    openai_api.add(Failure(400, "Unknown parameter"), Reply(text="unused"))
    async with make(openai_api, fast) as model:
        with pytest.raises(ModelError) as info:
            await complete(model, [Message.user("hi")])
    assert not isinstance(info.value, ModelRetryExhaustedError)
    assert (info.value.provider, info.value.status) == ("openai", 400)
    assert "Unknown parameter" in str(info.value)
    assert openai_api.request_count == 1


async def test_no_retry_once_output_has_been_yielded(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # The role chunk, then one content chunk; then the connection drops.
    openai_api.add(Reply(text=["partial ", "answer"], cut_after=2), Reply(text="unused"))
    seen: list[ModelChunk] = []
    async with make(openai_api, fast) as model:
        with pytest.raises(ModelError) as info:
            async for chunk in model.stream(
                [Message.user("hi")], tools=[], settings=ModelSettings()
            ):
                seen.append(chunk)
    assert seen == [TextDelta(text="partial ")]
    assert "not retried" in str(info.value)
    assert openai_api.request_count == 1


async def test_a_drop_before_any_output_is_retried(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # Only the role chunk (no content) got through before the connection dropped.
    openai_api.add(Reply(text="lost", cut_after=1), Reply(text="ok"))
    async with make(openai_api, fast) as model:
        assert (await complete(model, [Message.user("hi")])).text == "ok"
    assert openai_api.request_count == 2


async def test_a_stream_that_ends_without_a_finish_reason_is_incomplete(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # A body complete as HTTP but lacking the finish chunk: retried while nothing was yielded,
    # an error once text was.
    openai_api.add(Reply(text="x", end_after=1), Reply(text=["a ", "b"], end_after=2))
    async with make(openai_api, fast, max_retries=1) as model:
        with pytest.raises(ModelError, match=r"without a finish_reason.*not retried"):
            await complete(model, [Message.user("hi")])
    assert openai_api.request_count == 2


async def test_malformed_tool_arguments_are_a_model_error(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    openai_api.add(Reply(tool_calls=[CALL], raw_arguments=['{"city": "Par']))
    async with make(openai_api, fast) as model:
        with pytest.raises(ModelError, match="not a JSON object") as info:
            await complete(model, [Message.user("hi")])
    assert not isinstance(info.value, ModelRetryExhaustedError)
    assert openai_api.request_count == 1


async def test_adapter_satisfies_the_protocol(openai_api: FakeOpenAIAPI, fast: Backoff) -> None:
    async with make(openai_api, fast) as model:
        assert isinstance(model, Model)
        assert (model.provider, model.name) == ("openai", MODEL)


# -- streams Chat Completions never sends ---------------------------------------------------


def _chunk(fields: str) -> bytes:
    """One data line; ``fields`` is raw JSON text, so it can hold what json.dumps would not."""
    head = '"id":"c1","object":"chat.completion.chunk","created":1,"model":"gpt-4.1"'
    return f"data: {{{head},{fields}}}\n\n".encode()


DONE = b"data: [DONE]\n\n"
STOP = _chunk('"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]')
USAGE = '"usage":{"prompt_tokens":5,"completion_tokens":1}'


def _tool_piece(piece: str) -> bytes:
    return _chunk(
        f'"choices":[{{"index":0,"delta":{{"tool_calls":[{piece}]}},"finish_reason":"tool_calls"}}]'
    )


MALFORMED_STREAMS = {
    # Each: (the body, what the error says).
    "choices null": ([_chunk('"choices":null'), STOP, DONE], "choices is missing or null"),
    "usage a number": (
        [
            _chunk('"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]'),
            _chunk('"choices":[],"usage":12'),
            DONE,
        ],
        "usage is 12, not an object",
    ),
    "arguments an object": (
        [
            _tool_piece(
                '{"index":0,"id":"c","type":"function",'
                '"function":{"name":"get_weather","arguments":{"city":"Oslo"}}}'
            ),
            DONE,
        ],
        r"tool_calls\[0\]\.function\.arguments is \{'city': 'Oslo'\}, not a string",
    ),
    "tool call index -1": (
        [
            _tool_piece(
                '{"index":-1,"id":"c","type":"function",'
                '"function":{"name":"get_weather","arguments":"{}"}}'
            ),
            DONE,
        ],
        r"tool_calls\[0\]\.index is -1, not an index",
    ),
    "content a number": (
        [_chunk('"choices":[{"index":0,"delta":{"content":42},"finish_reason":"stop"}]'), DONE],
        r"choices\[0\]\.delta\.content is 42, not a string",
    ),
    "body not UTF-8": (
        [
            _chunk('"choices":[{"index":0,"delta":{"content":"a').rstrip(b"}\n")
            + b'\xffb"},"finish_reason":"stop"}]}\n\n',
            DONE,
        ],
        "UnicodeDecodeError",
    ),
    "data not JSON": ([b"data: {not json\n\n", DONE], "JSONDecodeError"),
    "finish_reason a number": (
        [_chunk('"choices":[{"index":0,"delta":{},"finish_reason":3}]'), DONE],
        r"finish_reason is 3, not a string",
    ),
    "choice not an object": ([_chunk('"choices":["x"]'), DONE], r"choices\[0\] is 'x'"),
}


@pytest.mark.parametrize("case", list(MALFORMED_STREAMS))
async def test_a_malformed_stream_is_a_model_error_and_not_retried(
    openai_api: FakeOpenAIAPI, fast: Backoff, case: str
) -> None:
    # These escaped as TypeError, AttributeError, JSONDecodeError, UnicodeDecodeError or
    # pydantic's ValidationError (building ToolCallDelta/TextDelta) instead of a ModelError.
    body, says = MALFORMED_STREAMS[case]
    openai_api.add(Reply(raw_stream=body), Reply(text="unused"))
    async with make(openai_api, fast, max_retries=2) as model:
        with pytest.raises(ModelError, match="malformed response stream") as info:
            await drain(model, [Message.user("hi")])
    error = info.value
    assert type(error) is ModelError  # not retried, so not ModelRetryExhaustedError
    assert (error.provider, error.model, error.status) == ("openai", MODEL, None)
    assert re.search(says, str(error)), str(error)
    assert openai_api.request_count == 1


async def test_a_usage_chunk_without_choices_is_accepted(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # Some compatible servers send the usage-only chunk with "choices" null or left out.
    content = _chunk('"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]')
    openai_api.add(Reply(raw_stream=[content, _chunk(f'"choices":null,{USAGE}'), DONE]))
    openai_api.add(Reply(raw_stream=[content, _chunk(USAGE), DONE]))
    async with make(openai_api, fast) as model:
        for _ in range(2):
            response = await complete(model, [Message.user("hi")])
            assert response.text == "hi"
            assert response.usage == Usage(input_tokens=5, output_tokens=1)
            assert response.usage_reported


async def test_a_stream_without_usage_is_marked_unreported(
    openai_api: FakeOpenAIAPI,
    fast: Backoff,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_sdk, "_unreported", set())  # warned once per model and process
    # A compatible server that ignores stream_options.include_usage.
    openai_api.add(Reply(text="hi", report_usage=False), Reply(text="hi", report_usage=False))
    openai_api.add(Reply(text="hi"))
    async with OpenAIModel(
        "gpt-4.1-mini", base_url=openai_api.base_url, api_key="k", backoff=fast
    ) as model:
        with caplog.at_level("WARNING", logger="loomflow.models"):
            first = await complete(model, [Message.user("hi")])
            second = await complete(model, [Message.user("hi")])
        reported = await complete(model, [Message.user("hi")])
    assert openai_api.requests[0].body["stream_options"] == {"include_usage": True}
    assert (first.usage_reported, first.usage, first.text) == (False, Usage(), "hi")
    assert second.usage_reported is False
    assert (reported.usage_reported, reported.usage.input_tokens) == (True, 12)
    warned = [r for r in caplog.records if "without reporting its token usage" in r.message]
    assert len(warned) == 1  # once per model
    assert "include_usage" in warned[0].message


async def test_a_tool_name_repeated_in_every_piece_is_taken_once(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # Some compatible servers repeat the whole name in each piece of a call; it was joined
    # into "get_weatherget_weather", a tool that does not exist.
    pieces = ['{"city":', ' "Paris"}']
    body = [
        _chunk(
            '"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_01",'
            f'"type":"function","function":{{"name":"get_weather","arguments":{json.dumps(p)}}}'
            '}]},"finish_reason":null}]'
        )
        for p in pieces
    ]
    stop = _chunk('"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]')
    openai_api.add(Reply(raw_stream=[*body, stop, _chunk(USAGE), DONE]))
    async with make(openai_api, fast) as model:
        chunks = await drain(model, [Message.user("weather?")])
    response = chunks[-1]
    assert isinstance(response, ModelResponse)
    assert response.tool_calls == [CALL]
    names = [c.name for c in chunks if isinstance(c, ToolCallDelta)]
    assert names == ["get_weather", None]


async def test_tool_call_deltas_number_the_calls_of_the_response_from_0(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # A server's own numbering (7, then 3) is not the response's: a delta naming no call of
    # it escaped the agent's sealing of sensitive arguments.
    body = [
        _tool_piece(
            f'{{"index":{index},"id":"call_{index}","type":"function",'
            f'"function":{{"name":"get_weather","arguments":{json.dumps(json.dumps(arguments))}}}}}'
        )
        for index, arguments in ((7, {"city": "Oslo"}), (3, {"city": "Rome"}))
    ]
    openai_api.add(Reply(raw_stream=[*body, _chunk(USAGE), DONE]))
    async with make(openai_api, fast) as model:
        chunks = await drain(model, [Message.user("weather?")])
    response = chunks[-1]
    assert isinstance(response, ModelResponse)
    assert [(c.id, c.arguments["city"]) for c in response.tool_calls] == [
        ("call_7", "Oslo"),
        ("call_3", "Rome"),
    ]
    deltas = [(c.index, c.id) for c in chunks if isinstance(c, ToolCallDelta)]
    assert deltas == [(0, "call_7"), (1, "call_3")]


async def test_a_choice_without_an_index_is_the_answer(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # Only one candidate is requested. A server leaving out "index" had its answer dropped:
    # the stream then lacked a finish_reason and the (billed) call was sent four times.
    content = _chunk('"choices":[{"delta":{"content":"hi"},"finish_reason":null}]')
    stop = _chunk('"choices":[{"delta":{},"finish_reason":"stop"}]')
    openai_api.add(Reply(raw_stream=[content, stop, _chunk(USAGE), DONE]))
    async with make(openai_api, fast) as model:
        response = await complete(model, [Message.user("hi")])
    assert (response.text, response.finish_reason) == ("hi", "stop")
    assert openai_api.request_count == 1


async def test_a_drop_after_the_usage_chunk_keeps_the_whole_answer(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # The connection reset after the last chunk (the usage one), before "[DONE]": the answer
    # was whole and billed, yet the call failed, and a resume paid for it again. Cut before
    # the usage chunk, the call still fails: the cost is not known.
    content = _chunk('"choices":[{"index":0,"delta":{"content":"all here"},"finish_reason":null}]')
    body = [content, STOP, _chunk(f'"choices":[],{USAGE}')]
    openai_api.add(Reply(raw_stream=[*body, DONE], cut_after=len(body)))
    openai_api.add(Reply(raw_stream=[*body, DONE], cut_after=len(body) - 1), Reply(text="x"))
    async with make(openai_api, fast) as model:
        response = await complete(model, [Message.user("hi")])
        assert (response.text, response.finish_reason) == ("all here", "stop")
        assert response.usage == Usage(input_tokens=5, output_tokens=1)
        assert response.usage_reported
        assert openai_api.request_count == 1
        with pytest.raises(ModelError, match="not retried"):
            await complete(model, [Message.user("hi")])
    assert openai_api.request_count == 2


async def test_a_lost_connection_says_how_it_was_lost(fast: Backoff) -> None:
    # The SDK's own message is "Connection error." for a refused connection and a stream cut
    # mid-answer alike; the error (and the audit trail and logs that carry it) said no more.
    with FakeOpenAIAPI(Reply(text=["partial ", "answer"], cut_after=2)) as api:
        async with make(api, fast) as model:
            with pytest.raises(ModelError, match="not retried") as cut:
                await complete(model, [Message.user("hi")])
        url = api.base_url  # a port that was just free and is now closed
    assert "peer closed connection" in str(cut.value)
    async with OpenAIModel(MODEL, base_url=url, api_key="k", max_retries=0) as model:
        with pytest.raises(ModelRetryExhaustedError) as refused:
            await complete(model, [Message.user("hi")])
    assert "ConnectError" in str(refused.value)


async def test_an_exhausted_quota_fails_at_once(openai_api: FakeOpenAIAPI, fast: Backoff) -> None:
    # A 429 with "insufficient_quota" is no rate limit: the account is out of credit until
    # someone pays, so retrying only delayed the error and counted retries that could not help.
    quota = "You exceeded your current quota, please check your plan and billing details."
    openai_api.add(Failure(429, quota, error_type="insufficient_quota"), Reply(text="unused"))
    async with make(openai_api, fast) as model:
        with pytest.raises(ModelError, match="insufficient_quota: You exceeded") as info:
            await complete(model, [Message.user("hi")])
    assert not isinstance(info.value, ModelRetryExhaustedError)
    assert info.value.status == 429
    assert openai_api.request_count == 1


async def test_a_tool_call_that_never_names_its_function_is_a_model_error(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # No "name" in any piece of the call: it became a call to the tool ''.
    body = [
        _tool_piece('{"index":0,"id":"call_9","type":"function","function":{"arguments":"{}"}}'),
        _chunk(f'"choices":[],{USAGE}'),
        DONE,
    ]
    openai_api.add(Reply(raw_stream=body), Reply(text="unused"))
    async with make(openai_api, fast) as model:
        with pytest.raises(ModelError, match="tool call call_9 came without a tool name") as info:
            await drain(model, [Message.user("hi")])
    assert type(info.value) is ModelError
    assert openai_api.request_count == 1


@pytest.mark.parametrize(
    ("error", "status"),
    [
        # Azure OpenAI: the code is the HTTP status, as a string, and there is no type.
        ('{"code":"429","message":"Rate limit is exceeded. Try again in 1 seconds."}', 429),
        # OpenAI's own rate-limit body: the type says which limit, the code what happened.
        ('{"type":"requests","code":"rate_limit_exceeded","message":"Rate limit reached"}', 429),
        ('{"type":null,"code":"503","message":"The engine is currently overloaded"}', 503),
    ],
    ids=["azure-429", "requests-rate-limit", "code-503"],
)
async def test_an_in_stream_rate_limit_or_overload_is_retried(
    openai_api: FakeOpenAIAPI, fast: Backoff, error: str, status: int
) -> None:
    # The same errors as an HTTP status are retried; inside a 200 stream they failed the call
    # at once (a code "429") or were retried as a lost connection (metrics said so too).
    body = [f'data: {{"error":{error}}}\n\n'.encode(), DONE]
    openai_api.add(Reply(raw_stream=body), Reply(text="ok"), *[Reply(raw_stream=body)] * 2)
    async with make(openai_api, fast, max_retries=1) as model:
        assert (await complete(model, [Message.user("hi")])).text == "ok"
        with pytest.raises(ModelRetryExhaustedError) as info:
            await complete(model, [Message.user("hi")])
    assert info.value.status == status
    assert openai_api.request_count == 4


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        ('{"type":"insufficient_quota","code":"429","message":"You exceeded"}', 429, "rate_limit"),
        # It carried no status, so the error metric counted it as a lost connection.
        ('{"type":"invalid_request_error","message":"You exceeded the context"}', 400, "client"),
    ],
)
async def test_an_in_stream_exhausted_quota_or_request_error_fails_at_once(
    openai_api: FakeOpenAIAPI, fast: Backoff, error: str, status: int, kind: str
) -> None:
    body = f'{{"error":{error}}}'
    openai_api.add(Reply(raw_stream=[f"data: {body}\n\n".encode(), DONE]), Reply(text="x"))
    async with make(openai_api, fast) as model:
        with pytest.raises(ModelError, match="You exceeded") as info:
            await complete(model, [Message.user("hi")])
    assert type(info.value) is ModelError
    assert info.value.status == status
    assert error_class(info.value.status, info.value) == kind
    assert openai_api.request_count == 1


async def test_tool_calls_without_an_index_are_told_apart_by_their_ids(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # Gemini's OpenAI-compatible endpoint leaves "index" out of each call: every tool call
    # failed as a malformed stream. A piece with a new id starts a call; one without
    # continues the call before it.
    def piece(fields: dict[str, object]) -> bytes:
        call = {"type": "function", **fields}
        delta = {"tool_calls": [call]}
        return _chunk(f'"choices":[{{"index":0,"delta":{json.dumps(delta)}}}]')

    body = [
        piece({"id": "fc-1", "function": {"name": "get_weather", "arguments": '{"city":'}}),
        piece({"function": {"arguments": ' "Paris"}'}}),
        piece({"id": "fc-2", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}),
        _chunk('"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]'),
        _chunk(f'"choices":[],{USAGE}'),
        DONE,
    ]
    openai_api.add(Reply(raw_stream=body))
    async with make(openai_api, fast) as model:
        chunks = await drain(model, [Message.user("weather?")])
    response = chunks[-1]
    assert isinstance(response, ModelResponse)
    assert [(c.id, c.arguments) for c in response.tool_calls] == [
        ("fc-1", {"city": "Paris"}),
        ("fc-2", {"city": "Rome"}),
    ]
    assert [c.index for c in chunks if isinstance(c, ToolCallDelta)] == [0, 0, 1]


async def test_tool_calls_without_an_index_or_an_id_to_one_tool_stay_apart(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # Two whole calls of one tool in one chunk, numbered by neither index nor id (an empty
    # id): each named piece is a call of its own, not the continuation of the one before (the
    # two calls' arguments were joined into one, which failed as malformed JSON).
    calls = [
        {"id": "", "type": "function", "function": {"name": "get_weather", "arguments": city}}
        for city in ('{"city": "Paris"}', '{"city": "Rome"}')
    ]
    delta = json.dumps({"tool_calls": calls})
    body = [
        _chunk(f'"choices":[{{"index":0,"delta":{delta},"finish_reason":"tool_calls"}}]'),
        _chunk(f'"choices":[],{USAGE}'),
        DONE,
    ]
    openai_api.add(Reply(raw_stream=body))
    async with make(openai_api, fast) as model:
        response = await complete(model, [Message.user("weather?")])
    assert [(c.name, c.arguments) for c in response.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]


async def test_an_in_stream_error_given_as_a_string_says_what_it_held(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # A proxy's {"error": "..."}: the error said only "An error occurred during streaming".
    body = [b'data: {"error":"upstream connection reset by the gateway"}\n\n', DONE]
    openai_api.add(Reply(raw_stream=body), Reply(text="unused"))
    async with make(openai_api, fast) as model:
        with pytest.raises(ModelError, match="upstream connection reset by the gateway"):
            await complete(model, [Message.user("hi")])
    assert openai_api.request_count == 1


async def test_a_refusal_finishes_as_content_filter(
    openai_api: FakeOpenAIAPI, fast: Backoff
) -> None:
    # The model declined (its reason in "refusal", finish_reason "stop"): the answer read as
    # a whole one, where Anthropic's refusal reads as content_filter, which the agent logs.
    openai_api.add(Reply(refusal="I cannot help with that."), Reply(text="fine"))
    async with make(openai_api, fast) as model:
        refused = await complete(model, [Message.user("hi")])
        answered = await complete(model, [Message.user("hi")])
    assert (refused.text, refused.finish_reason) == ("I cannot help with that.", "content_filter")
    assert answered.finish_reason == "stop"


@pytest.mark.parametrize(("code", "retried"), [(400, False), (503, True)])
async def test_an_error_object_in_place_of_a_chunk_is_the_servers_error(
    openai_api: FakeOpenAIAPI, fast: Backoff, code: int, retried: bool
) -> None:
    # vLLM's older in-stream error: {"object": "error", ...} with no "error" key. It failed
    # as "choices is missing or null", and its message and code were lost.
    error = (
        f'data: {{"object":"error","message":"engine said no","type":"BadRequestError",'
        f'"param":null,"code":{code}}}\n\n'
    ).encode()
    openai_api.add(Reply(raw_stream=[error]), Reply(text="ok"))
    async with make(openai_api, fast) as model:
        if retried:
            assert (await complete(model, [Message.user("hi")])).text == "ok"
        else:
            with pytest.raises(ModelError, match="BadRequestError: engine said no") as info:
                await complete(model, [Message.user("hi")])
            assert info.value.status == code
    assert openai_api.request_count == (2 if retried else 1)


@pytest.mark.parametrize("in_stream", [False, True])
async def test_an_error_that_echoes_the_api_key_does_not_repeat_it(
    openai_api: FakeOpenAIAPI, fast: Backoff, in_stream: bool
) -> None:
    # Some gateways quote the key they refused; the error goes to logs and the audit trail.
    key = "sk-live-0123456789abcdef"
    openai_api.add(Failure(401, f"Incorrect API key provided: {key}.", in_stream=in_stream))
    model = OpenAIModel(MODEL, base_url=openai_api.base_url, api_key=key, backoff=fast)
    async with model:
        with pytest.raises(ModelError) as info:
            await complete(model, [Message.user("hi")])
    assert key not in str(info.value)
    assert key not in info.value.detail
    assert "Incorrect API key provided: [api key]." in info.value.detail
    # Nor in the traceback a logger prints (log.exception, an unhandled error): the SDK's
    # exception, which quotes the key, is not chained into it.
    printed = "".join(traceback.format_exception(info.value))
    assert key not in printed


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"timeout": "30"}, "timeout"),
        ({"timeout": True}, "timeout"),
        ({"max_retries": "2"}, "max_retries"),
        ({"max_retries": 1.5}, "max_retries"),
        ({"max_retries": True}, "max_retries"),
        ({"max_retries": -1}, "max_retries"),
    ],
)
def test_a_timeout_or_retry_count_that_cannot_work_is_refused(
    options: dict[str, object], named: str
) -> None:
    # A NaN timeout was a bare ValueError on the first call, a negative one a "timed out"
    # retried until exhausted, a string one a bare TypeError from the SDK.
    with pytest.raises(InvalidArgumentError, match=named):
        OpenAIModel(MODEL, base_url="http://127.0.0.1:9/v1", api_key="k", **options)  # type: ignore[arg-type]
