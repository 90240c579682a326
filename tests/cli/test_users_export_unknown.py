"""`users export` of an id no store knows writes the empty export and warns: a mistyped id
must not pass for "we hold nothing about them" (`users forget` refuses such an id)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from _cli import loomflow

from loomflow import Agent
from loomflow.memory import SqliteMemory
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime


async def _seed(path: Path) -> None:
    runtime = SqliteRuntime(path)
    try:
        agent = Agent("x", model=ScriptedModel(["hi"]), runtime=runtime, telemetry=False)
        await agent.run("hello", session_id="chat", user_id="ana")
    finally:
        await runtime.close()


def test_an_unknown_id_is_exported_empty_with_a_warning(tmp_path: Path) -> None:
    asyncio.run(_seed(tmp_path / "journal.db"))
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    typo = loomflow("--url", url, "users", "export", "anna")
    assert typo.returncode == 0, typo.stderr
    assert json.loads(typo.stdout)["counts"]["sessions"] == 0
    assert "no store holds anything about user 'anna': check the id" in typo.stderr
    known = loomflow("--url", url, "users", "export", "ana")
    assert known.returncode == 0, known.stderr
    assert json.loads(known.stdout)["counts"]["sessions"] == 1
    assert "warning" not in known.stderr
    forget = loomflow("--url", url, "users", "forget", "anna", "--yes")
    assert forget.returncode == 1
    assert "no store holds anything about user 'anna'" in forget.stderr


async def _remembered(path: Path) -> None:
    memory = SqliteMemory(path)
    try:
        await memory.remember("ana", "lives_in", "Lyon", user_id="ana")
        await memory.remember("ana", "lives_in", "Paris", user_id="ana")
        await memory.set_block("notes", "Prefers French.", user_id="ana")
    finally:
        await memory.close()


def test_the_export_summary_counts_facts_and_blocks(tmp_path: Path) -> None:
    # A user known only by what the model remembered: the summary line said "episodes: 0"
    # and nothing of the facts and blocks the file holds.
    asyncio.run(_remembered(tmp_path / "journal.db"))
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    out = tmp_path / "ana.json"
    done = loomflow("--url", url, "users", "export", "ana", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "episodes: 0, facts: 2, blocks: 1," in done.stderr
    document = json.loads(out.read_text())
    assert (document["counts"]["facts"], document["counts"]["blocks"]) == (2, 1)
    assert len(document["memory"]["facts"]) == 2  # the superseded version too


async def _seed_user(path: Path, user_id: str) -> None:
    runtime = SqliteRuntime(path)
    try:
        agent = Agent("x", model=ScriptedModel(["hi"]), runtime=runtime, telemetry=False)
        await agent.run("hello", session_id="chat", user_id=user_id)
    finally:
        await runtime.close()


def test_an_unknown_id_names_the_user_held_under_another_unicode_form(tmp_path: Path) -> None:
    # The user on file spells "josé" with e and a combining accent (NFD, as macOS spells file
    # names); the operator types the precomposed é. Two ids, two users, which every message
    # printed alike: "no store holds anything about user 'josé'", about a user it held.
    asyncio.run(_seed_user(tmp_path / "journal.db", "jose\u0301"))
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    hint = "another Unicode form is held as 'jose\\u0301', another user"
    typed = loomflow("--url", url, "users", "export", "jos\u00e9")
    assert typed.returncode == 0, typed.stderr
    assert json.loads(typed.stdout)["counts"]["sessions"] == 0
    assert "about user 'jos\u00e9'" in typed.stderr
    assert hint in typed.stderr, typed.stderr
    forget = loomflow("--url", url, "users", "forget", "jos\u00e9", "--yes")
    assert forget.returncode == 1
    assert hint in forget.stderr, forget.stderr
    # Nothing merged: the id on file still reaches its user, and only it.
    held = loomflow("--url", url, "users", "export", "jose\u0301")
    assert json.loads(held.stdout)["counts"]["sessions"] == 1
    assert "warning" not in held.stderr
