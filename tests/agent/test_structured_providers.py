"""Structured output through the real Anthropic and OpenAI SDKs, against local wire servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from loomflow.agent import Agent, ModelDeltaEvent, RunFinished
from loomflow.agent._output import StructuredOutput
from loomflow.errors import OutputValidationError
from loomflow.messages import Message, ModelResponse, TextDelta, ToolCall, ToolSpec
from loomflow.models import AnthropicModel, OpenAIModel
from loomflow.runtime import SqliteRuntime
from loomflow.testing.providers import FakeAnthropicAPI, FakeOpenAIAPI, Reply
from loomflow.tools import tool


class Weather(BaseModel):
    """Today's weather in one city."""

    city: str
    temp_c: float


class Report(BaseModel):
    city: str
    summary: str | None = None  # optional: OpenAI strict mode would refuse this schema


class Tree(BaseModel):
    """A tree of places."""

    name: str
    children: list[Tree]  # recursive, every field required: strict mode can take it


class Sunny(BaseModel):
    sky: Literal["sunny"]
    uv_index: int


class Rainy(BaseModel):
    sky: Literal["rainy"]
    mm: float


class Outlook(BaseModel):
    """A discriminated union, every field required: pydantic writes it as a oneOf."""

    city: str
    today: Sunny | Rainy = Field(discriminator="sky")
    # A described field of a model type: pydantic writes the description beside the $ref.
    tomorrow: Sunny = Field(description="The forecast for tomorrow.")


ANSWER = {"city": "Oslo", "temp_c": 3.5}
TREE = {"name": "Norway", "children": [{"name": "Oslo", "children": []}]}


@tool
def lookup(city: str) -> str:
    """Look the weather up.

    Args:
        city: City name.
    """
    return f"3.5 degrees in {city}"


def _anthropic(api: FakeAnthropicAPI) -> AnthropicModel:
    return AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="test")


def _openai(api: FakeOpenAIAPI) -> OpenAIModel:
    return OpenAIModel("gpt-4.1", base_url=api.base_url, api_key="test")


def _agent(model: Any, **options: Any) -> Agent:
    return Agent("weather bot", model=model, memory=False, telemetry=False, **options)


# -- Anthropic: a forced tool ------------------------------------------------------------------


async def test_anthropic_forces_the_answer_tool_and_parses_its_input() -> None:
    with FakeAnthropicAPI(Reply(structured=ANSWER)) as api:
        model = _anthropic(api)
        try:
            events = [e async for e in _agent(model).stream("weather?", output_type=Weather)]
        finally:
            await model.aclose()
    final = events[-1]
    assert isinstance(final, RunFinished)
    assert final.result.parsed == Weather(city="Oslo", temp_c=3.5)
    body = api.last_request.body
    assert body["tool_choice"] == {"type": "tool", "name": "Weather"}
    [answer_tool] = body["tools"]
    assert answer_tool["name"] == "Weather"
    assert answer_tool["input_schema"]["required"] == ["city", "temp_c"]
    assert answer_tool["description"] == "Today's weather in one city."
    # No schema in the prompt: the provider gets it natively.
    assert "system" not in body or "JSON schema" not in body["system"]
    # The tool input streamed as the answer's text, in pieces.
    deltas = [e.delta for e in events if isinstance(e, ModelDeltaEvent)]
    assert all(isinstance(d, TextDelta) for d in deltas)
    assert len(deltas) == 2
    assert final.result.output == "".join(d.text for d in deltas if isinstance(d, TextDelta))


async def test_anthropic_with_tools_lets_the_model_use_them_first() -> None:
    script = (
        Reply(tool_calls=[ToolCall(id="toolu_1", name="lookup", arguments={"city": "Oslo"})]),
        Reply(structured=ANSWER),
    )
    with FakeAnthropicAPI(*script) as api:
        model = _anthropic(api)
        try:
            result = await _agent(model, tools=[lookup]).run("weather?", output_type=Weather)
        finally:
            await model.aclose()
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert api.request_count == 2
    for request in api.requests:
        assert request.body["tool_choice"] == {"type": "any"}
        assert [t["name"] for t in request.body["tools"]] == ["lookup", "Weather"]
    # The tool result reached the model before it answered.
    assert "3.5 degrees in Oslo" in str(api.requests[1].body["messages"])


async def test_anthropic_retries_an_answer_that_does_not_validate() -> None:
    with FakeAnthropicAPI(Reply(structured={"city": "Oslo"}), Reply(structured=ANSWER)) as api:
        model = _anthropic(api)
        try:
            result = await _agent(model).run("weather?", output_type=Weather, output_retries=1)
        finally:
            await model.aclose()
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert api.request_count == 2
    last_turn = api.requests[1].body["messages"][-1]
    assert last_turn["role"] == "user"
    assert "temp_c: Field required" in str(last_turn["content"])
    # The refused answer went back as the assistant's text, which the API accepts.
    assert api.requests[1].body["messages"][-2]["role"] == "assistant"


async def test_anthropic_malformed_tool_input_spends_the_retries() -> None:
    bad = Reply(text='{"city": "Oslo", "temp_c": ')  # cut-off JSON as the tool input
    with FakeAnthropicAPI(bad, bad) as api:
        model = _anthropic(api)
        try:
            with pytest.raises(OutputValidationError) as caught:
                await _agent(model).run("weather?", output_type=Weather, output_retries=1)
        finally:
            await model.aclose()
    assert caught.value.attempts == 2
    assert "Invalid JSON" in caught.value.detail
    assert api.request_count == 2


async def test_anthropic_fake_refuses_a_forced_tool_it_was_not_offered() -> None:
    with FakeAnthropicAPI(Reply(text="unused")) as api:
        client = anthropic.AsyncAnthropic(base_url=api.base_url, api_key="test", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="not in tools"):
            await client.messages.create(
                model="claude-opus-4-7",
                max_tokens=10,
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"name": "a", "input_schema": {"type": "object"}}],
                tool_choice={"type": "tool", "name": "b"},
            )
        await client.close()


async def test_anthropic_adapter_alone_turns_the_answer_tool_into_text() -> None:
    fmt = StructuredOutput(Weather, 1).format
    with FakeAnthropicAPI(Reply(structured=ANSWER)) as api:
        model = _anthropic(api)
        try:
            chunks = [c async for c in model.stream([Message.user("weather?")], output=fmt)]
        finally:
            await model.aclose()
    response = chunks[-1]
    assert isinstance(response, ModelResponse)
    assert response.tool_calls == []
    assert response.finish_reason == "stop"
    assert Weather.model_validate_json(response.text) == Weather(city="Oslo", temp_c=3.5)


async def test_anthropic_answer_beside_another_tool_call_waits_for_its_result() -> None:
    fmt = StructuredOutput(Weather, 1).format
    calls = [
        ToolCall(id="toolu_1", name="lookup", arguments={"city": "Oslo"}),
        ToolCall(id="toolu_2", name="Weather", arguments=ANSWER),
    ]
    spec = ToolSpec(name="lookup", parameters={"type": "object", "properties": {}})
    with FakeAnthropicAPI(Reply(tool_calls=calls)) as api:
        model = _anthropic(api)
        try:
            chunks = [c async for c in model.stream([Message.user("w?")], tools=[spec], output=fmt)]
        finally:
            await model.aclose()
    response = chunks[-1]
    assert isinstance(response, ModelResponse)
    assert [c.name for c in response.tool_calls] == ["lookup"]  # the answer is asked again
    assert response.text == ""
    assert response.finish_reason == "tool_calls"


async def test_anthropic_cut_off_answer_reads_as_length() -> None:
    fmt = StructuredOutput(Weather, 1).format
    reply = Reply(text='{"city": "Os', stop_reason="max_tokens")
    with FakeAnthropicAPI(reply) as api:
        model = _anthropic(api)
        try:
            chunks = [c async for c in model.stream([Message.user("w?")], output=fmt)]
        finally:
            await model.aclose()
    response = chunks[-1]
    assert isinstance(response, ModelResponse)
    assert response.finish_reason == "length"
    assert response.text == '{"city": "Os'


async def test_anthropic_answers_with_a_recursive_model() -> None:
    with FakeAnthropicAPI(Reply(structured=TREE)) as api:
        model = _anthropic(api)
        try:
            result = await _agent(model).run("places?", output_type=Tree)
        finally:
            await model.aclose()
    assert result.parsed == Tree.model_validate(TREE)
    [answer_tool] = api.last_request.body["tools"]
    schema = answer_tool["input_schema"]
    assert schema["type"] == "object"  # the API refuses a tool input that is a bare $ref
    assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}
    assert "Tree" in schema["$defs"]


async def test_anthropic_fake_refuses_a_tool_input_that_is_not_an_object() -> None:
    with FakeAnthropicAPI(Reply(structured=TREE)) as api:
        client = anthropic.AsyncAnthropic(base_url=api.base_url, api_key="test", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match=r"input_schema\.type"):
            await client.messages.create(
                model="claude-opus-4-7",
                max_tokens=100,
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"name": "Tree", "input_schema": Tree.model_json_schema()}],
                tool_choice={"type": "tool", "name": "Tree"},
            )
        await client.close()


# -- OpenAI: response_format json_schema -------------------------------------------------------


async def test_openai_sends_a_strict_json_schema_and_parses_the_content() -> None:
    with FakeOpenAIAPI(Reply(structured=ANSWER)) as api:
        model = _openai(api)
        try:
            result = await _agent(model).run("weather?", output_type=Weather)
        finally:
            await model.aclose()
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    form = api.last_request.body["response_format"]
    assert form["type"] == "json_schema"
    spec = form["json_schema"]
    assert spec["name"] == "Weather"
    assert spec["strict"] is True
    assert spec["schema"]["additionalProperties"] is False
    assert "tools" not in api.last_request.body


async def test_openai_falls_back_to_non_strict_for_optional_fields() -> None:
    with FakeOpenAIAPI(Reply(structured={"city": "Oslo"})) as api:
        model = _openai(api)
        try:
            result = await _agent(model).run("report?", output_type=Report)
        finally:
            await model.aclose()
    assert result.parsed == Report(city="Oslo")
    spec = api.last_request.body["response_format"]["json_schema"]
    assert spec["strict"] is False
    assert spec["schema"] == Report.model_json_schema()


async def test_openai_fake_refuses_a_strict_schema_strict_mode_cannot_take() -> None:
    """Why the fallback exists: the same schema sent as strict is refused with a 400."""
    with FakeOpenAIAPI(Reply(structured={"city": "Oslo"})) as api:
        client = openai.AsyncOpenAI(base_url=api.base_url, api_key="test", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="every property required"):
            await client.chat.completions.create(
                model="gpt-4.1",
                messages=[{"role": "user", "content": "hi"}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {
                        "name": "Report",
                        "schema": {**Report.model_json_schema(), "additionalProperties": False},
                        "strict": True,
                    },
                },
            )
        await client.close()


async def _openai_answer(
    answer: dict[str, Any], output_type: type[BaseModel]
) -> tuple[Any, dict[str, Any]]:
    """The parsed answer of a run on the OpenAI fake, and the response format it was sent."""
    with FakeOpenAIAPI(Reply(structured=answer)) as api:
        model = _openai(api)
        try:
            result = await _agent(model).run("answer?", output_type=output_type)
        finally:
            await model.aclose()
    return result.parsed, api.last_request.body["response_format"]["json_schema"]


async def test_openai_answers_with_a_recursive_model_in_strict_mode() -> None:
    parsed, spec = await _openai_answer(TREE, Tree)
    assert parsed == Tree.model_validate(TREE)
    assert spec["strict"] is True
    assert spec["schema"]["type"] == "object"
    assert spec["schema"]["$defs"]["Tree"]["additionalProperties"] is False


async def test_openai_strict_mode_takes_a_discriminated_union_and_a_described_model_field() -> None:
    """OpenAI's strict mode refuses "oneOf", which pydantic writes for a discriminated union,
    and keywords beside a "$ref": the adapter sends the same schema in forms it takes."""
    sent = StructuredOutput(Outlook, 1).format.json_schema["properties"]
    assert "oneOf" in sent["today"]
    assert sent["tomorrow"] == {
        "$ref": "#/$defs/Sunny",
        "description": "The forecast for tomorrow.",
    }
    tomorrow = {"sky": "sunny", "uv_index": 3}
    answer = {"city": "Oslo", "today": {"sky": "rainy", "mm": 4.5}, "tomorrow": tomorrow}
    parsed, spec = await _openai_answer(answer, Outlook)
    assert parsed == Outlook.model_validate(answer)
    assert isinstance(parsed.today, Rainy)
    assert spec["strict"] is True
    today = spec["schema"]["properties"]["today"]
    assert "oneOf" not in today
    assert "discriminator" not in today
    assert today["anyOf"] == [{"$ref": "#/$defs/Sunny"}, {"$ref": "#/$defs/Rainy"}]
    # Strict mode takes no keyword beside a $ref, but takes them beside an anyOf.
    assert spec["schema"]["properties"]["tomorrow"] == {
        "anyOf": [{"$ref": "#/$defs/Sunny"}],
        "description": "The forecast for tomorrow.",
    }


async def test_openai_fake_refuses_a_schema_that_is_not_an_object() -> None:
    with FakeOpenAIAPI(Reply(structured=TREE)) as api:
        client = openai.AsyncOpenAI(base_url=api.base_url, api_key="test", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="must be a JSON Schema of 'type"):
            await client.chat.completions.create(
                model="gpt-4.1",
                messages=[{"role": "user", "content": "hi"}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "Tree", "schema": Tree.model_json_schema()},
                },
            )
        await client.close()


async def test_openai_retry_and_resume_through_the_journal(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    with FakeOpenAIAPI(Reply(text="I think it is cold"), Reply(structured=ANSWER)) as api:
        model = _openai(api)
        try:
            agent = _agent(model, runtime=runtime, output_type=Weather)
            first = await agent.run("weather?", session_id="s", user_id="u")
            assert first.parsed == Weather(city="Oslo", temp_c=3.5)
            assert api.request_count == 2
            feedback = api.requests[1].body["messages"][-1]
            assert feedback["role"] == "user"
            assert "Invalid JSON" in feedback["content"]

            again = await agent.resume("weather?", session_id="s", user_id="u")
            assert again.parsed == first.parsed
            assert api.request_count == 2  # both attempts replayed: nothing paid again
        finally:
            await model.aclose()
            await runtime.close()


async def test_openai_with_tools_keeps_them_beside_the_response_format() -> None:
    script = (
        Reply(tool_calls=[ToolCall(id="call_1", name="lookup", arguments={"city": "Oslo"})]),
        Reply(structured=ANSWER),
    )
    with FakeOpenAIAPI(*script) as api:
        model = _openai(api)
        try:
            result = await _agent(model, tools=[lookup]).run("weather?", output_type=Weather)
        finally:
            await model.aclose()
    assert result.parsed == Weather(city="Oslo", temp_c=3.5)
    assert api.request_count == 2
    assert [t["function"]["name"] for t in api.requests[0].body["tools"]] == ["lookup"]
    assert "response_format" in api.requests[0].body


async def test_openai_refusal_is_the_refused_answer() -> None:
    with FakeOpenAIAPI(Reply(refusal="I cannot help with that.")) as api:
        model = _openai(api)
        try:
            with pytest.raises(OutputValidationError) as caught:
                await _agent(model).run("weather?", output_type=Weather, output_retries=0)
        finally:
            await model.aclose()
    assert caught.value.output == "I cannot help with that."
    assert "Invalid JSON" in caught.value.detail


async def test_the_fakes_answer_plain_sdk_calls_in_structured_form() -> None:
    """Without loomflow in between: what a non-streamed SDK call gets back from the fakes."""
    with FakeAnthropicAPI(Reply(structured=ANSWER)) as api:
        client = anthropic.AsyncAnthropic(base_url=api.base_url, api_key="test", max_retries=0)
        message = await client.messages.create(
            model="claude-opus-4-7",
            max_tokens=100,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[{"name": "Weather", "input_schema": Weather.model_json_schema()}],
            tool_choice={"type": "tool", "name": "Weather"},
        )
        await client.close()
    [block] = message.content
    assert block.type == "tool_use"
    assert block.name == "Weather"
    assert block.input == ANSWER
    assert message.stop_reason == "tool_use"

    with FakeOpenAIAPI(Reply(structured=ANSWER)) as oapi:
        oclient = openai.AsyncOpenAI(base_url=oapi.base_url, api_key="test", max_retries=0)
        completion = await oclient.chat.completions.create(
            model="gpt-4.1",
            messages=[{"role": "user", "content": "weather?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "Weather",
                    "schema": StructuredOutput(Weather, 1).format.json_schema,
                    "strict": True,
                },
            },
        )
        await oclient.close()
    content = completion.choices[0].message.content
    assert content is not None
    assert Weather.model_validate_json(content) == Weather(city="Oslo", temp_c=3.5)


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        (Reply(text='{"city": "Os', stop_reason="length"), "raise ModelSettings.max_tokens"),
        (Reply(refusal="I can't help with that."), "the model declined to answer"),
    ],
)
async def test_an_answer_cut_short_says_so_when_it_does_not_validate(
    reply: Reply, said: str
) -> None:
    # The error named only the JSON it could not parse ("EOF while parsing a string"), not
    # that the model ran out of output tokens or declined: the fix was not in the schema.
    with FakeOpenAIAPI(default=reply) as api:
        model = _openai(api)
        agent = _agent(model, output_type=Weather, output_retries=0)
        with pytest.raises(OutputValidationError) as refused:
            await agent.run("weather?")
        await model.aclose()
    error = refused.value
    assert said in str(error)
    assert said in error.detail
