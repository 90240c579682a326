"""Rows of the stores whose text columns hold bytes that are not UTF-8, on real SQLite files.

Such text reads back holding lone surrogates (``storage/_sqlite.read_text``). It gave
tracebacks: every JSON document a command prints (``users export``, ``checkpoints show`` and
``export``, ``audit query --json``, ``audit verify --json``), a fork from a checkpoint, a
fact remembered over a damaged one, a step under a damaged idempotency row; ``approvals list``
failed on a damaged session row, and a damaged ``on_expiry`` released a hold uncharged. Now
the damaged row reads as damaged, and JSON output escapes the text (``\\udcff``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_damaged_totals_and_exports import USER, _agent, _world
from test_hand_edited_rows import sqlite_exec

from loomflow.errors import CheckpointError, CorruptEntryError
from loomflow.governance.budget import SqlBudgetStore
from loomflow.governance.budget._types import Amount, Bucket, Reservation
from loomflow.memory import SqliteMemory
from loomflow.runtime import SqliteRuntime
from loomflow.testing.checkpoint_conformance import Shop

BAD = "CAST(x'ff41' AS TEXT)"  # reads back as '\udcffA'


def cli(path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """The CLI as on a UTF-8 terminal: stdout refuses what UTF-8 cannot spell."""
    done = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", *command],
        capture_output=True, text=True, cwd=path.parent, timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"}, errors="surrogateescape",
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _json(done: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(done.stdout)


async def _checkpoint_id(path: Path) -> str:
    async with _agent(path, Shop()) as agent:
        (newest, *_) = await agent.list_checkpoints("s", user_id=USER)
    return newest.id


# -- JSON documents a command prints -------------------------------------------------------------


async def test_an_export_shows_damaged_text_escaped_and_its_rows_as_unreadable(
    tmp_path: Path,
) -> None:
    path = await _world(
        tmp_path,
        f"UPDATE loom_memory_facts SET object = {BAD}",
        f"UPDATE loom_checkpoints SET output = {BAD} WHERE seq = (SELECT MAX(seq) FROM "
        "loom_checkpoints)",
        "DROP TRIGGER loom_audit_no_update",
        f"UPDATE loom_audit SET actor = {BAD} WHERE seq = 1",
    )
    done = cli(path, "users", "export", USER)  # was a UnicodeEncodeError traceback
    assert done.returncode == 0, done.stderr
    assert "\\udcffA" in done.stdout  # the escape, which reads back as what the row holds
    document = _json(done)
    (fact,) = document["memory"]["facts"]
    assert "object holds text that is not UTF-8" in fact["unreadable"]
    (damaged,) = [c for c in document["checkpoints"]["checkpoints"] if "unreadable" in c]
    assert "output holds text that is not UTF-8" in damaged["unreadable"]
    assert [e["actor"] for e in document["audit"] if e["seq"] == 1] == ["\udcffA"]

    exported = cli(path, "checkpoints", "export", "--user", USER)
    assert exported.returncode == 0, exported.stderr
    assert len(_json(exported)["checkpoints"]) == len(document["checkpoints"]["checkpoints"])

    query = cli(path, "audit", "query", "--json")
    assert query.returncode == 0, query.stderr
    assert "\udcffA" in [e["actor"] for e in _json(query)["entries"]]
    verify = cli(path, "audit", "verify", "--json")
    assert verify.returncode == 1, verify.stderr  # the edit is found, and said in JSON
    assert [p["kind"] for p in _json(verify)["problems"]] == ["edited"]


async def test_checkpoints_show_names_a_damaged_checkpoint(tmp_path: Path) -> None:
    path = await _world(tmp_path)
    checkpoint_id = await _checkpoint_id(path)
    sqlite_exec(path, f"UPDATE loom_checkpoints SET run_id = {BAD}")
    done = cli(path, "checkpoints", "show", "s", checkpoint_id, "--user", USER)
    assert done.returncode == 1
    assert "run_id holds text that is not UTF-8" in done.stderr
    listed = cli(path, "checkpoints", "list", "s", "--user", USER)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("unreadable") == len(listed.stdout.splitlines()) - 1


# -- no damaged text is written back -------------------------------------------------------------


async def test_a_fork_from_a_checkpoint_with_damaged_text_is_refused(tmp_path: Path) -> None:
    path = await _world(tmp_path)
    checkpoint_id = await _checkpoint_id(path)
    sqlite_exec(path, f"UPDATE loom_checkpoints SET output = {BAD}")
    async with _agent(path, Shop()) as agent:
        # Was a UnicodeEncodeError: the fork wrote the damaged output back.
        with pytest.raises(CheckpointError, match="output holds text that is not UTF-8"):
            await agent.resume("shop", session_id="s", user_id=USER, from_checkpoint=checkpoint_id)


async def test_a_fact_remembered_over_a_damaged_one_supersedes_it(tmp_path: Path) -> None:
    path = await _world(tmp_path, f"UPDATE loom_memory_facts SET fact_id = {BAD}")
    memory = SqliteMemory(path)
    try:
        with pytest.raises(CorruptEntryError, match="fact_id holds text that is not UTF-8"):
            await memory.facts(user_id=USER)
        with pytest.raises(CorruptEntryError, match="not UTF-8"):
            await memory.retract("user", "likes", user_id=USER)  # refused, not closed
        # Was a UnicodeEncodeError: the damaged id was bound to close the current fact.
        fact = await memory.remember("user", "likes", "bread", user_id=USER)
        assert [f.object for f in await memory.facts(user_id=USER)] == ["bread"]
        assert fact.object == "bread"
    finally:
        await memory.close()


async def test_a_damaged_idempotency_row_is_replaced_once(tmp_path: Path) -> None:
    path = tmp_path / "loomflow.db"
    runtime = SqliteRuntime(path)
    calls: list[int] = []

    def charge() -> dict[str, int]:
        calls.append(1)
        return {"paid": len(calls)}

    try:
        async with runtime.session("k", USER):
            await runtime.step("charge", charge, idempotency_key="order-1")
        sqlite_exec(path, f"UPDATE loom_idempotency SET format = {BAD}")
        async with runtime.session("k", USER):  # was a UnicodeEncodeError
            assert await runtime.step("charge", charge, idempotency_key="order-1") == {"paid": 2}
        async with runtime.session("k", USER):  # replaced: it replays now
            assert await runtime.step("charge", charge, idempotency_key="order-1") == {"paid": 2}
    finally:
        await runtime.close()
    assert len(calls) == 2


# -- decisions ------------------------------------------------------------------------------------


async def test_a_hold_whose_on_expiry_is_damaged_is_not_reclaimed_uncharged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "budget.db"
    store = SqlBudgetStore(f"sqlite:///{path}")
    bucket = Bucket("user", USER, "")
    try:
        held = Reservation("res_1", "someone:1:host:x", (bucket,), Amount(10, 5, 0))
        assert await store.reserve(held, [], hard=True, lease_s=0.01) is None
        await asyncio.sleep(0.05)
        sqlite_exec(path, f"UPDATE loom_budget_reservations SET on_expiry = {BAD}")
        # Was 1: read as not 'charge', the hold was released and its call never charged.
        assert await store.reclaim() == 0
        totals = (await store.totals([bucket.key]))[bucket.key]
        assert (totals.reserved_in, totals.reserved_out) == (10, 5)
        # Was listed as 'charge'; then failed the whole listing: now left out, and named.
        assert await store.reservations() == []
        assert "'res_1' is unreadable and left out of the listing" in caplog.text
        assert "neither 'charge' nor 'release'" in caplog.text
    finally:
        await store.close()


async def test_a_session_row_with_a_damaged_id_is_unreadable_not_an_error(tmp_path: Path) -> None:
    path = await _world(tmp_path, f"UPDATE loom_sessions SET session_id = {BAD}")
    runs = cli(path, "runs", "list", "--json")
    assert runs.returncode == 0, runs.stderr
    assert [json.loads(line)["state"] for line in runs.stdout.splitlines()] == ["unreadable"]
    approvals = cli(path, "approvals", "list", "--json")  # was exit 1 for the whole listing
    assert approvals.returncode == 0, approvals.stderr
    (line,) = [json.loads(line) for line in approvals.stdout.splitlines()]
    assert "not UTF-8" in line["unreadable"]
    exported = cli(path, "users", "export", USER)  # was a UnicodeEncodeError traceback
    assert exported.returncode == 0, exported.stderr
    (session,) = _json(exported)["journal"]["sessions"]
    assert session["state"] == "unreadable"
    assert _json(exported)["memory"]["facts"]  # the rest of the export is there
