"""Spans of agent runs, captured with the OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from loomflow.agent import Agent, RunFinished, Tuning
from loomflow.agent.hooks import Interrupt, RunHooks, RunInfo
from loomflow.errors import ReplayDivergenceError
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import AnthropicModel, FunctionModel
from loomflow.runtime import InMemoryRuntime, JournalRuntime, SessionInfo, SqliteRuntime
from loomflow.telemetry import Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.testing.providers import Failure, FakeAnthropicAPI, Reply
from loomflow.tools import ToolOutcome, tool


@tool
def lookup(order: int) -> str:
    """Look an order up."""
    return f"order {order} shipped"


@tool
def explode(order: int) -> str:
    """A tool that fails."""
    raise ValueError("warehouse offline")


def one_tool(name: str = "lookup", arguments: dict[str, Any] | None = None) -> Any:
    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"done: {messages[-1].content}"
        return [ToolCall(id="c1", name=name, arguments=arguments or {"order": 7})]

    return decide


def attrs(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})


def steps_by_name(capture: SpanCapture) -> dict[str, Any]:
    return {attrs(s)["loom.step.name"]: s for s in capture.named("loom.workflow.step")}


async def test_a_run_is_one_trace_with_steps_under_the_root_and_calls_under_steps(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    agent = Agent(
        "support",
        model=FunctionModel(one_tool()),
        tools=[lookup],
        runtime=InMemoryRuntime(),
        telemetry=telemetry,
        name="support",
    )
    result = await agent.run("where is order 7?", session_id="s-1", user_id="alice")

    [root] = capture.named("invoke_agent support")
    assert root.parent is None
    steps = steps_by_name(capture)
    tool_step = next(name for name in steps if name.startswith("tool_call_0_0_"))
    # With the episode write of the agent's default memory.
    assert set(steps) == {"model_call_0", tool_step, "model_call_1", "persist_episode_2"}
    assert {s.context.trace_id for s in capture.spans} == {root.context.trace_id}
    for step in steps.values():
        assert capture.parent_of(step) is root
        a = attrs(step)
        assert a["user.id"] == "alice"
        assert a["session.id"] == "s-1"
        assert a["gen_ai.conversation.id"] == "s-1"
        assert a["loom.step.epoch"] == 0
        assert a["loom.step.replay"] == "miss"
        assert a["loom.run.id"] == result.run_id
        assert a["loom.backend"] == "memory"
    assert attrs(steps["model_call_0"])["loom.step.kind"] == "model"
    assert attrs(steps[tool_step])["loom.step.kind"] == "tool"
    assert attrs(steps["persist_episode_2"])["loom.step.kind"] == "memory"

    chats = capture.named("chat function")
    assert [capture.parent_of(c) for c in chats] == [steps["model_call_0"], steps["model_call_1"]]
    [execution] = capture.named("execute_tool lookup")
    assert capture.parent_of(execution) is steps[tool_step]
    assert attrs(execution)["gen_ai.operation.name"] == "execute_tool"
    assert attrs(execution)["gen_ai.tool.name"] == "lookup"
    assert attrs(execution)["gen_ai.tool.call.id"] == "c1"
    # Children lie within their parents in time.
    for child in [*chats, execution]:
        parent = capture.parent_of(child)
        assert parent.start_time <= child.start_time <= child.end_time <= parent.end_time

    r = attrs(root)
    assert r["gen_ai.operation.name"] == "invoke_agent"
    assert r["gen_ai.agent.name"] == "support"
    assert r["user.id"] == "alice"
    assert r["gen_ai.conversation.id"] == "s-1"
    assert r["loom.run.id"] == result.run_id
    assert r["loom.run.outcome"] == "finished"
    assert r["loom.run.fresh_steps"] == 4
    assert r["gen_ai.usage.input_tokens"] == result.tokens_in
    assert root.status.status_code is StatusCode.UNSET


async def test_a_replayed_run_has_step_spans_marked_hit_and_no_call_spans(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    runtime = InMemoryRuntime()
    agent = Agent(
        "x", model=FunctionModel(one_tool()), tools=[lookup], runtime=runtime, telemetry=telemetry
    )
    await agent.run("go", session_id="s", user_id="bob")
    capture.clear()
    await agent.resume("go", session_id="s", user_id="bob")
    [root] = capture.named("invoke_agent agent")
    assert attrs(root)["loom.run.resumed"] is True
    steps = capture.named("loom.workflow.step")
    assert len(steps) == 4  # two model calls, the tool call, the episode write
    assert {attrs(s)["loom.step.replay"] for s in steps} == {"hit"}
    assert all(capture.parent_of(s) is root for s in steps)
    assert capture.named("chat function") == []
    assert capture.named("execute_tool lookup") == []


async def test_chat_spans_carry_the_genai_attributes_of_a_real_provider_call(
    capture: SpanCapture, telemetry: Telemetry, tmp_path: Path
) -> None:
    script = (
        Reply(tool_calls=[ToolCall(id="toolu_1", name="lookup", arguments={"order": 7})]),
        Reply(text="Order 7 shipped.", input_tokens=40, output_tokens=9, model="claude-x-1"),
    )
    runtime = SqliteRuntime(tmp_path / "journal.db")
    with FakeAnthropicAPI(*script) as api:
        model = AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="test")
        agent = Agent(
            "x",
            model=model,
            tools=[lookup],
            runtime=runtime,
            telemetry=telemetry,
            tuning=Tuning(max_tokens=256, temperature=0.2),
        )
        try:
            await agent.run("where is order 7?", session_id="s", user_id="carol")
        finally:
            await model.aclose()
            await runtime.close()
    first, second = capture.named("chat claude-opus-4-7")
    for span in (first, second):
        a = attrs(span)
        assert span.kind is trace.SpanKind.CLIENT
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "anthropic"
        assert a["gen_ai.request.model"] == "claude-opus-4-7"
        assert a["gen_ai.request.max_tokens"] == 256
        assert a["gen_ai.request.temperature"] == pytest.approx(0.2)
        assert a["gen_ai.conversation.id"] == "s"
        assert attrs(capture.parent_of(span))["loom.backend"] == "sqlite"
    assert attrs(first)["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert attrs(first)["gen_ai.usage.input_tokens"] == 12
    assert attrs(first)["gen_ai.usage.output_tokens"] == 7
    assert attrs(second)["gen_ai.response.model"] == "claude-x-1"
    assert attrs(second)["gen_ai.response.finish_reasons"] == ("stop",)
    assert attrs(second)["gen_ai.usage.input_tokens"] == 40
    assert attrs(second)["gen_ai.usage.output_tokens"] == 9


async def test_a_failed_provider_call_is_an_error_on_chat_step_and_root(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    with FakeAnthropicAPI(Failure(400, message="prompt is too long")) as api:
        model = AnthropicModel("claude-opus-4-7", base_url=api.base_url, api_key="test")
        agent = Agent("x", model=model, runtime=InMemoryRuntime(), telemetry=telemetry)
        try:
            with pytest.raises(Exception, match="prompt is too long"):
                await agent.run("hi", session_id="s")
        finally:
            await model.aclose()
    [chat] = capture.named("chat claude-opus-4-7")
    [step] = capture.named("loom.workflow.step")
    [root] = capture.named("invoke_agent agent")
    for span in (chat, step, root):
        assert span.status.status_code is StatusCode.ERROR
        assert "prompt is too long" in (span.status.description or "")
        assert attrs(span)["error.type"] == "ModelError"
    assert [e.name for e in chat.events] == ["exception"]
    assert attrs(root)["loom.run.outcome"] == "failed"
    assert "loom.step.replay" not in attrs(step)  # nothing was journaled


async def test_a_failing_tool_is_an_error_on_its_execute_tool_span(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    agent = Agent(
        "x",
        model=FunctionModel(one_tool("explode")),
        tools=[explode],
        runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )
    result = await agent.run("go", session_id="s")
    assert "warehouse offline" in result.output
    [execution] = capture.named("execute_tool explode")
    assert execution.status.status_code is StatusCode.ERROR
    assert "warehouse offline" in (execution.status.description or "")
    assert attrs(execution)["error.type"] == "tool_error"
    # The run went on: the failure was an answer for the model, not a crash.
    [root] = capture.named("invoke_agent agent")
    assert root.status.status_code is StatusCode.UNSET


async def test_a_divergence_is_marked_on_the_step_span(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    crash = {"on": True}

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool" and crash["on"]:
            raise RuntimeError("worker died")
        return one_tool()(messages, tools)

    runtime = InMemoryRuntime()
    agent = Agent(
        "x", model=FunctionModel(decide), tools=[lookup], runtime=runtime, telemetry=telemetry
    )
    with pytest.raises(RuntimeError):
        await agent.run("first prompt", session_id="s")
    crash["on"] = False
    capture.clear()
    # The run stayed open; running it with another prompt reaches model_call_0 with new inputs.
    await agent.run("another prompt", session_id="s")
    step = steps_by_name(capture)["model_call_0"]
    assert attrs(step)["loom.step.replay"] == "divergence"
    assert [e.name for e in step.events] == ["loom.replay.divergence"]

    strict = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[lookup],
        runtime=runtime,
        telemetry=telemetry,
        tuning=Tuning(strict_replay=True),
    )
    crash["on"] = True
    with pytest.raises(RuntimeError):
        await strict.run("third prompt", session_id="s2")
    capture.clear()
    with pytest.raises(ReplayDivergenceError):
        await strict.run("fourth prompt", session_id="s2")
    [step] = capture.named("loom.workflow.step")
    [root] = capture.named("invoke_agent agent")
    assert attrs(step)["loom.step.replay"] == "divergence"
    assert step.status.status_code is StatusCode.ERROR
    assert attrs(step)["error.type"] == "ReplayDivergenceError"
    assert root.status.status_code is StatusCode.ERROR


SECRET_PROMPT = "my card is 4111-1111"
SECRET_ARG = "passport-XY123"
SECRET_RESULT = "vault code 8842"


@tool
def fetch(document: str) -> str:
    """Fetch a document."""
    return f"{SECRET_RESULT} for {document}"


def _fetching(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role == "tool":
        return "all done"
    return [ToolCall(id="c1", name="fetch", arguments={"document": SECRET_ARG})]


def _recorded_text(capture: SpanCapture) -> str:
    return json.dumps(
        [[attrs(s), [dict(e.attributes or {}) for e in s.events]] for s in capture.spans],
        default=str,
    )


@pytest.mark.parametrize("opted_in", [False, True])
async def test_prompts_and_arguments_are_recorded_only_when_opted_in(
    capture: SpanCapture, opted_in: bool
) -> None:
    telemetry = Telemetry(tracer_provider=capture.provider, metrics=False, capture_content=opted_in)
    agent = Agent(
        "you fetch documents",
        model=FunctionModel(_fetching),
        tools=[fetch],
        runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )
    await agent.run(SECRET_PROMPT, session_id="s", user_id="dave")
    text = _recorded_text(capture)
    for secret in (SECRET_PROMPT, SECRET_ARG, SECRET_RESULT, "you fetch documents"):
        assert (secret in text) is opted_in, secret
    if opted_in:
        [execution] = capture.named("execute_tool fetch")
        assert json.loads(attrs(execution)["gen_ai.tool.call.arguments"]) == {
            "document": SECRET_ARG
        }
        first_chat = capture.named("chat function")[0]
        messages = json.loads(attrs(first_chat)["gen_ai.input.messages"])
        assert messages == [{"role": "user", "parts": [{"type": "text", "content": SECRET_PROMPT}]}]


def test_capture_content_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMFLOW_TELEMETRY_CAPTURE_CONTENT", "true")
    assert Telemetry(metrics=False).capture_content is True
    monkeypatch.delenv("LOOMFLOW_TELEMETRY_CAPTURE_CONTENT")
    assert Telemetry(metrics=False).capture_content is False


async def test_an_agent_used_as_a_tool_nests_its_run_under_the_execute_tool_span(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    inner = Agent(
        "researcher",
        model=FunctionModel(one_tool()),
        tools=[lookup],
        telemetry=telemetry,
        name="researcher",
    )

    def outer_decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"outer: {messages[-1].content}"
        return [ToolCall(id="o1", name="researcher", arguments={"task": "find order 7"})]

    outer = Agent(
        "lead",
        model=FunctionModel(outer_decide),
        tools=[inner.as_tool()],
        runtime=InMemoryRuntime(),
        telemetry=telemetry,
        name="lead",
    )
    await outer.run("go", session_id="s", user_id="erin")
    [lead] = capture.named("invoke_agent lead")
    [researcher] = capture.named("invoke_agent researcher")
    [delegation] = capture.named("execute_tool researcher")
    assert capture.parent_of(researcher) is delegation
    # The sub-agent shares the outer run's runtime: its steps are traced under its own root.
    inner_steps = capture.children(researcher)
    names = [attrs(s)["loom.step.name"] for s in inner_steps]
    assert names[0::2] == ["model_call_0", "model_call_1"]
    assert names[1].startswith("tool_call_0_0_")
    assert all(s.name == "loom.workflow.step" for s in inner_steps)
    assert all(attrs(s)["loom.step.path"].startswith("tool_call_0_0_") for s in inner_steps)
    [inner_tool] = capture.named("execute_tool lookup")
    assert capture.parent_of(capture.parent_of(inner_tool)) is researcher
    assert {s.context.trace_id for s in capture.spans} == {lead.context.trace_id}


async def test_parallel_tool_calls_each_get_a_step_under_the_root(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "both done"
        return [
            ToolCall(id="a", name="lookup", arguments={"order": 1}),
            ToolCall(id="b", name="lookup", arguments={"order": 2}),
        ]

    agent = Agent(
        "x", model=FunctionModel(decide), tools=[lookup], runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )  # fmt: skip
    await agent.run("go", session_id="s")
    [root] = capture.named("invoke_agent agent")
    tool_steps = [
        s for s in capture.named("loom.workflow.step") if attrs(s)["loom.step.kind"] == "tool"
    ]
    assert len(tool_steps) == 2
    assert all(capture.parent_of(s) is root for s in tool_steps)
    executions = capture.named("execute_tool lookup")
    assert {capture.parent_of(e).context.span_id for e in executions} == {
        s.context.span_id for s in tool_steps
    }


async def test_the_callers_span_is_the_parent_and_is_current_again_afterwards(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    tracer = capture.provider.get_tracer("app")
    agent = Agent(
        "x", model=FunctionModel(one_tool()), tools=[lookup], runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )  # fmt: skip
    with tracer.start_as_current_span("http request") as request:
        await agent.run("go", session_id="s")
        assert trace.get_current_span() is request
    [root] = capture.named("invoke_agent agent")
    assert capture.parent_of(root).name == "http request"


async def test_an_abandoned_stream_ends_its_spans_and_restores_the_context(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    agent = Agent(
        "x", model=FunctionModel(one_tool()), tools=[lookup], runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )  # fmt: skip
    stream = agent.stream("go", session_id="s")
    async for event in stream:
        if event.type == "model_delta":
            break  # in the middle of model_call_0's stream
    await stream.aclose()  # type: ignore[attr-defined]
    # Nothing of the run stays current in the consumer's context.
    assert not trace.get_current_span().is_recording()
    # The loop's inner generators are closed by asyncio's finalizer, in a task of their own.
    for _ in range(200):
        if len(capture.spans) == 3:
            break
        await asyncio.sleep(0.01)
    [root] = capture.named("invoke_agent agent")
    [step] = capture.named("loom.workflow.step")
    [chat] = capture.named("chat function")
    assert attrs(root)["loom.run.outcome"] == "cancelled"
    assert attrs(step)["error.type"] == "cancelled"
    assert capture.parent_of(chat) is step
    assert all(s.end_time is not None for s in (root, step, chat))


async def test_a_stream_left_without_closing_it_is_cleaned_up_without_errors(
    capture: SpanCapture,
    telemetry: Telemetry,
    tmp_path: Path,
    until_given_back: Callable[..., Awaitable[SessionInfo]],
) -> None:
    # `break` out of the stream and drop it: asyncio's finalizer closes the loop's generators
    # in tasks of their own, where resetting the run's context variables raised ValueError
    # ("created in a different Context"), skipped the rest of the cleanup and was reported as
    # "Task exception was never retrieved".
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = Agent(
        "x", model=FunctionModel(one_tool()), tools=[lookup], runtime=runtime,
        telemetry=telemetry,
    )  # fmt: skip
    try:
        async for event in agent.stream("go", session_id="s", user_id="u"):
            if event.type == "model_delta":
                break
        info = await until_given_back(runtime)
        assert errors == []
        assert info.state == "open"  # released for its caller to resume, not left running
        resumed = await agent.resume("go", session_id="s", user_id="u")
        assert not resumed.interrupted
    finally:
        loop.set_exception_handler(None)
        await runtime.close()


async def test_streaming_and_running_trace_alike(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    agent = Agent(
        "x", model=FunctionModel(one_tool()), tools=[lookup], runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )  # fmt: skip
    events = [e async for e in agent.stream("go", session_id="s")]
    assert isinstance(events[-1], RunFinished)
    [root] = capture.named("invoke_agent agent")
    assert len(capture.children(root)) == 4  # two model calls, the tool call, the episode


async def test_a_runtime_used_without_an_agent_can_be_traced(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    runtime = InMemoryRuntime()
    telemetry.instrument(runtime)
    telemetry.instrument(runtime)  # idempotent: one span per step, not two
    tracer = capture.provider.get_tracer("app")
    with tracer.start_as_current_span("nightly job"):
        async with runtime.session("batch-1", "ops"):
            assert await runtime.step("fetch_rates", lambda: 1.25) == 1.25
            chunks = [c async for c in runtime.stream_step("memory_scan", _chunks)]
    assert chunks == [1, 2]
    [job] = capture.named("nightly job")
    fetch, scan = capture.children(job)
    assert attrs(fetch)["loom.step.kind"] == "custom"
    assert attrs(fetch)["loom.step.stream"] is False
    assert attrs(scan)["loom.step.kind"] == "memory"
    assert attrs(scan)["loom.step.stream"] is True
    assert attrs(fetch)["user.id"] == "ops"


async def _chunks() -> Any:
    for n in (1, 2):
        yield n


@pytest.mark.parametrize("alone", [None, 0, 1, 2], ids=["together", "entry", "exit", "note"])
async def test_step_tracers_that_fail_never_break_a_run(
    caplog: pytest.LogCaptureFixture, alone: int | None
) -> None:
    from contextlib import contextmanager

    runtime = InMemoryRuntime()
    seen: list[str] = []

    def broken_on_entry(start: Any) -> Any:
        raise RuntimeError("tracer bug")

    @contextmanager
    def broken_on_exit(start: Any) -> Iterator[Any]:
        yield lambda event: seen.append(event.outcome)
        raise RuntimeError("exit bug")

    @contextmanager
    def broken_note(start: Any) -> Iterator[Any]:
        def note(event: Any) -> None:
            raise RuntimeError("note bug")

        yield note

    tracers = (broken_on_entry, broken_on_exit, broken_note)
    # One tracer alone takes the runtime's single-tracer path, several the general one.
    for tracer in tracers if alone is None else tracers[alone : alone + 1]:
        runtime.add_step_tracer(tracer)
    async with runtime.session("s"):
        assert await runtime.step("a", lambda: 1) == 1
        assert await runtime.step("b", lambda: 1) == 1
    async with runtime.session("s", resume=True):
        assert await runtime.step("a", lambda: 2) == 1  # replayed
    messages = [r.getMessage() for r in caplog.records]
    if alone in (None, 1):
        assert seen == ["miss", "miss", "hit"]
    if alone in (None, 0):
        assert any("failed on entry" in m for m in messages)
    if alone in (None, 1):
        assert any("failed on exit" in m for m in messages)
    if alone in (None, 2):
        assert any("note" in m and "failed" in m for m in messages)


class _IdleTracer:
    """A step tracer that says, through ``loom_idle``, whether it has anything to trace."""

    def __init__(self, idle: Any) -> None:
        self.idle = idle
        self.starts: list[str] = []

    def loom_idle(self) -> bool:
        return bool(self.idle())

    def __call__(self, start: Any) -> Any:
        from contextlib import nullcontext

        self.starts.append(start.name)
        return nullcontext()


async def test_an_idle_step_tracer_is_not_called_and_a_broken_idle_check_breaks_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    states = iter([True, False])
    tracer = _IdleTracer(lambda: next(states))
    runtime = InMemoryRuntime()
    runtime.add_step_tracer(tracer)
    async with runtime.session("s"):
        assert await runtime.step("idle", lambda: 1) == 1
        assert await runtime.step("busy", lambda: 2) == 2
    assert tracer.starts == ["busy"]  # asked first, then called only when not idle

    def broken() -> bool:
        raise RuntimeError("idle check bug")

    failing = _IdleTracer(broken)
    other = InMemoryRuntime()
    other.add_step_tracer(failing)
    async with other.session("s"):
        assert await other.step("a", lambda: 3) == 3
    assert failing.starts == []
    assert any("failed on entry" in r.getMessage() for r in caplog.records)


async def test_a_failing_step_is_recorded_and_still_raises(capture: SpanCapture) -> None:
    telemetry = Telemetry(tracer_provider=capture.provider, metrics=False)
    runtime = InMemoryRuntime()
    telemetry.instrument(runtime)

    def boom() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError):
        async with runtime.session("s"):
            await runtime.step("charge", boom)
    [step] = capture.named("loom.workflow.step")
    assert step.status.status_code is StatusCode.ERROR
    assert attrs(step)["error.type"] == "KeyError"
    assert [e.name for e in step.events] == ["exception"]


NO_SDK_SCRIPT = """
import asyncio, sys
sys.modules["opentelemetry.sdk"] = None  # as if the SDK were not installed
from opentelemetry import trace
from loomflow.agent import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime
from loomflow.telemetry import Telemetry

async def main():
    agent = Agent("x", model=ScriptedModel(["hello"]), runtime=InMemoryRuntime(),
                  telemetry=Telemetry(metrics=False))
    result = await agent.run("hi", session_id="s", user_id="u")
    assert result.output == "hello", result
    assert not trace.get_current_span().is_recording()
    try:
        from loomflow.telemetry.testing import SpanCapture
        SpanCapture()
    except ImportError as exc:
        print("HINT", exc)
    print("OK")

asyncio.run(main())
"""


def _python(script: str) -> str:
    """Run ``script`` in a fresh interpreter (its own global providers); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_without_an_sdk_telemetry_is_a_no_op() -> None:
    out = _python(NO_SDK_SCRIPT)
    assert "OK" in out
    assert "pip install 'loomflow[otel]'" in out


SDK_MID_RUN_SCRIPT = """
import asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from loomflow.agent import Agent
from loomflow.messages import ToolCall
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime
from loomflow.tools import tool

exporter = InMemorySpanExporter()

@tool
async def install() -> str:
    \"\"\"Install the SDK.\"\"\"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return "ok"

def decide(messages, tools):
    if any(m.role == "tool" for m in messages):
        return "done"
    return [ToolCall(id="c1", name="install", arguments={})]

async def main():
    agent = Agent("x", model=FunctionModel(decide), tools=[install], runtime=InMemoryRuntime())
    await agent.run("go", session_id="s1", user_id="u")
    print("FIRST", sorted({s.name for s in exporter.get_finished_spans()}))
    exporter.clear()
    await agent.run("go", session_id="s2", user_id="u")
    print("SECOND", sorted({s.name for s in exporter.get_finished_spans()}))

asyncio.run(main())
"""


def test_a_run_started_before_the_sdk_keeps_its_steps_untraced_and_the_next_run_is_traced() -> None:
    # The default telemetry decides at a run's start whether it traces: with no SDK installed
    # yet, neither the run's own spans nor its steps' are built, even once a tool installs one.
    out = _python(SDK_MID_RUN_SCRIPT)
    assert "FIRST []" in out, out
    second = next(line for line in out.splitlines() if line.startswith("SECOND"))
    assert "loom.workflow.step" in second, second
    assert "invoke_agent" in second, second


async def test_concurrent_runs_keep_their_spans_apart(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    agent = Agent(
        "x", model=FunctionModel(one_tool()), tools=[lookup], runtime=InMemoryRuntime(),
        telemetry=telemetry,
    )  # fmt: skip
    results = await asyncio.gather(
        *(agent.run("go", session_id=f"s{i}", user_id=f"u{i}") for i in range(8))
    )
    roots = capture.named("invoke_agent agent")
    assert len(roots) == 8
    for root in roots:
        children = capture.children(root)
        assert len(children) == 4  # two model calls, the tool call, the episode write
        users = {attrs(c)["user.id"] for c in children}
        assert users == {attrs(root)["user.id"]}
        run_ids = {attrs(c)["loom.run.id"] for c in children}
        assert run_ids == {attrs(root)["loom.run.id"]}
        for step in children:
            for grandchild in capture.children(step):
                assert grandchild.context.trace_id == root.context.trace_id
    assert {r.run_id for r in results} == {attrs(r)["loom.run.id"] for r in roots}


async def test_step_spans_on_every_backend_across_two_workers(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]], capture: SpanCapture
) -> None:
    crash = {"on": True}

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool" and crash["on"]:
            raise RuntimeError("worker died")
        return one_tool()(messages, tools)

    first_worker, second_worker = await runtime_factory(), await runtime_factory()
    telemetry = Telemetry(tracer_provider=capture.provider, metrics=False)
    for runtime in (first_worker, second_worker):
        agent = Agent(
            "x", model=FunctionModel(decide), tools=[lookup], runtime=runtime, telemetry=telemetry
        )
        try:
            await agent.run("go", session_id="s", user_id="frank")
        except RuntimeError:
            crash["on"] = False  # the second worker picks the open run up
    first_root, second_root = capture.named("invoke_agent agent")
    replays = [attrs(s)["loom.step.replay"] for s in capture.children(second_root)]
    assert replays == ["hit", "hit", "miss", "miss"]  # the last: the run's episode write
    assert attrs(second_root)["loom.run.resumed"] is True
    for step in capture.named("loom.workflow.step"):
        assert attrs(step)["loom.backend"] == first_worker.backend
        assert attrs(step)["loom.step.epoch"] == 0
        assert attrs(step)["user.id"] == "frank"
    assert first_root.status.status_code is StatusCode.ERROR


class BlockingGuardrail(RunHooks):
    """Runs before telemetry (guardrails come first) and stops the run on a tool result."""

    async def check_tool_result(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, outcome: ToolOutcome
    ) -> ToolOutcome:
        raise Interrupt("guardrail:pii", "a card number in a tool result")


async def test_a_tool_span_left_open_by_an_interrupt_is_closed_by_its_step(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    agent = Agent(
        "x",
        model=FunctionModel(one_tool()),
        tools=[lookup],
        runtime=InMemoryRuntime(),
        guardrails=[BlockingGuardrail()],
        telemetry=telemetry,
    )
    tracer = capture.provider.get_tracer("app")
    with tracer.start_as_current_span("request") as request:
        result = await agent.run("go", session_id="s")
        assert trace.get_current_span() is request  # the tool span did not stay current
    assert result.interruption_reason == "guardrail:pii"
    [execution] = capture.named("execute_tool lookup")
    tool_step = capture.parent_of(execution)
    assert attrs(tool_step)["loom.step.kind"] == "tool"
    assert execution.end_time is not None
    assert execution.end_time <= tool_step.end_time
    assert attrs(execution)["error.type"] == "Interrupt"
    [root] = capture.named("invoke_agent agent")
    assert attrs(root)["loom.run.outcome"] == "interrupted"
    assert attrs(root)["loom.run.interruption_reason"] == "guardrail:pii"
    assert root.status.status_code is StatusCode.UNSET


async def test_a_workflow_inside_a_callers_span_is_one_trace(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    from loomflow.agent.architectures import Workflow

    writer = Agent(
        "w", model=FunctionModel(lambda m, t: "draft"), telemetry=telemetry, name="writer"
    )
    editor = Agent(
        "e", model=FunctionModel(lambda m, t: "final"), telemetry=telemetry, name="editor"
    )
    workflow = Workflow(
        [("write", writer), ("shout", lambda text: text.upper()), ("edit", editor)],
        runtime=InMemoryRuntime(),
    )
    telemetry.instrument(workflow.runtime)
    tracer = capture.provider.get_tracer("app")
    with tracer.start_as_current_span("review workflow") as outer:
        result = await workflow.run("write it", session_id="doc-9", user_id="alice")
    assert result.output == "final"
    [review] = capture.named("review workflow")
    children = capture.children(review)
    assert [c.name for c in children] == [
        "invoke_agent writer",
        "loom.workflow.step",
        "invoke_agent editor",
    ]
    assert attrs(children[1])["loom.step.name"] == "node:shout"
    assert {s.context.trace_id for s in capture.spans} == {outer.get_span_context().trace_id}


async def test_without_a_journal_calls_hang_from_the_root(
    capture: SpanCapture, telemetry: Telemetry
) -> None:
    agent = Agent("x", model=FunctionModel(one_tool()), tools=[lookup], telemetry=telemetry)
    await agent.run("go", session_id="s")
    [root] = capture.named("invoke_agent agent")
    assert attrs(root)["loom.backend"] == "none"
    assert [s.name for s in capture.children(root)] == [
        "chat function",
        "execute_tool lookup",
        "chat function",
    ]
    assert capture.named("loom.workflow.step") == []


@pytest.mark.parametrize("opted_in", [True, False])
async def test_spans_carry_no_secret_the_audit_log_would_hide(
    capture: SpanCapture, opted_in: bool
) -> None:
    # Captured content, and error text (exported even without content capture), must not put
    # on spans what the audit log scrubs: a key-shaped string in the prompt, a configured
    # secret (one JSON would escape) in a result, a value under a sensitive key name, a card
    # number in a tool's error, and a declared sensitive argument.
    from loomflow.audit import AuditLog, InMemoryAuditStore
    from loomflow.audit.redaction import Redactor

    api_key = "sk-ant-api03-" + "q" * 40
    configured = 'corp"vault\\pass-2291'
    card = "4111 1111 1111 1111"

    @tool(sensitive=("card",))
    def pay(card: str, password: str = "") -> str:
        """Charge a card."""
        return f"charged; vault said {configured}"

    @tool
    def refund(order: str) -> str:
        """Refund an order."""
        raise RuntimeError(f"gateway rejected card {card} with {configured}")

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        done = sum(1 for m in messages if m.role == "tool")
        if done == 0:
            return [
                ToolCall(id="c1", name="pay", arguments={"card": card, "password": "hunter2xyz"})
            ]
        if done == 1:
            return [ToolCall(id="c2", name="refund", arguments={"order": "A-1"})]
        return "paid"

    audit = AuditLog(InMemoryAuditStore(), redactor=Redactor(secrets=[configured]))
    agent = Agent(
        "you take payments",
        model=FunctionModel(decide),
        tools=[pay, refund],
        runtime=InMemoryRuntime(),
        audit=audit,
        telemetry=Telemetry(
            tracer_provider=capture.provider, metrics=False, capture_content=opted_in
        ),
    )
    await agent.run(f"pay with my key {api_key}", session_id="s", user_id="erin")
    text = _recorded_text(capture)
    statuses = json.dumps([s.status.description for s in capture.spans])
    for secret in (api_key, configured, json.dumps(configured)[1:-1], card, "hunter2xyz"):
        assert secret not in text, secret
        assert secret not in statuses, secret
    [refund_span] = capture.named("execute_tool refund")
    assert "gateway rejected card [REDACTED" in (refund_span.status.description or "")
    if opted_in:
        assert "pay with my key [REDACTED" in text  # the content is there, scrubbed


async def test_a_failed_steps_span_is_scrubbed_by_the_agents_redactor(
    capture: SpanCapture,
) -> None:
    # The step span's error text went through a redactor built from settings, not the agent's:
    # a secret only the agent's audit redactor knows reached the step span (not the root's).
    from loomflow.audit import AuditLog, InMemoryAuditStore
    from loomflow.audit.redaction import Redactor

    configured = "tenant-passphrase-zebra-42"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        raise RuntimeError(f"upstream refused credentials {configured}")

    agent = Agent(
        "x",
        model=FunctionModel(decide),
        runtime=InMemoryRuntime(),
        audit=AuditLog(InMemoryAuditStore(), redactor=Redactor(secrets=[configured])),
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
        name="a",
    )
    with pytest.raises(RuntimeError):
        await agent.run("q", session_id="s", user_id="erin")

    [step] = capture.named("loom.workflow.step")
    assert step.status.status_code == StatusCode.ERROR
    [event] = [e for e in step.events if e.name == "exception"]
    message = str(dict(event.attributes or {})["exception.message"])
    assert message.startswith("upstream refused credentials [REDACTED")
    for span in capture.spans:
        exported = json.dumps(
            [span.status.description, [dict(e.attributes or {}) for e in span.events]]
        )
        assert configured not in exported, span.name


async def test_a_run_whose_audit_end_fails_still_ends_its_span_and_is_counted(
    capture: SpanCapture, tmp_path: Path
) -> None:
    # The audit hook runs before telemetry; when it could not record the run's end (its
    # SQLite file locked by another connection), telemetry never heard the run end: the root
    # span was never ended (so never exported) and loomflow_runs_total missed the failure.
    import sqlite3

    from prometheus_client import CollectorRegistry

    from loomflow.audit import AuditLog, SqliteAuditStore
    from loomflow.errors import StoreLockedError
    from loomflow.governance.guardrails import Finding, Guardrail
    from loomflow.telemetry import Metrics, _hooks

    path = tmp_path / "audit.db"
    held: list[sqlite3.Connection] = []

    class LockTheAuditLog(Guardrail):
        """Runs at the output check, just before the run's end is audited."""

        def find(self, text: str) -> list[Finding]:
            other = sqlite3.connect(path, isolation_level=None)
            other.execute("BEGIN EXCLUSIVE")
            held.append(other)
            return []

    registry = CollectorRegistry()
    store = SqliteAuditStore(path, busy_timeout_ms=50)
    agent = Agent(
        "x",
        model=FunctionModel(lambda messages, tools: "hi"),
        runtime=InMemoryRuntime(),
        audit=AuditLog(store),
        guardrails=[LockTheAuditLog("lock", stages=("output",))],
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=Metrics(registry)),
        name="a",
    )
    try:
        with pytest.raises(StoreLockedError):
            await agent.run("q", session_id="s1", user_id="erin")
    finally:
        for connection in held:
            connection.close()
        await store.close()

    [root] = capture.named("invoke_agent a")
    assert root.attributes is not None
    assert root.attributes["loom.run.outcome"] == "failed"
    assert root.status.status_code == StatusCode.ERROR
    assert "StoreLockedError" in (root.status.description or "")
    assert (
        registry.get_sample_value(
            "loomflow_runs_total", {"backend": "memory", "outcome": "failed", "resumed": "false"}
        )
        == 1.0
    )
    # ...and counted as a failure of the audit store (LoomflowStoreUnavailable), not the journal.
    assert [
        registry.get_sample_value("loomflow_store_unavailable_total", {"store": store})
        for store in ("audit", "journal")
    ] == [1.0, 0.0]
    run_id = root.attributes["loom.run.id"]
    assert run_id not in _hooks._live  # nothing of the run is left behind
    assert run_id not in _hooks._run_tracing


async def test_a_tool_name_the_model_made_up_is_redacted_and_cut_on_its_span(
    capture: SpanCapture,
) -> None:
    # A registered tool's name is the application's; a name the model made up is model output:
    # it may echo a secret the model read, and it has no length limit. Its error text was
    # already redacted; the span's name and gen_ai.tool.name showed it raw and whole.
    from loomflow.audit import AuditLog, InMemoryAuditStore
    from loomflow.audit.redaction import Redactor
    from loomflow.governance import Rule, StandardPermissions

    configured = "vault-pass-7731"
    names = [f"leak_{configured}", "x" * 5000, 'a"b\\c\nd']

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id=f"c{i}", name=n, arguments={}) for i, n in enumerate(names)]

    agent = Agent(
        "you look things up",
        model=FunctionModel(decide),
        tools=[lookup],
        runtime=InMemoryRuntime(),
        audit=AuditLog(InMemoryAuditStore(), redactor=Redactor(secrets=[configured])),
        permissions=StandardPermissions("default", [Rule.allow("*")]),
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
    )
    await agent.run("look", session_id="s", user_id="erin")
    tool_spans = [s for s in capture.spans if s.name.startswith("execute_tool")]
    assert len(tool_spans) == 3
    text = _recorded_text(capture) + json.dumps([s.name for s in capture.spans])
    assert configured not in text
    assert "x" * 100 not in text
    for span in tool_spans:
        shown = attrs(span)["gen_ai.tool.name"]
        assert len(shown) <= 64
        assert span.name == "execute_tool unknown"  # bounded: the name is the attribute's
        assert attrs(span)["error.type"] == "unknown_tool"
    assert {attrs(s)["gen_ai.tool.name"] for s in tool_spans} >= {'a"b\\c\nd', "x" * 63 + "…"}


async def test_made_up_tool_names_do_not_multiply_span_names(capture: SpanCapture) -> None:
    # Span names are what tracing backends group by (Jaeger's operations, span metrics): a
    # name per made-up tool would let a prompt-injected model create series without bound.
    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="c1", name=f"tool_{messages[-1].content}", arguments={})]

    agent = Agent(
        "you look things up",
        model=FunctionModel(decide),
        tools=[lookup],
        runtime=InMemoryRuntime(),
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
        memory=False,
    )
    for n in range(20):
        await agent.run(f"q{n}", session_id=f"s{n}", user_id="erin")
    tool_spans = [s for s in capture.spans if s.name.startswith("execute_tool")]
    assert len(tool_spans) == 20
    assert {s.name for s in tool_spans} == {"execute_tool unknown"}
    # The made-up name itself is still there to read, on the span's attribute.
    assert len({attrs(s)["gen_ai.tool.name"] for s in tool_spans}) == 20


async def test_a_permission_reason_on_the_run_span_is_redacted() -> None:
    """``loom.permission.reason`` is exported with content capture off, and a failed check's
    reason quotes its exception: it carried the card number and key of the call as they were."""
    from loomflow.governance import StandardPermissions

    card, key = "4111 1111 1111 1111", "sk-ant-api03-" + "a" * 40

    @tool
    def pay(card: str) -> str:
        """Pay by card."""
        return "paid"

    class Remote(StandardPermissions):
        def check(self, call: ToolCall, **kwargs: Any) -> Any:
            # A policy service whose error echoes the request (and the key it was sent with).
            raise RuntimeError(f"policy service refused card {call.arguments['card']} ({key})")

    capture = SpanCapture()
    agent = Agent(
        "x",
        model=FunctionModel(one_tool("pay", {"card": card})),
        tools=[pay],
        permissions=Remote(),
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False),
        name="a",
    )
    await agent.run("pay", session_id="s1", user_id="alice")

    [root] = capture.named("invoke_agent a")
    [event] = [e for e in root.events if e.name == "loom.permission.decided"]
    reason = str((event.attributes or {})["loom.permission.reason"])
    assert reason.startswith("the permission check failed (RuntimeError: policy service refused")
    assert card not in reason
    assert key not in reason
    assert "[REDACTED" in reason


async def test_a_model_name_utf8_cannot_encode_does_not_lose_the_batch_of_spans(
    otlp_receiver: tuple[str, Any],
) -> None:
    """A lone surrogate (a model name from bytes that were not UTF-8, through os.environ's
    surrogateescape) in a span name failed the OTLP encoding of the whole batch: every run's
    spans in it were lost, not only that run's."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    url, received = otlp_receiver
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(f"{url}/v1/traces")))
    telemetry = Telemetry(tracer_provider=provider, metrics=False)
    for name, model in (("odd", "gpt-\udcff"), ("plain", "gpt-4o")):
        agent = Agent(
            "x",
            model=FunctionModel(lambda messages, tools: "done", name=model),
            runtime=InMemoryRuntime(),
            telemetry=telemetry,
            name=name,
        )
        await agent.run("q", session_id="s1", user_id="u1")
    provider.shutdown()  # flushes the one batch
    names = {span.name: span for span in _exported(received)}
    assert "invoke_agent plain" in names
    assert "chat gpt-\\udcff" in names


def _exported(received: Any) -> list[Any]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    return [
        span
        for body in received.bodies
        for resource in ExportTraceServiceRequest.FromString(body).resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]


async def test_an_error_message_utf8_cannot_encode_does_not_lose_the_batch_of_spans(
    otlp_receiver: tuple[str, Any],
) -> None:
    """A tool's error naming a file whose name is not UTF-8 (os.listdir gives it lone
    surrogates) became the span's status description, which failed the OTLP encoding of the
    whole batch."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    @tool
    def read(path: str) -> str:
        """Read a file."""
        raise FileNotFoundError(f"no such file: {path}/data-\udcff.csv")

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="c1", name="read", arguments={"path": "/x"})]

    url, received = otlp_receiver
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(f"{url}/v1/traces")))
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[read],
        runtime=InMemoryRuntime(),
        telemetry=Telemetry(tracer_provider=provider, metrics=False),
        name="a",
    )
    await agent.run("q", session_id="s1", user_id="u1")
    provider.shutdown()
    spans = {span.name: span for span in _exported(received)}
    assert "invoke_agent a" in spans
    assert "data-\\udcff.csv" in spans["execute_tool read"].status.message
