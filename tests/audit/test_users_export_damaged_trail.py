"""`users export` of a user whose audit trail was edited in the storage says so.

The export is the answer to an access request, so it shows the trail as stored; it listed an
entry edited behind the store's back like any other, with nothing in the document or on the
terminal to tell it from the real record (exit 0, no warning), though `audit verify` fails.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from _cli import clean_env, loomflow

from loomflow.audit import AuditLog
from loomflow.config import Settings
from loomflow.stores import Stores


async def _seed(url: str) -> None:
    log = AuditLog(url)
    try:
        for i in range(3):
            await log.record("custom.note", user_id="alice", actor="app", payload={"i": i})
        await log.record("custom.note", user_id="bob", actor="app", payload={})
    finally:
        await log.close()


async def _pg_tamper(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SET session_replication_role = replica")  # past the guards
        await conn.execute(sql)
    finally:
        await conn.close()


def _edit_jsonl(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1].replace('"action":"custom.note"', '"action":"custom.paid"')
    path.write_text("".join(lines))


EDIT = """UPDATE loom_audit SET action = 'custom.paid' WHERE user_id = 'alice' AND seq = 2"""


@pytest.mark.parametrize(
    "kind", ["sqlite", "jsonl", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_the_export_of_an_edited_trail_lists_the_problems(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}")
    if kind == "sqlite":
        await _seed(settings.runtime_url)
        conn = sqlite3.connect(tmp_path / "journal.db")
        with conn:
            conn.execute("DROP TRIGGER loom_audit_no_update")
            conn.execute(EDIT)
        conn.close()
    elif kind == "jsonl":
        settings = settings.model_copy(update={"audit_url": str(tmp_path / "audit.jsonl")})
        await _seed(str(tmp_path / "audit.jsonl"))
        _edit_jsonl(tmp_path / "audit.jsonl")
    else:
        settings = Settings(runtime_url=request.getfixturevalue("pg_dsn"))
        await _seed(settings.runtime_url)
        await _pg_tamper(settings.runtime_url, EDIT)
    async with Stores(settings) as stores:
        alice = await stores.export_user("alice")
        bob = await stores.export_user("bob")
    assert [e["action"] for e in alice["audit"]][1] == "custom.paid"  # shown as stored
    assert [(p["kind"], p["seq"]) for p in alice["audit_problems"]] == [("edited", 2)]
    assert bob["audit_problems"] == []  # another user's trail is not hers


def test_users_export_warns_of_an_edited_trail(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_seed(url))
    clean = loomflow("--url", url, "users", "export", "alice", "-o", str(tmp_path / "a.json"))
    assert clean.returncode == 0, clean.stderr
    assert "warning" not in clean.stderr
    conn = sqlite3.connect(tmp_path / "journal.db")
    with conn:
        conn.execute("DROP TRIGGER loom_audit_no_update")
        conn.execute(EDIT)
    conn.close()
    out = tmp_path / "alice.json"
    done = loomflow("--url", url, "users", "export", "alice", "-o", str(out), env=clean_env())
    assert done.returncode == 0, done.stderr  # the export is still the answer, written whole
    assert "the audit trail of user 'alice' fails verification: 1 problem" in done.stderr
    assert "edited, entry 2" in done.stderr
    assert "loomflow audit verify --user alice" in done.stderr
    assert json.loads(out.read_text())["audit_problems"][0]["kind"] == "edited"
