"""The agent with the real Anthropic and OpenAI SDKs, against local wire-format servers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.errors import ModelError
from loomflow.messages import ToolCall
from loomflow.models import AnthropicModel, OpenAIModel, _sdk
from loomflow.runtime import SqliteRuntime
from loomflow.testing.providers import FakeAnthropicAPI, FakeOpenAIAPI, Reply
from loomflow.tools import tool

lookups: list[str] = []


@tool
def weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: City name.
    """
    lookups.append(city)
    return f"sunny in {city}"


SCRIPT = (
    Reply(tool_calls=[ToolCall(id="toolu_1", name="weather", arguments={"city": "Oslo"})]),
    Reply(text="It is sunny in Oslo.", input_tokens=40, output_tokens=9),
)


def _model_for(
    provider: str, api: FakeAnthropicAPI | FakeOpenAIAPI
) -> AnthropicModel | OpenAIModel:
    if provider == "anthropic":
        return AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="test")
    return OpenAIModel("gpt-4.1", base_url=api.base_url, api_key="test")


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_provider_run_replays_with_no_requests(provider: str, tmp_path: Path) -> None:
    lookups.clear()
    fake = FakeAnthropicAPI(*SCRIPT) if provider == "anthropic" else FakeOpenAIAPI(*SCRIPT)
    with fake as api:
        model = _model_for(provider, api)
        runtime = SqliteRuntime(tmp_path / "journal.db")
        agent = Agent("weather bot", model=model, tools=[weather], runtime=runtime)
        try:
            first = await agent.run("weather in Oslo?", session_id="s", user_id="u")
            assert first.output == "It is sunny in Oslo."
            assert lookups == ["Oslo"]
            assert api.request_count == 2
            assert first.tokens_in == 12 + 40
            assert first.cost_usd > 0  # priced from the table
            # The tool schema reached the provider in its own format.
            assert "weather" in str(api.last_request.body)

            again = await agent.resume("weather in Oslo?", session_id="s", user_id="u")
            assert again.output == first.output
            assert api.request_count == 2  # replayed: no request left the process
            assert lookups == ["Oslo"]
        finally:
            await runtime.close()
            await model.aclose()


async def test_model_strings_use_the_sdk_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeAnthropicAPI(Reply(text="hello from the fake")) as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
        agent = Agent("hi", model="claude-opus-4-7")
        result = await agent.run("hello")
        assert result.output == "hello from the fake"
        assert api.request_count == 1
        await agent.model.aclose()  # type: ignore[attr-defined]


def _anthropic_tool_use_with_input(tool_input: object) -> list[bytes]:
    """An Anthropic stream calling ``weather`` with ``tool_input`` whole in the start event
    (no input_json deltas)."""

    def event(kind: str, data: dict[str, object]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    message = {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-opus-4-7",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1},
    }  # fmt: skip
    block = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": tool_input}
    return [
        event("message_start", {"message": message}),
        event("content_block_start", {"index": 0, "content_block": block}),
        event("content_block_stop", {"index": 0}),
        event(
            "message_delta",
            {
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 5},
            },
        ),
        event("message_stop", {}),
    ]


OPENAI_NOT_JSON = [b"data: {not json\n\n", b"data: [DONE]\n\n"]


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")
@pytest.mark.parametrize(
    ("provider", "body", "says"),
    [
        # A tool input that is not an object once ran the tool with {}, its defaults.
        ("anthropic", _anthropic_tool_use_with_input(["Oslo"]), "not a JSON object"),
        ("openai", OPENAI_NOT_JSON, "malformed response stream"),
    ],
)
async def test_a_malformed_answer_runs_no_tool_and_journals_no_call(
    provider: str, body: list[bytes], says: str, tmp_path: Path
) -> None:
    lookups.clear()
    replies = (Reply(raw_stream=body), Reply(text="It is sunny."))
    fake = FakeAnthropicAPI(*replies) if provider == "anthropic" else FakeOpenAIAPI(*replies)
    with fake as api:
        model = _model_for(provider, api)
        runtime = SqliteRuntime(tmp_path / "journal.db")
        agent = Agent("weather bot", model=model, tools=[weather], runtime=runtime)
        try:
            with pytest.raises(ModelError, match=says) as info:
                await agent.run("weather in Oslo?", session_id="s", user_id="u")
            assert info.value.provider == provider
            assert lookups == []
            assert api.request_count == 1  # not retried
            entries = await runtime.entries("s", "u")
            assert not [e for e in entries if e.kind == "stream" or "model" in e.name]
            # Nothing of the failed call was kept: resuming asks the model again.
            again = await agent.resume("weather in Oslo?", session_id="s", user_id="u")
            assert again.output == "It is sunny."
            assert api.request_count == 2
        finally:
            await runtime.close()
            await model.aclose()


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_run_without_a_budget_goes_on_when_no_usage_is_reported(
    provider: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_sdk, "_unreported", set())
    reply = Reply(text="hello", report_usage=False)
    fake = FakeAnthropicAPI(reply) if provider == "anthropic" else FakeOpenAIAPI(reply)
    with fake as api:
        model = _model_for(provider, api)
        with caplog.at_level(logging.WARNING, logger="loomflow.models"):
            result = await Agent("x", model=model).run("hi")
        await model.aclose()
    assert result.output == "hello"
    assert (result.tokens_in, result.tokens_out, result.cost_usd) == (0, 0, 0.0)
    assert [r for r in caplog.records if "without reporting its token usage" in r.message]


@tool(sensitive=["password"])
def login(user: str, password: str) -> str:
    """Log in."""
    return f"{user} logged in"


def _openai_chunk(fields: dict[str, object]) -> bytes:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4.1"}
    return f"data: {json.dumps({**head, **fields})}\n\n".encode()


async def test_a_servers_own_tool_call_numbering_does_not_unseal_a_streamed_secret(
    tmp_path: Path,
) -> None:
    # An OpenAI-compatible server that numbers its only tool call 1: the deltas the stream
    # shows must still carry the sealed arguments, as the response does.
    piece = {
        "index": 1,
        "id": "call_1",
        "type": "function",
        "function": {
            "name": "login",
            "arguments": json.dumps({"user": "bob", "password": "hunter2-secret"}),
        },
    }
    body = [
        _openai_chunk(
            {"choices": [{"index": 0, "delta": {"tool_calls": [piece]}, "finish_reason": None}]}
        ),
        _openai_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        _openai_chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}),
        b"data: [DONE]\n\n",
    ]
    with FakeOpenAIAPI(Reply(raw_stream=body), Reply(text="done")) as api:
        model = _model_for("openai", api)
        runtime = SqliteRuntime(tmp_path / "journal.db")
        agent = Agent("login bot", model=model, tools=[login], runtime=runtime)
        try:
            shown = [repr(event) async for event in agent.stream("log in", session_id="s")]
        finally:
            await runtime.close()
            await model.aclose()
    assert any("bob logged in" in event for event in shown)  # the tool ran with the value
    assert not [event for event in shown if "hunter2" in event]
