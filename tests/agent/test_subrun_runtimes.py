"""A sub-agent or team worker with a runtime object of its own journals under its parent's run.

It used to wait for the (session, user) turn its parent holds, give up after ``turn_timeout``
and hand the parent's model a SessionBusyError; the sub-agent never ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent, ToolCall
from loomflow.agent.architectures import Team
from loomflow.config import Settings
from loomflow.errors import ConfigurationError
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime, JournalRuntime, SqliteRuntime
from loomflow.tools import tool

Factory = Callable[..., Awaitable[JournalRuntime]]


class Crash(Exception):
    pass


class Scenario:
    """A parent that asks a child (as a tool); the child books a room (a side effect)."""

    def __init__(self) -> None:
        self.booked: list[str] = []
        self.crash = True
        self.parent_saw: list[str] = []

        @tool
        def book(room: str) -> str:
            """Book a room."""
            self.booked.append(room)
            return f"booked {room}"

        self.book = book

    def child_decides(self, messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return f"child: {messages[-1].content}"
        return [ToolCall(id="b", name="book", arguments={"room": messages[-1].content})]

    def parent_decides(self, messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            self.parent_saw.append(messages[-1].content)
            if self.crash:
                raise Crash
            return f"parent: {messages[-1].content}"
        name = tools[0].name
        return [ToolCall(id="a", name=name, arguments={"task": "blue room"})]


async def _crash_then_resume(run: Callable[[], Awaitable[Any]], s: Scenario, resume: Any) -> Any:
    with pytest.raises(Crash):
        await run()
    assert s.booked == ["blue room"]
    assert s.parent_saw == ["child: booked blue room"]  # not SessionBusyError
    s.crash = False
    result = await resume()
    assert s.booked == ["blue room"]  # the child's tool replayed under the parent's run
    return result


async def test_a_sub_agent_with_its_own_runtime_object_runs_under_the_parent(
    runtime_factory: Factory,
) -> None:
    s = Scenario()
    # Short waits: the old behaviour (wait for the parent's turn) fails fast.
    parent_rt = await runtime_factory(turn_timeout=1.0)
    child_rt = await runtime_factory(turn_timeout=1.0)
    assert parent_rt is not child_rt
    child = Agent("c", model=FunctionModel(s.child_decides), tools=[s.book], runtime=child_rt)
    parent = Agent(
        "p", model=FunctionModel(s.parent_decides), tools=[child.as_tool()], runtime=parent_rt
    )
    result = await _crash_then_resume(
        lambda: parent.run("go", session_id="s", user_id="u"),
        s,
        lambda: parent.resume("go", session_id="s", user_id="u"),
    )
    assert result.output == "parent: child: booked blue room"
    # One (session, user), one journal: the child's steps are keyed under the parent's tool call.
    sessions = await parent_rt.sessions()
    assert [(x.session_id, x.user_id) for x in sessions] == [("s", "u")]
    paths = {e.path for e in await parent_rt.entries("s", "u")}
    assert any(len(p) == 2 and p[1] == "run:s#0" for p in paths), paths


async def test_a_team_worker_with_its_own_runtime_object_runs_under_the_lead(
    runtime_factory: Factory,
) -> None:
    s = Scenario()
    lead_rt = await runtime_factory(turn_timeout=1.0)
    worker_rt = await runtime_factory(turn_timeout=1.0)
    worker = Agent(
        "w", model=FunctionModel(s.child_decides), tools=[s.book], runtime=worker_rt, name="desk"
    )
    lead = Agent("lead", model=FunctionModel(s.parent_decides), runtime=lead_rt)
    team = Team(lead, [worker])
    result = await _crash_then_resume(
        lambda: team.run("go", session_id="s", user_id="u"),
        s,
        lambda: team.resume("go", session_id="s", user_id="u"),
    )
    assert result.output == "parent: child: booked blue room"


async def _two_agents_from_settings(settings: Settings, child_settings: Settings) -> None:
    s = Scenario()
    async with (
        Agent.from_settings(
            "child", model=FunctionModel(s.child_decides), tools=[s.book], settings=child_settings
        ) as child,
        Agent.from_settings(
            "parent",
            model=FunctionModel(s.parent_decides),
            tools=[child.as_tool()],
            settings=settings,
        ) as parent,
    ):
        assert parent.runtime is not child.runtime
        result = await _crash_then_resume(
            lambda: parent.run("go", session_id="s", user_id="u"),
            s,
            lambda: parent.resume("go", session_id="s", user_id="u"),
        )
        assert result.output == "parent: child: booked blue room"


async def test_two_from_settings_agents_on_one_sqlite_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    # Spelled differently (relative, and absolute through a symlink): one file, one journal.
    await _two_agents_from_settings(
        Settings(runtime_url="sqlite:///data/j.db", turn_timeout_seconds=1.0),
        Settings(runtime_url=f"sqlite:///{tmp_path / 'link' / 'j.db'}", turn_timeout_seconds=1.0),
    )


@pytest.mark.postgres
async def test_two_from_settings_agents_on_one_postgres_database(pg_dsn: str) -> None:
    settings = Settings(runtime_url=pg_dsn, turn_timeout_seconds=1.0)
    await _two_agents_from_settings(settings, settings)


@pytest.mark.postgres
async def test_a_sub_agent_on_another_postgres_database_is_refused(pg_dsn: str) -> None:
    import asyncpg

    from loomflow.runtime import PostgresRuntime

    # Same server, same credentials, another database: a sub-run cannot be keyed across them.
    base, _, name = pg_dsn.rpartition("/")
    other = f"{name}_other"
    admin = await asyncpg.connect(f"{base}/postgres")
    await admin.execute(f'CREATE DATABASE "{other}"')
    parent_rt, child_rt = PostgresRuntime(pg_dsn), PostgresRuntime(f"{base}/{other}")
    try:
        await child_rt.migrate()  # even with the same tables, it is another journal
        await _refused(parent_rt, child_rt)
    finally:
        await parent_rt.close()
        await child_rt.close()
        await admin.execute(f'DROP DATABASE "{other}" WITH (FORCE)')
        await admin.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_sub_agent_on_another_journal_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    parent_rt: JournalRuntime
    child_rt: JournalRuntime
    if kind == "memory":
        parent_rt, child_rt = InMemoryRuntime(), InMemoryRuntime()
    else:
        parent_rt, child_rt = SqliteRuntime(tmp_path / "a.db"), SqliteRuntime(tmp_path / "b.db")
    try:
        await _refused(parent_rt, child_rt)
    finally:
        await parent_rt.close()
        await child_rt.close()


async def _refused(parent_rt: JournalRuntime, child_rt: JournalRuntime) -> None:
    s = Scenario()
    child = Agent("c", model=FunctionModel(s.child_decides), tools=[s.book], runtime=child_rt)
    parent = Agent(
        "p", model=FunctionModel(s.parent_decides), tools=[child.as_tool()], runtime=parent_rt
    )
    with pytest.raises(ConfigurationError, match="a run is open on another journal"):
        await parent.run("go", session_id="s", user_id="u")
    assert s.booked == []
    assert s.parent_saw == []  # a configuration error, not a tool error for the model


async def test_two_from_settings_agents_on_memory_urls_are_two_journals() -> None:
    # Each memory:// runtime is a journal of its own (it lives as long as its object), so a
    # sub-agent built that way is refused rather than silently journaled apart.
    settings = Settings(runtime_url="memory://", turn_timeout_seconds=1.0)
    s = Scenario()
    async with (
        Agent.from_settings(
            "child", model=FunctionModel(s.child_decides), tools=[s.book], settings=settings
        ) as child,
        Agent.from_settings(
            "parent",
            model=FunctionModel(s.parent_decides),
            tools=[child.as_tool()],
            settings=settings,
        ) as parent,
    ):
        with pytest.raises(ConfigurationError, match="another journal"):
            await parent.run("go", session_id="s", user_id="u")
    assert s.booked == []


async def test_runs_started_together_keep_their_positions_whichever_joins_first(
    runtime_factory: Factory,
) -> None:
    """Sub-agents with runtime objects of their own, started together inside one run, are
    keyed in the order they started. The occurrence number of each one's sub-run used to be
    taken after joining the enclosing run's runtime, which reads the database on PostgreSQL:
    a runtime that had joined before got its number first, so a resume in a fresh process
    (where neither had) could swap the two and run both again."""
    effects: list[str] = []

    def agent(name: str, runtime: JournalRuntime) -> Agent:
        @tool
        def effect(tag: str) -> str:
            """Do something once."""
            effects.append(tag)
            return f"did {tag}"

        def decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
            if messages[-1].role == "tool":
                return f"{name}: {messages[-1].content}"
            return [ToolCall(id="e", name="effect", arguments={"tag": name})]

        return Agent("a", model=FunctionModel(decides), tools=[effect], runtime=runtime, name=name)

    async def both(outer: JournalRuntime, first: Agent, second: Agent, *, crash: bool) -> None:
        async with outer.session("s", "u"):
            await asyncio.gather(
                first.run("x", session_id="s", user_id="u"),
                second.run("y", session_id="s", user_id="u"),
            )
            if crash:
                raise Crash

    outer, b_rt, c_rt = [await runtime_factory() for _ in range(3)]
    b, c = agent("b", b_rt), agent("c", c_rt)
    async with outer.session("warm", "u"):  # c's runtime joins the outer one beforehand
        await c.run("warm-up", session_id="warm", user_id="u")
    effects.clear()
    with pytest.raises(Crash):
        await both(outer, b, c, crash=True)
    assert sorted(effects) == ["b", "c"]
    # As after a restart: runtime objects that have joined nothing yet.
    outer, b_rt, c_rt = [await runtime_factory() for _ in range(3)]
    await both(outer, agent("b", b_rt), agent("c", c_rt), crash=False)
    assert sorted(effects) == ["b", "c"]  # both replayed
