"""loomflow's own failures inside a tool stop the run instead of becoming a tool error.

A tool error is journaled as the call's outcome and replayed on every resume. For a bad value
the model can pick another, that is right; for a misuse of the API (a step name used twice in
a tool), a strict replay's divergence or a store that is down it was wrong twice over: the
developer never saw the error (only the model read it), and once the code or the database was
fixed, the resume still replayed the failure. These now propagate and the call stays
unjournaled, so a resume runs it again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow import Agent, ToolCall, tool
from loomflow.agent import Tuning
from loomflow.errors import DuplicateStepError, InvalidIdError, ReplayDivergenceError
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


def _one_call_then_answer() -> FunctionModel:
    """Asks for ``work`` once, then answers with what the tool said."""

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if results:
            return f"done: {results[-1].content}"
        return [ToolCall(id="c1", name="work", arguments={"item": "A-1"})]

    return FunctionModel(decide)


class _Crash(BaseException):
    """Stands for the process dying inside the tool (not an Exception: nothing catches it)."""


async def test_a_step_name_used_twice_in_a_tool_stops_the_run_and_a_fixed_tool_resumes(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    ran: list[str] = []

    async def record(item: str) -> str:
        ran.append(item)
        return item

    @tool(name="work")
    async def buggy(item: str) -> str:
        """Do the work."""
        await runtime.step("record", record, item)
        return await runtime.step("record", record, item)  # the bug: the same name again

    @tool(name="work")
    async def fixed(item: str) -> str:
        """Do the work."""
        return await runtime.step("record", record, item)

    model = _one_call_then_answer()
    with pytest.raises(DuplicateStepError, match="record"):
        await Agent("a", model=model, tools=[buggy], runtime=runtime).run(
            "go", session_id="s", user_id="u"
        )
    # The tool call's outcome was not journaled: the fixed tool runs on resume (its first
    # step, journaled before the error, replays) and the model reads its real result.
    result = await Agent("a", model=model, tools=[fixed], runtime=runtime).resume(
        "go", session_id="s", user_id="u"
    )
    assert result.output == "done: A-1"
    assert ran == ["A-1"]
    assert "DuplicateStepError" not in str([m.content for m in result.messages])


async def test_a_strict_replay_divergence_inside_a_tool_stops_the_run(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    crash = True
    price = {"value": 10}

    async def quote(item: str, amount: int) -> str:
        return f"{item}={amount}"

    @tool(name="work")
    async def work(item: str) -> str:
        """Do the work."""
        said = await runtime.step("quote", quote, item, price["value"])
        if crash:
            raise _Crash
        return said

    model = _one_call_then_answer()
    strict = Agent(
        "a", model=model, tools=[work], runtime=runtime, tuning=Tuning(strict_replay=True)
    )
    with pytest.raises(_Crash):
        await strict.run("go", session_id="s", user_id="u")
    crash, price["value"] = False, 12  # the tool now asks its step for something else
    with pytest.raises(ReplayDivergenceError, match="quote"):
        await strict.resume("go", session_id="s", user_id="u")
    # Nothing was journaled for the call: with the old input back it replays and finishes.
    price["value"] = 10
    result = await strict.resume("go", session_id="s", user_id="u")
    assert result.output == "done: A-1=10"


async def test_a_bad_id_from_the_models_arguments_is_still_a_tool_error(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()

    async def nothing() -> str:
        return "ok"

    @tool(name="work")
    async def work(item: str) -> str:
        """Do the work, keyed by the model's item."""
        return await runtime.step("once", nothing, idempotency_key=item + "\x00")

    result = await Agent("a", model=_one_call_then_answer(), tools=[work], runtime=runtime).run(
        "go", session_id="s", user_id="u"
    )
    assert InvalidIdError.__name__ in result.output
    assert result.output.startswith("done: ")
