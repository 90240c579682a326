"""The fake provider servers themselves, driven by the raw SDK clients (no adapter between)."""

from __future__ import annotations

import email.utils
import time

import anthropic
import openai
import pytest

from loomflow.messages import Message, ToolCall
from loomflow.models import AnthropicModel, Backoff, OpenAIModel, complete
from loomflow.testing.providers import Failure, FakeAnthropicAPI, FakeOpenAIAPI, Reply

CALL = ToolCall(id="toolu_9", name="lookup", arguments={"q": "tea"})


async def test_anthropic_non_streaming_message(anthropic_api: FakeAnthropicAPI) -> None:
    anthropic_api.add(Reply(text="Hi!", tool_calls=[CALL], input_tokens=5, output_tokens=2))
    async with anthropic.AsyncAnthropic(
        base_url=anthropic_api.base_url, api_key="k", max_retries=0
    ) as client:
        message = await client.messages.create(
            model="claude-opus-4-7",
            max_tokens=10,
            messages=[{"role": "user", "content": "hi"}],
        )
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Hi!"  # type: ignore[union-attr]
    assert message.content[1].input == {"q": "tea"}  # type: ignore[union-attr]
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == (
        "tool_use",
        5,
        2,
    )
    assert not anthropic_api.last_request.streamed


async def test_anthropic_raw_event_sequence(anthropic_api: FakeAnthropicAPI) -> None:
    anthropic_api.add(Reply(text="a b", tool_calls=[CALL]))
    async with anthropic.AsyncAnthropic(
        base_url=anthropic_api.base_url, api_key="k", max_retries=0
    ) as client:
        stream = await client.messages.create(
            model="claude-opus-4-7",
            max_tokens=10,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        kinds = [event.type async for event in stream]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


async def test_openai_non_streaming_completion(openai_api: FakeOpenAIAPI) -> None:
    openai_api.add(Reply(text="Hi!", tool_calls=[CALL], input_tokens=5, output_tokens=2))
    async with openai.AsyncOpenAI(base_url=openai_api.base_url, api_key="k", max_retries=0) as c:
        completion = await c.chat.completions.create(
            model="gpt-4.1", messages=[{"role": "user", "content": "hi"}]
        )
    choice = completion.choices[0]
    assert choice.message.content == "Hi!"
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [(t.id, t.function.arguments) for t in calls] == [  # type: ignore[union-attr]
        ("toolu_9", '{"q": "tea"}')
    ]
    assert completion.usage is not None
    assert completion.usage.total_tokens == 7


async def test_openai_usage_chunk_only_when_asked(openai_api: FakeOpenAIAPI) -> None:
    openai_api.add(Reply(text="x"), Reply(text="x"))
    async with openai.AsyncOpenAI(base_url=openai_api.base_url, api_key="k", max_retries=0) as c:
        for include in (False, True):
            stream = await c.chat.completions.create(
                model="gpt-4.1",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": include},
            )
            usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
            assert len(usages) == int(include)


async def test_an_empty_queue_answers_with_a_clear_400(anthropic_api: FakeAnthropicAPI) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=anthropic_api.base_url, api_key="k", max_retries=0
    ) as client:
        with pytest.raises(anthropic.BadRequestError, match="no scripted answer left"):
            await client.messages.create(
                model="claude-opus-4-7", max_tokens=1, messages=[{"role": "user", "content": "x"}]
            )


async def test_a_default_reply_answers_every_request() -> None:
    with FakeOpenAIAPI(default=Reply(text="again")) as api:
        async with openai.AsyncOpenAI(base_url=api.base_url, api_key="k") as c:
            for _ in range(3):
                completion = await c.chat.completions.create(
                    model="gpt-4.1", messages=[{"role": "user", "content": "hi"}]
                )
                assert completion.choices[0].message.content == "again"
        assert api.request_count == 3


async def test_retry_after_header_is_honoured(anthropic_api: FakeAnthropicAPI) -> None:
    anthropic_api.add(Failure(429, headers={"retry-after": "0.2"}), Reply(text="ok"))
    backoff = Backoff(initial=0.001, maximum=1.0)
    async with AnthropicModel(
        "claude-opus-4-7", base_url=anthropic_api.base_url, api_key="k", backoff=backoff
    ) as model:
        started = time.monotonic()
        assert (await complete(model, [Message.user("hi")])).text == "ok"
    assert time.monotonic() - started >= 0.2


async def test_retry_after_as_an_http_date_is_honoured(openai_api: FakeOpenAIAPI) -> None:
    # RFC 9110 allows a date as well as seconds; a date two seconds ahead (whole seconds
    # only) asks for a wait of more than one second. It used to be ignored.
    when = email.utils.formatdate(time.time() + 2, usegmt=True)
    openai_api.add(Failure(429, headers={"retry-after": when}), Reply(text="ok"))
    backoff = Backoff(initial=0.001, maximum=5.0)
    async with OpenAIModel(
        "gpt-4.1", base_url=openai_api.base_url, api_key="k", backoff=backoff
    ) as model:
        started = time.monotonic()
        assert (await complete(model, [Message.user("hi")])).text == "ok"
    assert time.monotonic() - started >= 0.9


async def test_retry_after_ms_is_honoured(anthropic_api: FakeAnthropicAPI) -> None:
    anthropic_api.add(Failure(529, headers={"retry-after-ms": "300"}), Reply(text="ok"))
    backoff = Backoff(initial=0.001, maximum=5.0)
    async with AnthropicModel(
        "claude-opus-4-7", base_url=anthropic_api.base_url, api_key="k", backoff=backoff
    ) as model:
        started = time.monotonic()
        assert (await complete(model, [Message.user("hi")])).text == "ok"
    assert time.monotonic() - started >= 0.3
