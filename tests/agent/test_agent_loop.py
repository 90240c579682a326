"""The ReAct loop: events, run context in tools, parallel calls, errors and call ids."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from loomflow import RunContext, get_run_context
from loomflow.agent import (
    Agent,
    ModelDeltaEvent,
    RunFinished,
    RunStarted,
    ToolCallFinished,
    ToolCallStarted,
    Tuning,
)
from loomflow.errors import UserError
from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec
from loomflow.models import AnthropicModel, FunctionModel, ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.runtime._journal import run_in_context
from loomflow.testing.providers import FakeAnthropicAPI, Reply
from loomflow.tools import tool


def two_tools_then_answer(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role == "tool":
        results = [m.content for m in messages if m.role == "tool"]
        return "answer: " + ", ".join(results)
    return [
        ToolCall(id="a", name="whoami", arguments={}),
        ToolCall(id="b", name="whoami_async", arguments={}),
    ]


async def test_tools_see_the_run_context_in_threads_and_in_parallel() -> None:
    seen: list[tuple[str | None, str | None, bool]] = []
    barrier = threading.Barrier(2, timeout=5)

    @tool
    def whoami(ctx: RunContext) -> str:
        """Who is asking (sync, in a thread)."""
        barrier.wait()  # both calls run at once, or this times out
        seen.append((ctx.user_id, get_run_context().session_id, True))
        return f"sync:{ctx.user_id}"

    @tool
    async def whoami_async() -> str:
        """Who is asking (async)."""
        ctx = get_run_context()
        await asyncio.to_thread(barrier.wait)
        seen.append((ctx.user_id, ctx.session_id, False))
        return f"async:{ctx.user_id}"

    agent = Agent(
        "ctx",
        model=FunctionModel(two_tools_then_answer),
        tools=[whoami, whoami_async],
        runtime=InMemoryRuntime(),
    )
    result = await agent.run("who?", session_id="s", user_id="alice", metadata={"role": "admin"})
    assert result.output == "answer: sync:alice, async:alice"
    assert sorted(seen) == [("alice", "s", False), ("alice", "s", True)]
    assert get_run_context() == RunContext()


async def test_run_and_resume_leave_the_callers_context_as_it_was() -> None:
    """run() and resume() drain the run in a copy of the caller's context, as the stream
    does event by event: nothing of the run (its context, its journal frame) is left in
    the caller's, whether the run answers, replays or raises."""
    calls = 0

    @tool
    def fails_once() -> str:
        """Fails the first time."""
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyboardInterrupt  # not a tool error: it ends the run
        return "ok"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="a", name="fails_once", arguments={})]

    runtime = InMemoryRuntime()
    agent = Agent("ctx", model=FunctionModel(decide), tools=[fails_once], runtime=runtime)
    with pytest.raises(KeyboardInterrupt):
        await agent.run("go", session_id="s", user_id="u")
    assert get_run_context() == RunContext()
    assert run_in_context() is None
    first = await agent.resume("go", session_id="s", user_id="u")  # the tool runs again
    assert (first.output, calls) == ("done", 2)
    assert get_run_context() == RunContext()
    again = await agent.resume("go", session_id="s", user_id="u")  # replayed whole
    assert (again.output, again.fresh_steps, calls) == ("done", 0, 2)
    assert get_run_context() == RunContext()
    assert run_in_context() is None


async def test_stream_yields_deltas_tool_events_and_the_result() -> None:
    @tool
    def whoami() -> str:
        """Sync."""
        return "x"

    @tool
    async def whoami_async() -> str:
        """Async."""
        return "y"

    agent = Agent("s", model=FunctionModel(two_tools_then_answer), tools=[whoami, whoami_async])
    events = [e async for e in agent.stream("go", user_id="u")]
    assert isinstance(events[0], RunStarted)
    assert isinstance(events[-1], RunFinished)
    kinds = [type(e) for e in events]
    assert kinds.count(ToolCallStarted) == 2
    assert kinds.count(ToolCallFinished) == 2
    text = "".join(
        e.delta.text for e in events if isinstance(e, ModelDeltaEvent) and hasattr(e.delta, "text")
    )
    assert text == "answer: x, y"
    assert events[-1].result.session_id  # a session id was generated
    assert events[-1].result.output == "answer: x, y"


async def test_invalid_arguments_reach_the_model_as_a_tool_error() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"error={messages[-1].is_error}: {messages[-1].content}"
        return [ToolCall(id="c", name="add", arguments={"a": "not a number"})]

    result = await Agent("m", model=FunctionModel(decide), tools=[add]).run("add")
    assert result.output.startswith("error=True: Error:")
    assert "'a'" in result.output
    assert "'b'" in result.output


async def test_unknown_tools_and_raising_tools_do_not_crash_the_run() -> None:
    @tool
    def explode() -> str:
        """Fails."""
        raise RuntimeError("kaboom")

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return " | ".join(m.content for m in messages if m.role == "tool")
        return [
            ToolCall(id="1", name="explode", arguments={}),
            ToolCall(id="2", name="nope", arguments={}),
        ]

    result = await Agent("m", model=FunctionModel(decide), tools=[explode]).run("go")
    assert "kaboom" in result.output
    assert "nope" in result.output


async def test_tuning_tool_timeout_applies_to_tools_without_their_own() -> None:
    @tool
    async def slow() -> str:
        """Sleeps."""
        await asyncio.sleep(10)
        return "late"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return messages[-1].content
        return [ToolCall(id="1", name="slow", arguments={})]

    agent = Agent("m", model=FunctionModel(decide), tools=[slow], tuning=Tuning(tool_timeout=0.05))
    result = await agent.run("go")
    assert "0.05s" in result.output


async def test_a_replayed_tool_result_answers_the_current_call_id() -> None:
    call_ids = iter(["first-id", "second-id"])
    pings = 0
    fail = True

    @tool
    def ping() -> str:
        """Ping."""
        nonlocal pings
        pings += 1
        return "pong"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            if fail:
                raise ConnectionError
            return f"{messages[-1].tool_call_id}:{messages[-1].content}"
        return [ToolCall(id=next(call_ids), name="ping", arguments={})]

    runtime = InMemoryRuntime()
    agent = Agent("m", model=FunctionModel(decide), tools=[ping], runtime=runtime)
    with pytest.raises(ConnectionError):
        await agent.run("go", session_id="s")
    # Forget the journaled model turn, so the model is asked again and names its call anew.
    for run in runtime._store.entries.values():  # type: ignore[attr-defined]
        for entries in run.values():
            for key in [k for k in entries if k[1] == "model_call_0"]:
                del entries[key]
    fail = False
    result = await agent.resume("go", session_id="s")
    assert pings == 1  # the tool call replayed by position and content
    assert result.output == "second-id:pong"


async def test_bad_construction_is_a_user_error() -> None:
    with pytest.raises(UserError):
        Agent("x", model="scripted", max_turns=0)
    with pytest.raises(UserError):
        await Agent("x", model="scripted").run(42)  # type: ignore[arg-type]


async def test_model_strings_resolve_lazily() -> None:
    agent = Agent("x", model="scripted")
    result = await agent.run("hello there")
    assert result.output
    assert agent.model.provider == "scripted"
    assert Agent("x", model="claude-opus-4-7")._model is None  # nothing built until used


async def test_without_a_journal_every_run_executes() -> None:
    model = ScriptedModel(["one", "two"])
    agent = Agent("x", model=model)
    await agent.run("a", session_id="s")
    await agent.resume("a", session_id="s")
    assert model.calls == 2


async def test_an_answer_cut_at_the_output_limit_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain answer that stopped at max_tokens ends the run as answered, as the model said
    it; the log says it is cut short (nothing else would), and a replay says nothing more."""

    def cut(messages: list[Message], tools: list[ToolSpec]) -> Any:
        return ModelResponse(text="The three steps are: first, open the", finish_reason="length")

    agent = Agent("writer", model=FunctionModel(cut), runtime=InMemoryRuntime())
    with caplog.at_level("WARNING", logger="loomflow.agent"):
        result = await agent.run("explain", session_id="s", user_id="u")
    assert result.output == "The three steps are: first, open the"
    warned = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    assert len(warned) == 1
    assert "finish_reason 'length'" in warned[0]
    assert "ModelSettings.max_tokens" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="loomflow.agent"):
        await agent.resume("explain", session_id="s", user_id="u")
    assert not [r for r in caplog.records if "cut short" in r.getMessage()]


@pytest.mark.parametrize(
    ("stop_reason", "said"),
    [
        ("refusal", "the model declined to answer, or a content filter stopped it"),
        # A turn Anthropic paused (its server tools run long): loomflow offers none, so it
        # does not continue it; the run ended as answered and nothing said so.
        ("pause_turn", "the provider paused the turn before it ended"),
    ],
)
async def test_an_anthropic_answer_that_did_not_end_is_logged(
    caplog: pytest.LogCaptureFixture, stop_reason: str, said: str
) -> None:
    with FakeAnthropicAPI(Reply(text="I can", stop_reason=stop_reason)) as api:
        model = AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="k")
        agent = Agent("writer", model=model, runtime=InMemoryRuntime())
        with caplog.at_level("WARNING", logger="loomflow.agent"):
            result = await agent.run("explain", session_id="s", user_id="u")
        await model.aclose()
    assert result.output == "I can"
    warned = [r.getMessage() for r in caplog.records if r.name == "loomflow.agent"]
    assert len(warned) == 1
    assert said in warned[0]
    assert "max_tokens" not in warned[0]
