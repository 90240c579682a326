"""Runs started inside another run without ids work for it and replay with it.

A workflow or debate run from a tool without a session id used to make one up (a fresh
ULID), and an agent inside a ``runtime.session`` block did the same: the made-up id names the
sub-run its steps are keyed under, so the resume of the enclosing run found none of them and
ran every finished node, debater and tool call again. An agent or workflow without a runtime
inside a ``runtime.session`` block journaled nothing at all.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow import Agent, ToolCall, tool
from loomflow.agent.architectures import Debate, Workflow
from loomflow.context import get_run_context
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


class Crash(BaseException):
    """Like the process dying: no tool turns it into a tool error."""


async def test_a_workflow_run_from_a_tool_replays_with_the_agent(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    ran: list[tuple[str, str | None, str | None]] = []
    crash = True

    async def draft(text: str) -> str:
        ctx = get_run_context()
        ran.append(("draft", ctx.session_id, ctx.user_id))
        return text.upper()

    async def send(text: str) -> str:
        ran.append(("send", None, None))
        if crash:
            raise Crash
        return f"sent {text}"

    flow = Workflow([("draft", draft), ("send", send)])

    @tool
    async def mail(text: str) -> str:
        """Draft and send a mail."""
        return (await flow.run(text)).output

    def decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return messages[-1].content
        return [ToolCall(id="m", name="mail", arguments={"text": "hi"})]

    agent = Agent("a", model=FunctionModel(decides), tools=[mail], runtime=runtime)
    with pytest.raises(Crash):
        await agent.run("go", session_id="s", user_id="ana")
    crash = False
    result = await agent.resume("go", session_id="s", user_id="ana")
    assert result.output == "sent HI"
    # The draft ran once, for the agent's session and user; only the unfinished node again.
    assert ran == [("draft", "s", "ana"), ("send", None, None), ("send", None, None)]
    assert [(x.session_id, x.user_id) for x in await runtime.sessions()] == [("s", "ana")]


async def test_a_debate_and_an_agent_inside_a_session_block_replay_with_it(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    spoke: list[str] = []
    crash = True

    def debater(name: str) -> Agent:
        def speak(messages: list[Message], tools: list[ToolSpec]) -> Any:
            spoke.append(name)
            return f"{name} argues"

        # No runtime: inside the block, the block's runtime journals it.
        return Agent("debate", model=FunctionModel(speak), name=name)

    def judge(messages: list[Message], tools: list[ToolSpec]) -> Any:
        spoke.append("judge")
        if crash:
            raise Crash
        return "pro wins"

    debate = Debate(
        [debater("pro"), debater("con")],
        Agent("judge", model=FunctionModel(judge), name="judge"),
        rounds=1,
    )
    summary = debater("summary")

    async def session() -> str:
        async with runtime.session("s", "ana"):
            verdict = await debate.run("tabs or spaces")
            assert verdict.session_id == "s"
            summed = await summary.run(verdict.output)
            assert summed.session_id == "s"
            return summed.output

    with pytest.raises(Crash):
        await session()
    assert spoke == ["pro", "con", "judge"]
    crash = False
    assert await session() == "summary argues"
    assert spoke == ["pro", "con", "judge", "judge", "summary"]  # no debater spoke again
    assert [(x.session_id, x.user_id) for x in await runtime.sessions()] == [("s", "ana")]
