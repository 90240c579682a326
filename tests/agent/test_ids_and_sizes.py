"""Hostile ids and oversized tool results at the agent's entry points, on every backend."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow import Agent, InvalidIdError, ToolCall
from loomflow.agent.architectures import Debate, Team, Workflow
from loomflow.config import Settings
from loomflow.errors import BudgetUnavailableError, StoreUnavailableError
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime
from loomflow.tools import tool

Factory = Callable[..., Awaitable[JournalRuntime]]


class Crash(Exception):
    pass


def _charging_agent(runtime: JournalRuntime | None, charges: list[str]) -> Agent:
    @tool
    def charge(card: str) -> str:
        """Charge a card."""
        charges.append(card)
        return "charged"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="c", name="charge", arguments={"card": "4242"})]

    return Agent("pay", model=FunctionModel(decide), tools=[charge], runtime=runtime)


@pytest.mark.parametrize(
    ("session_id", "user_id", "field"),
    [
        ("", "ana", "session_id"),
        ("s-1", "", "user_id"),
        ("s-1", "x" * 3000, "user_id"),
        ("s\x00", "ana", "session_id"),
    ],
    ids=["empty-session", "empty-user", "3000-char-user", "nul-session"],
)
async def test_a_redelivered_message_with_a_bad_id_runs_nothing(
    runtime_factory: Factory, session_id: str, user_id: str, field: str
) -> None:
    runtime = await runtime_factory()
    charges: list[str] = []
    agent = _charging_agent(runtime, charges)
    for _ in range(2):  # the queue delivers the message twice
        with pytest.raises(InvalidIdError) as info:
            await agent.run("pay", session_id=session_id, user_id=user_id)
        assert info.value.field == field
        with pytest.raises(InvalidIdError):
            await agent.resume("pay", session_id=session_id, user_id=user_id)
    assert charges == []
    assert await runtime.sessions() == []


async def test_architectures_and_forks_refuse_empty_ids(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    charges: list[str] = []
    agent = _charging_agent(runtime, charges)
    with pytest.raises(InvalidIdError, match="session_id must not be empty"):
        await Team(agent, [_charging_agent(None, charges).clone(name="w")]).run("x", session_id="")
    with pytest.raises(InvalidIdError, match="session_id"):
        await Debate([agent], agent, runtime=runtime).run("x", session_id="")
    with pytest.raises(InvalidIdError, match="user_id"):
        await Workflow([("a", agent)], runtime=runtime).run("x", session_id="s", user_id="")
    with pytest.raises(InvalidIdError, match="fork_session_id"):
        await agent.resume("x", session_id="s", from_checkpoint="c", fork_session_id="")
    assert charges == []


@pytest.mark.postgres
async def test_a_long_user_id_on_postgres_is_a_user_error_not_an_outage(pg_dsn: str) -> None:
    # It used to reach the btree index and come back as StoreUnavailableError (journal) or
    # BudgetUnavailableError (budget), which read like the database being down.
    charges: list[str] = []
    settings = Settings(runtime_url=pg_dsn)
    async with Agent.from_settings(
        "pay", model=_charging_agent(None, charges).model, settings=settings
    ) as agent:
        with pytest.raises(InvalidIdError, match="user_id is 3000 bytes") as info:
            await agent.run("pay", session_id="s-1", user_id="u" * 3000)
        assert not isinstance(info.value, StoreUnavailableError | BudgetUnavailableError)
        result = await agent.run("pay", session_id="s-1", user_id="u" * 256)
        assert result.output == "done"


async def test_a_tool_result_over_the_cap_is_a_journaled_tool_error(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory(max_payload_bytes=4096)
    fetched: list[int] = []
    crash = True

    @tool
    def export(table: str) -> str:
        """Export a table (a side effect: it bills the warehouse)."""
        fetched.append(1)
        return "row\n" * 5000  # 20 kB

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            if crash:
                raise Crash  # the process dies after the tool ran
            return f"saw: {messages[-1].content}"
        return [ToolCall(id="c", name="export", arguments={"table": "orders"})]

    agent = Agent("a", model=FunctionModel(decide), tools=[export], runtime=runtime)
    with pytest.raises(Crash):
        await agent.run("export orders", session_id="s", user_id="u")
    assert fetched == [1]
    crash = False
    result = await agent.resume("export orders", session_id="s", user_id="u")
    assert fetched == [1]  # replayed, not run again (it used to fail on every resume)
    assert result.output.startswith("saw: Error: tool 'export' returned ")
    assert "more than the 4096 bytes a step may store (max_payload_bytes)" in result.output
    tool_message = next(m for m in result.messages if m.role == "tool")
    assert tool_message.is_error
    assert result.replayed_steps == 2  # model_call_0 and the tool's error


@pytest.mark.parametrize("serializer", ["json", "pickle"])
async def test_a_tool_result_is_encoded_once_on_its_way_to_the_journal(
    runtime_factory: Factory, monkeypatch: pytest.MonkeyPatch, serializer: str
) -> None:
    from loomflow.runtime import codec
    from loomflow.tools import ToolOutcome

    runtime = await runtime_factory(serializer=serializer)
    rows = [{"id": i, "name": f"row {i}", "tags": ["a", "b"]} for i in range(50)]

    @tool
    def export(table: str) -> list[dict[str, Any]]:
        """Export a table."""
        return rows

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"saw {len(messages[-1].content)} characters"
        return [ToolCall(id="c", name="export", arguments={"table": "orders"})]

    outcomes: list[ToolOutcome] = []
    dumps = codec.dumps

    def counting_dumps(value: Any) -> bytes:
        if isinstance(value, ToolOutcome):
            outcomes.append(value)
        return dumps(value)

    monkeypatch.setattr(codec, "dumps", counting_dumps)
    agent = Agent("a", model=FunctionModel(decide), tools=[export], runtime=runtime)
    first = await agent.run("export orders", session_id="s", user_id="u")
    # Sized against max_payload_bytes, then stored as that same encoding (with the pickle
    # serializer the journal pickles it instead).
    assert len(outcomes) == 1
    again = await agent.resume("export orders", session_id="s", user_id="u")
    assert again.fresh_steps == 0
    assert again.output == first.output
    assert [m.content for m in again.messages] == [m.content for m in first.messages]
