"""ScriptedModel and FunctionModel: deterministic streams, call counting, journal replay."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.errors import (
    InvalidArgumentTypeError,
    LoomflowError,
    ModelError,
    ScriptExhaustedError,
)
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
from loomflow.models import (
    FunctionModel,
    Model,
    ScriptedModel,
    approx_tokens,
    complete,
    script_position,
)
from loomflow.runtime import InMemoryRuntime, JournalRuntime, SqliteRuntime

CALL = ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2})
PROMPT = [Message.system("You add numbers."), Message.user("What is 1 + 2?")]


async def _drain(model: Model, messages: list[Message] = PROMPT) -> list[ModelChunk]:
    return [c async for c in model.stream(messages, tools=[], settings=ModelSettings())]


async def test_text_turn_streams_in_a_few_deltas_then_the_response() -> None:
    model = ScriptedModel(["one two three four five six seven"])
    chunks = await _drain(model)
    deltas = [c for c in chunks if isinstance(c, TextDelta)]
    assert len(deltas) == 3
    assert "".join(d.text for d in deltas) == "one two three four five six seven"
    final = chunks[-1]
    assert isinstance(final, ModelResponse)
    assert final.text == "one two three four five six seven"
    assert final.finish_reason == "stop"
    assert final.model == "scripted"


async def test_tool_turn_streams_each_call_and_ends_with_tool_calls() -> None:
    model = ScriptedModel([[CALL, CALL.model_copy(update={"id": "c2"})]])
    chunks = await _drain(model)
    deltas = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert [(d.index, d.id, d.name) for d in deltas] == [(0, "c1", "add"), (1, "c2", "add")]
    assert json.loads(deltas[0].arguments_delta) == {"a": 1, "b": 2}
    final = chunks[-1]
    assert isinstance(final, ModelResponse)
    assert final.finish_reason == "tool_calls"
    assert [c.id for c in final.tool_calls] == ["c1", "c2"]


async def test_usage_is_deterministic() -> None:
    first = await complete(ScriptedModel(["the answer is 3"]), PROMPT)
    second = await complete(ScriptedModel(["the answer is 3"]), PROMPT)
    assert first.usage == second.usage
    expected_in = approx_tokens("You add numbers.") + approx_tokens("What is 1 + 2?")
    assert first.usage == Usage(
        input_tokens=expected_in, output_tokens=approx_tokens("the answer is 3")
    )


async def test_a_given_response_is_played_verbatim() -> None:
    given = ModelResponse(text="hi", usage=Usage(input_tokens=7, output_tokens=1), model="x")
    assert await complete(ScriptedModel([given]), PROMPT) == given


async def test_turns_play_in_order_and_calls_are_counted() -> None:
    model = ScriptedModel([[CALL], "3"])
    assert model.calls == 0
    first = await complete(model, PROMPT)
    second = await complete(model, [*PROMPT, first.to_message(), Message.tool_result("c1", "3")])
    assert first.tool_calls == [CALL]
    assert second.text == "3"
    assert model.calls == 2
    assert model.remaining == 0
    assert model.requests[1][-1].content == "3"


def _after(*answers: ModelResponse) -> list[Message]:
    """PROMPT followed by the given answers, each tool call answered."""
    messages = list(PROMPT)
    for answer in answers:
        messages.append(answer.to_message())
        messages += [Message.tool_result(c.id, "3") for c in answer.tool_calls]
    return messages


async def test_an_exhausted_script_raises_a_clear_error() -> None:
    model = ScriptedModel(["only"])
    first = await complete(model, PROMPT)
    with pytest.raises(ScriptExhaustedError, match="1 turn") as info:
        await complete(model, _after(first))
    assert isinstance(info.value, ModelError)
    assert info.value.provider == "scripted"
    # Numbered from 0 as in the docs: the second call asks for turn 1.
    assert "asks for turn 1 (it already holds 1 assistant message(s)" in str(info.value)


async def test_a_default_answers_after_the_script() -> None:
    model = ScriptedModel(["first"], default=lambda messages: f"seen {len(messages)}")
    first = await complete(model, PROMPT)
    assert first.text == "first"
    assert (await complete(model, _after(first))).text == "seen 3"


async def test_an_exception_is_raised_once_before_the_answer_after_it() -> None:
    model = ScriptedModel([RuntimeError("provider down"), "ok"])
    with pytest.raises(RuntimeError, match="provider down"):
        await complete(model, PROMPT)
    assert (await complete(model, PROMPT)).text == "ok"  # the same request, retried
    assert model.remaining == 0


async def test_the_turn_comes_from_the_conversation_not_the_call_count() -> None:
    model = ScriptedModel([[CALL], "3"])
    first = await complete(model, PROMPT)
    # The same request again (a retry, or another process) gets the same turn...
    assert (await complete(model, PROMPT)).tool_calls == [CALL]
    # ...and a fresh model object sent the later conversation answers the later turn.
    fresh = ScriptedModel([[CALL], "3"])
    assert (await complete(fresh, _after(first))).text == "3"
    assert fresh.calls == 1
    assert script_position(_after(first)) == 1


def test_a_script_given_as_one_string_is_refused() -> None:
    # ScriptedModel("Hello") was read as the turns "H", "e", "l", ...: the run answered "H".
    with pytest.raises(InvalidArgumentTypeError, match=r"ScriptedModel\(\['Hello'\]\)"):
        ScriptedModel("Hello")


@pytest.mark.parametrize("turn", [42, None, {"text": "x"}, CALL, [CALL, "3"]])
def test_a_turn_of_no_known_kind_is_refused_when_the_script_is_built(turn: object) -> None:
    # 42 was a bare TypeError at the first call, None a ScriptExhaustedError about a script
    # that held the turn, a dict or a lone ToolCall an error only once the run reached them.
    with pytest.raises(InvalidArgumentTypeError, match="scripted turn 1 must be") as info:
        ScriptedModel(["first", turn])  # type: ignore[list-item]
    assert isinstance(info.value, LoomflowError)


@pytest.mark.parametrize("answer", [42, None])
async def test_a_function_model_answer_of_no_known_kind_is_a_typed_error(answer: object) -> None:
    model = FunctionModel(lambda messages, tools: answer)  # type: ignore[arg-type,return-value]
    with pytest.raises(InvalidArgumentTypeError, match="must be a final answer"):
        await complete(model, PROMPT)


@pytest.mark.parametrize("fn", [42, lambda messages: "x", lambda: "x"])
def test_a_function_model_needs_a_function_of_messages_and_tools(fn: object) -> None:
    # Each was a bare TypeError ('int' object is not callable, "takes 1 positional argument")
    # at the run's first model call.
    with pytest.raises(InvalidArgumentTypeError, match="FunctionModel"):
        FunctionModel(fn)  # type: ignore[arg-type]


async def test_function_model_sync_and_async() -> None:
    def sync_fn(messages: list[Message], tools: list[ToolSpec]) -> str | list[ToolCall]:
        if messages[-1].role == "tool":
            return f"result {messages[-1].content} with {len(tools)} tool(s)"
        return [CALL]

    async def async_fn(messages: list[Message], tools: list[ToolSpec]) -> str:
        return messages[-1].content.upper()

    tools = [ToolSpec(name="add")]
    model = FunctionModel(sync_fn)
    first = await complete(model, PROMPT, tools=tools)
    assert first.tool_calls == [CALL]
    later = [*PROMPT, first.to_message(), Message.tool_result("c1", "3")]
    assert (await complete(model, later, tools=tools)).text == "result 3 with 1 tool(s)"
    assert model.calls == 2
    assert (await complete(FunctionModel(async_fn), PROMPT)).text == "WHAT IS 1 + 2?"


def test_scripted_models_satisfy_the_protocol() -> None:
    assert isinstance(ScriptedModel(), Model)
    assert isinstance(FunctionModel(lambda m, t: "x"), Model)


@pytest.fixture(params=["memory", "sqlite"])
async def runtime(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[JournalRuntime]:
    rt: JournalRuntime = (
        InMemoryRuntime() if request.param == "memory" else SqliteRuntime(tmp_path / "j.db")
    )
    yield rt
    await rt.close()


async def test_journaled_stream_replays_without_calling_the_model(
    runtime: JournalRuntime,
) -> None:
    model = ScriptedModel([[CALL], "3"])
    tools = [ToolSpec(name="add", parameters={"type": "object"})]
    settings = ModelSettings(max_tokens=64)

    async def two_turns() -> list[ModelChunk]:
        seen: list[ModelChunk] = []
        messages = list(PROMPT)
        for turn in range(2):
            async for chunk in runtime.stream_step(
                f"model_call_{turn}", model.stream, messages, tools=tools, settings=settings
            ):
                seen.append(chunk)
            final = seen[-1]
            assert isinstance(final, ModelResponse)
            messages = [*messages, final.to_message(), Message.tool_result("c1", "3")]
        return seen

    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session("s", "u"):
            live = await two_turns()
            raise RuntimeError("crash")
    assert model.calls == 2

    async with runtime.session("s", "u") as run:
        replayed = await two_turns()
    assert replayed == live
    assert model.calls == 2  # every chunk came from the journal
    assert run.stats.hits == 2


async def test_a_session_continues_the_script_only_through_memory() -> None:
    remembering = Agent("x", model=ScriptedModel(["first", "second"]))
    forgetting = Agent("x", model=ScriptedModel(["first", "second"]), memory=False)
    for agent, expected in ((remembering, "second"), (forgetting, "first")):
        await agent.run("one", session_id="s", user_id="u")
        assert (await agent.run("two", session_id="s", user_id="u")).output == expected
        # Another session is another conversation: it starts at the first turn.
        assert (await agent.run("three", session_id="t", user_id="u")).output == "first"


async def test_running_a_script_again_on_its_session_says_memory_is_why(tmp_path: Path) -> None:
    # What a new user does with the README's quick start: run the same script twice, on the
    # same journal and session. The second run is sent the first one's turns (memory).
    async def run_script() -> str:
        async with SqliteRuntime(tmp_path / "journal.db") as runtime:
            agent = Agent("x", model=ScriptedModel(["Refunded."]), runtime=runtime)
            return (await agent.run("refund", session_id="t-42", user_id="a")).output

    assert await run_script() == "Refunded."
    with pytest.raises(ScriptExhaustedError) as info:
        await run_script()
    message = str(info.value)
    assert "has 1 turn(s), numbered from 0, and the conversation asks for turn 1" in message
    assert "earlier runs on this session" in message
    assert "use a new session or memory=False" in message
