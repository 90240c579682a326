"""An agent built without ``memory=`` remembers its sessions, as the reference example shows.

The default keeps episodes beside the journal (or in process without one), per (session, user);
``memory=False`` turns it off.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent
from loomflow.config import Settings
from loomflow.errors import MigrationError, UserError
from loomflow.memory import InMemoryMemory, SqlMemoryStore, memory_for
from loomflow.messages import Message
from loomflow.models import ScriptedModel
from loomflow.runtime import InMemoryRuntime, JournalRuntime, SqliteRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]
WORKER = Path(__file__).with_name("_session_worker.py")
HELLO, ASK = "Hi, I'm Alice.", "What did I just say?"


def alice_model() -> ScriptedModel:
    # One script for the whole conversation: the second run's request holds the first run's
    # answer (through memory), so it gets the second turn.
    return ScriptedModel(["Hello, Alice.", "You said you're Alice."])


def users_said(messages: list[Message]) -> list[str]:
    return [m.content for m in messages if m.role == "user"]


async def test_the_reference_session_example_remembers(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    model = alice_model()
    agent = Agent("You are a concise assistant.", model=model, runtime=runtime)
    await agent.run(HELLO, session_id="conv_42", user_id="alice")
    second = await agent.run(ASK, session_id="conv_42", user_id="alice")
    assert users_said(model.requests[1]) == [HELLO, ASK]
    assert second.output == "You said you're Alice."
    # The episodes live beside the journal: another worker on it sees them.
    other = memory_for(await runtime_factory())
    episodes = await other.episodes("conv_42", user_id="alice")
    assert [users_said(e.messages) for e in episodes] == [[HELLO], [ASK]]
    # Resuming the finished run replays its episode write instead of adding one.
    await agent.resume(ASK, session_id="conv_42", user_id="alice")
    assert len(await other.episodes("conv_42", user_id="alice")) == 2


async def test_users_and_sessions_never_share_a_conversation(runtime_factory: Factory) -> None:
    agent = Agent("x", model=ScriptedModel(default="ok"), runtime=await runtime_factory())
    await agent.run(HELLO, session_id="conv_42", user_id="alice")
    bob = await agent.run(ASK, session_id="conv_42", user_id="bob")
    fresh = await agent.run(ASK, session_id="conv_43", user_id="alice")
    anonymous = await agent.run(ASK, session_id="conv_42")
    for result in (bob, fresh, anonymous):
        assert users_said(result.messages) == [ASK]


async def test_without_a_runtime_the_agent_remembers_in_process() -> None:
    model = alice_model()
    agent = Agent("You are a concise assistant.", model=model)
    assert isinstance(agent.memory, InMemoryMemory)
    await agent.run(HELLO, session_id="conv_42", user_id="alice")
    second = await agent.run(ASK, session_id="conv_42", user_id="alice")
    assert second.output == "You said you're Alice."
    assert users_said(model.requests[1]) == [HELLO, ASK]


async def test_memory_false_keeps_no_episodes(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    model = ScriptedModel(default="ok")
    agent = Agent("x", model=model, runtime=runtime, memory=False)
    assert agent.memory is None
    await agent.run(HELLO, session_id="conv_42", user_id="alice")
    await agent.run(ASK, session_id="conv_42", user_id="alice")
    assert users_said(model.requests[1]) == [ASK]
    entries = await runtime.entries("conv_42", "alice")
    assert not [e for e in entries if e.name.startswith("persist_episode")]
    assert await memory_for(runtime).episodes("conv_42", user_id="alice") == []


def test_a_second_process_remembers_the_first(tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"

    def turn(index: int) -> dict[str, object]:
        done = subprocess.run(
            [sys.executable, str(WORKER), str(journal), str(index)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        summary: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        return summary

    assert turn(0) == {"output": "Hello, Alice.", "user_messages_sent": [HELLO]}
    assert turn(1) == {"output": "You said you're Alice.", "user_messages_sent": [HELLO, ASK]}


async def test_clones_share_or_move_the_default_memory(tmp_path: Path) -> None:
    runtime, other = SqliteRuntime(tmp_path / "a.db"), SqliteRuntime(tmp_path / "b.db")
    try:
        agent = Agent("x", model="scripted", runtime=runtime)
        assert agent.memory is not None
        assert isinstance(agent.memory.store, SqlMemoryStore)
        assert agent.memory.store.db is runtime.database
        assert agent.clone(name="twin").memory is agent.memory
        moved = agent.clone(runtime=other).memory
        assert moved is not None
        assert isinstance(moved.store, SqlMemoryStore)
        assert moved.store.db is other.database  # beside the clone's own journal
        back = agent.clone(runtime=other).clone(runtime=runtime).memory
        assert back is not None
        assert back.store is agent.memory.store  # it still follows the runtime
        off = agent.clone(memory=False)
        assert off.memory is None
        assert off.clone().memory is None
        assert off.clone(runtime=other).memory is None  # off stays off
        mine = InMemoryMemory()
        assert agent.clone(memory=mine).clone(runtime=other).memory is mine
        # Without a runtime the clone shares the in-process memory too.
        alone = Agent("x", model="scripted")
        assert alone.clone(name="twin").memory is alone.memory
    finally:
        await runtime.close()
        await other.close()


async def test_from_settings_keeps_memory_beside_its_journal(tmp_path: Path) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    async with Agent.from_settings("x", model=alice_model(), settings=settings) as agent:
        assert agent.memory is not None
        assert isinstance(agent.memory.store, SqlMemoryStore)
        assert agent.memory.store.db is getattr(agent.runtime, "database", None)
        await agent.run(HELLO, session_id="conv_42", user_id="alice")
        second = await agent.run(ASK, session_id="conv_42", user_id="alice")
        assert second.output == "You said you're Alice."
    async with Agent.from_settings("x", model="scripted", settings=settings, memory=False) as off:
        assert off.memory is None


async def test_a_runtime_memory_cannot_live_beside_keeps_it_in_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Homemade(JournalRuntime):
        backend = "homemade"

    runtime = Homemade(InMemoryRuntime()._store)
    with caplog.at_level(logging.WARNING, logger="loomflow.agent"):
        agent = Agent("x", model="scripted", runtime=runtime)
    assert isinstance(agent.memory, InMemoryMemory)
    assert "kept in this process only" in caplog.text


def test_memory_must_be_a_memory_none_or_false() -> None:
    with pytest.raises(UserError, match="False for none"):
        Agent("x", model="scripted", memory=True)  # type: ignore[arg-type]


async def test_without_auto_migration_the_default_memory_says_to_migrate(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db", auto_migrate=False)
    try:
        await runtime.migrate()  # the journal only, as a deploy that predates memory did
        agent = Agent("x", model=alice_model(), runtime=runtime)
        with pytest.raises(MigrationError, match=r"memory schema.*loomflow migrate"):
            await agent.run(HELLO, session_id="conv_42", user_id="alice")
        await memory_for(runtime).migrate()  # what `loomflow migrate` does
        done = await agent.run(HELLO, session_id="conv_42", user_id="alice")
        assert done.output == "Hello, Alice."
    finally:
        await runtime.close()


async def test_the_first_run_of_a_session_does_not_ask_memory(runtime_factory: Factory) -> None:
    """No run journals below epoch 0, so a session's first run (and its replay) recalls
    nothing without a query; its next run asks once."""
    runtime = await runtime_factory()
    agent = Agent("x", model=alice_model(), runtime=runtime)
    store = agent.memory.store  # type: ignore[union-attr]
    asked: list[int | None] = []
    episodes = store.episodes

    async def counted(*args: object, before_epoch: int | None, **kwargs: Any) -> object:
        asked.append(before_epoch)
        return await episodes(*args, before_epoch=before_epoch, **kwargs)

    store.episodes = counted
    await agent.run(HELLO, session_id="conv_42", user_id="alice")
    await agent.resume(HELLO, session_id="conv_42", user_id="alice")
    assert asked == []
    second = await agent.run(ASK, session_id="conv_42", user_id="alice")
    assert asked == [1]
    assert users_said(second.messages) == [HELLO, ASK]
