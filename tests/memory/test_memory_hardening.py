"""Memory on real SQLite and PostgreSQL: secrets kept out of facts and blocks, and a recall
bounded in bytes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.audit import AuditLog, InMemoryAuditStore
from loomflow.config import Settings
from loomflow.errors import MemoryEntryTooLargeError, UserError
from loomflow.memory import (
    InMemoryMemory,
    Memory,
    PostgresMemory,
    SqliteMemory,
    memory_for,
    memory_from_url,
)
from loomflow.memory._types import encode_messages
from loomflow.messages import Message, ToolCall
from loomflow.models import FunctionModel, ScriptedModel
from loomflow.redaction import Redactor
from loomflow.runtime import SqliteRuntime

KEY = "sk-" + "a1b2c3d4e5" * 4  # an OpenAI-shaped key


def _opened(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Memory:
    if kind == "memory":
        return InMemoryMemory()
    if kind == "sqlite":
        return SqliteMemory(tmp_path / "m.db")
    return PostgresMemory(request.getfixturevalue("pg_dsn"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def memory(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Memory]:
    made = _opened(request.param, request, tmp_path)
    yield made
    await made.close()


async def _stored_text(memory: Memory) -> str:
    """Every fact and block column as the database holds it, in one string."""
    db = memory.store.db  # type: ignore[attr-defined]
    rows = [
        *await db.fetch("SELECT object, source FROM loom_memory_facts"),
        *await db.fetch("SELECT content FROM loom_memory_blocks"),
    ]
    return " ".join(str(v) for row in rows for v in row)


async def test_a_key_in_a_fact_or_a_block_is_not_stored_in_clear(memory: Memory) -> None:
    fact = await memory.remember("deploy", "token", f"use {KEY}", user_id="u", source=KEY)
    assert (fact.object, fact.source) == ("use [REDACTED:api_key]", "[REDACTED:api_key]")
    block = await memory.set_block("notes", f"the key is {KEY}.", user_id="u")
    assert block.content == "the key is [REDACTED:api_key]."
    stored = await _stored_text(memory)
    assert KEY not in stored
    assert stored.count("[REDACTED:api_key]") == 3
    # Re-asserting the same value is still a no-op: it is compared as stored.
    again = await memory.remember("deploy", "token", f"use {KEY}", user_id="u")
    assert again.id == fact.id


async def test_configured_secrets_are_redacted_as_in_episodes(memory: Memory) -> None:
    memory.redactor = Redactor(secrets=["hunter2-correct-horse"])
    await memory.set_block("notes", "password hunter2-correct-horse", user_id="u")
    assert (await memory.block("notes", user_id="u")).content == "password [REDACTED]"  # type: ignore[union-attr]


async def test_the_memory_tools_store_a_key_redacted(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "j.db")
    memory = memory_for(runtime)
    calls = [
        ToolCall(
            id="c1",
            name="remember_fact",
            arguments={"subject": "ci", "predicate": "k", "value": KEY},
        ),
        ToolCall(id="c2", name="write_block", arguments={"name": "notes", "content": f"k {KEY}"}),
    ]
    agent = Agent("x", model=ScriptedModel([calls, "done"]), runtime=runtime, tools=memory.tools())
    assert (await agent.run("hi", session_id="s", user_id="u")).output == "done"
    stored = await _stored_text(memory)
    assert KEY not in stored
    assert stored.count("[REDACTED:api_key]") == 2
    await runtime.close()


async def test_an_agents_default_memory_redacts_with_the_agents_redactor(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "j.db")
    audit = AuditLog(InMemoryAuditStore(), redactor=Redactor(secrets=["tenant-secret-42"]))
    agent = Agent("x", model=ScriptedModel(["ok"]), runtime=runtime, audit=audit)
    assert agent.memory is not None
    block = await agent.memory.set_block("n", "tenant-secret-42", user_id="u")
    assert block.content == "[REDACTED]"
    await runtime.close()


def _turns(text: str) -> list[Message]:
    return [Message.user(text), Message.assistant("ok")]


async def _three_episodes(memory: Memory, sizes: tuple[int, int, int]) -> list[str]:
    ids = []
    for epoch, size in enumerate(sizes):
        episode = await memory.record_episode(
            "s", user_id="u", key=f"k{epoch}", messages=_turns("x" * size), output="ok", epoch=epoch
        )
        ids.append(episode.id)
    return ids


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def any_memory(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Memory]:
    made = _opened(request.param, request, tmp_path)
    yield made
    await made.close()


async def test_recall_keeps_the_newest_episodes_that_fit(any_memory: Memory) -> None:
    await _three_episodes(any_memory, (100, 3000, 200))
    size = [len(encode_messages(_turns("x" * n))) for n in (100, 3000, 200)]
    found = await any_memory.episodes("s", user_id="u", max_bytes=size[2] + size[1])
    assert [e.key for e in found] == ["k1", "k2"]  # oldest first, as ever
    # The walk stops at the first that does not fit: no older episode after a gap.
    found = await any_memory.episodes("s", user_id="u", max_bytes=size[1] + 10)
    assert [e.key for e in found] == ["k2"]
    any_memory.history_bytes = size[2] + size[1] + size[0]
    assert len(await any_memory.history("s", user_id="u")) == 6
    with pytest.raises(UserError, match="max_bytes"):
        await any_memory.episodes("s", user_id="u", max_bytes=0)


async def test_an_episode_over_the_cap_is_a_typed_error_naming_it(any_memory: Memory) -> None:
    ids = await _three_episodes(any_memory, (100, 50_000, 200))
    with pytest.raises(MemoryEntryTooLargeError, match=rf"episode '{ids[1]}' of session 's'"):
        await any_memory.episodes("s", user_id="u", max_bytes=10_000)
    told: list[Exception] = []
    found = await any_memory.episodes("s", user_id="u", max_bytes=10_000, on_damaged=told.append)
    assert [e.key for e in found] == ["k0", "k2"]  # the rest of the session is still recalled
    assert "over the 10000-byte recall cap" in str(told[0])


async def test_a_run_is_not_wedged_by_a_huge_earlier_episode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = SqliteRuntime(tmp_path / "j.db")
    memory = Memory(memory_for(runtime).store, history_bytes=20_000)
    sent: list[list[Message]] = []
    model = FunctionModel(lambda messages, tools: sent.append(messages) or "ok")
    agent = Agent("x", model=model, runtime=runtime, memory=memory)
    await agent.run("first", session_id="s", user_id="u")
    await agent.run("huge " + "y" * 50_000, session_id="s", user_id="u")
    third = await agent.run("third", session_id="s", user_id="u")
    assert third.output == "ok"
    assert [m.content for m in sent[2]] == ["x", "first", "ok", "third"]  # no "huge ..."
    assert "over the 20000-byte recall cap" in caplog.text
    await runtime.close()


async def test_every_way_to_build_memory_takes_the_byte_cap_and_a_redactor(
    tmp_path: Path,
) -> None:
    # Memory(history_bytes=, redactor=) came with the byte cap and fact redaction, but the
    # classes and helpers people build memory with did not take them (a TypeError), so the
    # cap could not be chosen and memory_from_url(settings=) redacted by the environment.
    redactor = Redactor(secrets=["hunter2-correct-horse"])
    runtime = SqliteRuntime(tmp_path / "j.db")
    built = [
        InMemoryMemory(history_bytes=4096, redactor=redactor),
        SqliteMemory(tmp_path / "m.db", history_bytes=4096, redactor=redactor),
        memory_for(runtime, history_bytes=4096, redactor=redactor),
        memory_from_url(f"sqlite:///{tmp_path / 'u.db'}", history_bytes=4096, redactor=redactor),
    ]
    try:
        for memory in built:
            assert (memory.history_bytes, memory.redactor) == (4096, redactor)
            fact = await memory.remember("db", "note", "pw hunter2-correct-horse", user_id="u")
            assert fact.object == "pw [REDACTED]"
        # Without a redactor, the one the settings describe, as SqliteMemory(settings=) does.
        settings = Settings(redact_secrets="hunter2-correct-horse")
        from_url = memory_from_url(f"sqlite:///{tmp_path / 'v.db'}", settings=settings)
        built.append(from_url)
        fact = await from_url.remember("db", "note", "pw hunter2-correct-horse", user_id="u")
        assert fact.object == "pw [REDACTED]"
    finally:
        for memory in built:
            await memory.close()
        await runtime.close()
