"""The agent with the real Anthropic and OpenAI SDKs, against local wire-format servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.messages import ToolCall
from loomflow.models import AnthropicModel, OpenAIModel
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


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
async def test_a_provider_run_replays_with_no_requests(provider: str, tmp_path: Path) -> None:
    lookups.clear()
    fake = FakeAnthropicAPI(*SCRIPT) if provider == "anthropic" else FakeOpenAIAPI(*SCRIPT)
    with fake as api:
        model = (
            AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="test")
            if provider == "anthropic"
            else OpenAIModel("gpt-4.1", base_url=api.base_url, api_key="test")
        )
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
