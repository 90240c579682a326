"""The scenarios of the replay-and-resume contract, on every journal backend."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow.agent import Agent, RunResult, ToolCallFinished
from loomflow.context import get_run_context
from loomflow.errors import SessionBusyError
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel, ScriptedModel
from loomflow.runtime import JournalRuntime, SessionInfo
from loomflow.tools import tool

Factory = Callable[..., Awaitable[JournalRuntime]]


class Ledger:
    """A side-effecting tool that records every execution."""

    def __init__(self) -> None:
        self.charges: list[int] = []

        @tool
        async def charge(amount: int) -> str:
            """Charge the customer's card.

            Args:
                amount: Amount in dollars.
            """
            self.charges.append(amount)
            return f"charged ${amount}"

        self.tool = charge


def charge_then_answer(amount: int = 7) -> Callable[[list[Message], list[ToolSpec]], Any]:
    """A model that charges once, then answers from the tool result."""

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"done: {messages[-1].content}"
        return [ToolCall(id=f"call-{len(messages)}", name="charge", arguments={"amount": amount})]

    return decide


async def test_a_second_identical_charge_in_a_later_request_charges_again(
    runtime_factory: Factory,
) -> None:
    ledger = Ledger()
    agent = Agent(
        "billing",
        model=FunctionModel(charge_then_answer()),
        tools=[ledger.tool],
        runtime=await runtime_factory(),
    )
    first = await agent.run("charge 7", session_id="s", user_id="u")
    second = await agent.run("charge 7", session_id="s", user_id="u")
    assert ledger.charges == [7, 7]
    assert first.output == second.output == "done: charged $7"
    assert second.replayed_steps == 0


async def test_a_finished_run_resumes_with_zero_model_calls(runtime_factory: Factory) -> None:
    ledger = Ledger()
    model = FunctionModel(charge_then_answer())
    agent = Agent("billing", model=model, tools=[ledger.tool], runtime=await runtime_factory())
    first = await agent.run("charge 7", session_id="s", user_id="u")
    calls = model.calls
    resumed = await agent.resume("charge 7", session_id="s", user_id="u")
    assert model.calls == calls
    assert ledger.charges == [7]
    assert resumed.output == first.output
    assert resumed.replayed_steps == 4  # two model calls, the charge, the episode write
    assert resumed.fresh_steps == 0
    assert (resumed.tokens_in, resumed.tokens_out) == (first.tokens_in, first.tokens_out)


async def test_another_user_on_the_same_session_replays_nothing(
    runtime_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A resume is a run of (session, user): bob has none there, so his starts afresh, and
    says so in the log (a resume that left out or mistyped the user runs the tools again)."""
    ledger = Ledger()
    model = FunctionModel(charge_then_answer())
    agent = Agent("billing", model=model, tools=[ledger.tool], runtime=await runtime_factory())
    await agent.run("charge 7", session_id="shared", user_id="alice")
    assert "no run to resume" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="loomflow.runtime"):
        bob = await agent.resume("charge 7", session_id="shared", user_id="bob")
        again = await agent.resume("charge 7", session_id="shared", user_id="bob")
    assert ledger.charges == [7, 7]
    assert bob.replayed_steps == 0
    assert again.replayed_steps > 0  # bob's own run now, replayed
    assert model.calls == 4
    [warned] = [r for r in caplog.records if "no run to resume" in r.getMessage()]
    assert warned.getMessage() == (
        "session 'shared' of user 'bob' has no run to resume: a new run starts, and its steps "
        "run (check the session id and user_id of the run to resume)"
    )


async def test_a_new_prompt_on_an_old_session_runs_fresh(runtime_factory: Factory) -> None:
    ledger = Ledger()
    model = FunctionModel(charge_then_answer())
    agent = Agent("billing", model=model, tools=[ledger.tool], runtime=await runtime_factory())
    await agent.run("charge 7", session_id="s", user_id="u")
    other = await agent.run("charge 7 again, please", session_id="s", user_id="u")
    assert other.replayed_steps == 0
    assert ledger.charges == [7, 7]
    # Resuming with another prompt: the model calls' inputs changed, so they run fresh (and
    # count as divergences); a tool call at the same position with the same arguments is the
    # same journal key and replays, as the position-plus-content rule says.
    calls = model.calls
    resumed = await agent.resume("something else entirely", session_id="s", user_id="u")
    assert model.calls == calls + 2
    assert resumed.fresh_steps == 3  # and the run's episode, rewritten in place
    assert ledger.charges == [7, 7]


async def test_a_raised_run_resumes_without_rerunning_tools_or_model_calls(
    runtime_factory: Factory,
) -> None:
    ledger = Ledger()
    fail = True

    def flaky(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool" and fail:
            raise ConnectionError("provider went away")
        return charge_then_answer()(messages, tools)

    model = FunctionModel(flaky)
    agent = Agent("billing", model=model, tools=[ledger.tool], runtime=await runtime_factory())
    try:
        await agent.run("charge 7", session_id="s", user_id="u")
    except ConnectionError:
        pass
    else:
        raise AssertionError("the run should have failed")
    assert ledger.charges == [7]
    fail = False
    calls = model.calls
    resumed = await agent.resume("charge 7", session_id="s", user_id="u")
    assert resumed.output == "done: charged $7"
    assert ledger.charges == [7]
    assert model.calls == calls + 1  # only the call that failed runs again
    assert resumed.replayed_steps == 2


async def test_two_concurrent_runs_on_one_session_take_turns(runtime_factory: Factory) -> None:
    inside = 0
    overlap = False

    @tool
    async def slow(n: int) -> int:
        """Do slow work."""
        nonlocal inside, overlap
        inside += 1
        overlap = overlap or inside > 1
        await asyncio.sleep(0.02)
        inside -= 1
        return n

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "ok"
        return [ToolCall(id="c", name="slow", arguments={"n": 1})]

    agents = [
        Agent("w", model=FunctionModel(decide), tools=[slow], runtime=await runtime_factory())
        for _ in range(2)
    ]
    results = await asyncio.gather(
        *(a.run("go", session_id="s", user_id="u") for a in agents for _ in range(2))
    )
    assert not overlap
    assert all(r.output == "ok" for r in results)


async def test_a_sub_agents_tool_calls_replay_when_the_outer_run_resumes(
    runtime_factory: Factory,
) -> None:
    ledger = Ledger()
    runtime = await runtime_factory()
    worker_model = FunctionModel(charge_then_answer(3))
    worker = Agent("worker", model=worker_model, tools=[ledger.tool], name="billing_worker")
    fail = True

    def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            if fail:
                raise ConnectionError("lead lost its provider")
            return f"lead: {messages[-1].content}"
        return [ToolCall(id="w1", name="billing_worker", arguments={"task": "charge 3"})]

    lead = Agent(
        "lead", model=FunctionModel(lead_decides), tools=[worker.as_tool()], runtime=runtime
    )
    with contextlib.suppress(ConnectionError):
        await lead.run("bill the customer", session_id="s", user_id="u")
    assert ledger.charges == [3]
    fail = False
    result = await lead.resume("bill the customer", session_id="s", user_id="u")
    assert result.output == "lead: done: charged $3"
    assert ledger.charges == [3]  # the sub-agent's charge replayed with the outer tool call


async def test_run_and_stream_replay_each_others_model_calls(runtime_factory: Factory) -> None:
    ledger = Ledger()
    model = FunctionModel(charge_then_answer())
    agent = Agent("billing", model=model, tools=[ledger.tool], runtime=await runtime_factory())
    await agent.run("charge 7", session_id="s", user_id="u")
    calls = model.calls
    events = [e async for e in agent._events("charge 7", "s", "u", None, resume=True)]
    result: RunResult = events[-1].result  # type: ignore[union-attr]
    assert model.calls == calls
    assert result.replayed_steps == 4  # with the episode write
    replays = [e for e in events if getattr(e, "replayed", None) is not None]
    assert replays
    assert all(e.replayed for e in replays)  # type: ignore[union-attr]


async def test_a_stream_dropped_without_closing_leaves_its_run_for_a_resume(
    runtime_factory: Factory, until_given_back: Callable[..., Awaitable[SessionInfo]]
) -> None:
    # The stream used to leave its run's context variables in the reader's context: the
    # resume then ran as a sub-run of the dead run, charged again under a sub-run path, left
    # the session open, and (once the dead run's lease ran low) raised OwnershipLostError.
    ledger = Ledger()
    runtime = await runtime_factory(lease_seconds=1.0)
    agent = Agent(
        "billing", model=FunctionModel(charge_then_answer()), tools=[ledger.tool], runtime=runtime
    )
    async for event in agent.stream("charge 7", session_id="s", user_id="u"):
        if isinstance(event, ToolCallFinished):
            break
    await until_given_back(runtime)
    assert get_run_context().run_id is None  # nothing of the run is left in our context
    await asyncio.sleep(0.7)  # the dead run's lease is down to its last third
    resumed = await agent.resume("charge 7", session_id="s", user_id="u")
    assert ledger.charges == [7]
    assert resumed.output == "done: charged $7"
    assert resumed.replayed_steps == 2  # the first model call and the charge
    assert {e.path for e in await runtime.entries("s", "u")} == {()}
    [info] = await runtime.sessions(session_id="s")
    assert info.state == "finished"


async def test_a_stream_kept_unfinished_holds_its_session_until_closed(
    runtime_factory: Factory,
) -> None:
    ledger = Ledger()
    runtime = await runtime_factory(turn_timeout=0.2)
    agent = Agent(
        "billing", model=FunctionModel(charge_then_answer()), tools=[ledger.tool], runtime=runtime
    )
    stream = agent.stream("charge 7", session_id="s", user_id="u")
    async for event in stream:
        if isinstance(event, ToolCallFinished):
            break
    with pytest.raises(SessionBusyError):  # its own run, not a sub-run of the one in progress
        await agent.resume("charge 7", session_id="s", user_id="u")
    await stream.aclose()  # type: ignore[attr-defined]
    resumed = await agent.resume("charge 7", session_id="s", user_id="u")
    assert ledger.charges == [7]
    assert resumed.replayed_steps == 2


async def test_scripted_run_stops_at_max_turns(runtime_factory: Factory) -> None:
    ledger = Ledger()
    loop = [ToolCall(id="c", name="charge", arguments={"amount": 1})]
    agent = Agent(
        "billing",
        model=ScriptedModel([loop] * 4),
        tools=[ledger.tool],
        runtime=await runtime_factory(),
        max_turns=2,
    )
    result = await agent.run("loop", session_id="s", user_id="u")
    assert result.interrupted
    assert result.interruption_reason == "max_turns"
    assert result.turns == 2
    # An interrupted result is a return: the next run is a new one.
    again = await agent.run("loop", session_id="s", user_id="u")
    assert again.replayed_steps == 0
