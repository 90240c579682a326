"""Memory on real SQLite and PostgreSQL: secrets kept out of facts and blocks, bounded recall,
and recalled episodes under the input guardrails."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.audit import AuditLog, InMemoryAuditStore
from loomflow.memory import Memory, PostgresMemory, SqliteMemory, memory_for
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.redaction import Redactor
from loomflow.runtime import SqliteRuntime

KEY = "sk-" + "a1b2c3d4e5" * 4  # an OpenAI-shaped key


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def memory(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Memory]:
    if request.param == "sqlite":
        made: Memory = SqliteMemory(tmp_path / "m.db")
    else:
        made = PostgresMemory(request.getfixturevalue("pg_dsn"))
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
