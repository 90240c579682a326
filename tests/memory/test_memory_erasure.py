"""A user's whole memory in their export, and none of it left after ``users forget``: the facts
a model remembered (superseded versions included), the blocks it wrote and the episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.config import Settings
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.stores import Stores

MARKS = ("OLDCITY7", "NEWCITY7", "BLOCKNAME7", "BLOCKTEXT7", "PROMPT7", "ANSWER7")


async def _remembered(stores: Stores, user: str, tag: str) -> None:
    """One agent run of ``user`` whose model uses every memory tool, then a fact retracted."""
    model = ScriptedModel(
        [
            [ToolCall(id="1", name="remember_fact", arguments={
                "subject": "user", "predicate": "city", "value": f"OLDCITY{tag}"})],
            [ToolCall(id="2", name="remember_fact", arguments={
                "subject": "user", "predicate": "city", "value": f"NEWCITY{tag}"})],
            [ToolCall(id="3", name="remember_fact", arguments={
                "subject": "user", "predicate": "pet", "value": "cat"})],
            [ToolCall(id="4", name="write_block", arguments={
                "name": f"BLOCKNAME{tag}", "content": f"BLOCKTEXT{tag}"})],
            f"ANSWER{tag}",
        ]
    )  # fmt: skip
    memory = stores.memory
    assert memory is not None
    agent = Agent("x", model=model, runtime=stores.runtime, memory=memory, tools=memory.tools())
    await agent.run(f"PROMPT{tag}", session_id="chat", user_id=user)
    await memory.retract("user", "pet", user_id=user)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_export_holds_all_of_a_users_memory_and_forget_leaves_none_of_it(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "journal.db"
    url = request.getfixturevalue("pg_dsn") if kind == "postgres" else f"sqlite:///{path}"
    settings = Settings(runtime_url=url)
    async with Stores(settings) as stores:
        await _remembered(stores, "ana", "7")
        await _remembered(stores, "bob", "8")
        exported = (await stores.export_user("ana"))["memory"]
        assert [len(exported[k]) for k in ("episodes", "facts", "blocks")] == [1, 3, 1]
        assert [f["valid_to"] is None for f in exported["facts"]] == [False, True, False]
        flat = json.dumps(exported)
        assert all(mark in flat for mark in MARKS)
        assert "8" not in "".join(f["object"] for f in exported["facts"])  # none of bob's

        report = await stores.forget_user("ana", actor="test")
        assert report.memory == {"episodes": 1, "facts": 3, "blocks": 1}
        memory = stores.memory
        assert memory is not None
        after = await memory.export_user("ana")
        assert [after[k] for k in ("episodes", "facts", "blocks")] == [[], [], []]
        db = memory.store.db  # type: ignore[attr-defined]
        left = []
        for table in ("loom_memory_episodes", "loom_memory_facts", "loom_memory_blocks"):
            rows = await db.fetch(f"SELECT * FROM {table}")
            left += [str(value) for row in rows for value in row]
        assert not any(mark in value for mark in MARKS for value in left)
        assert any("NEWCITY8" in value for value in left)  # bob's memory stays
    if kind == "sqlite":
        # Nothing of hers in the file's free pages or its -wal either (secure_delete).
        stored = b"".join(p.read_bytes() for p in tmp_path.glob("journal.db*"))  # noqa: ASYNC240 - the stores are closed
        assert not any(mark.encode() in stored for mark in MARKS)
        assert b"NEWCITY8" in stored
