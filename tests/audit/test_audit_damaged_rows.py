"""One damaged audit row does not keep the rest of the trail from a compliance export.

A row edited in the storage into no entry (a text ``seq``, bytes in a text column) stopped
``audit query``, ``audit export`` and ``users export`` with one error line, and the Python
calls under them, while ``audit verify`` reported the row in its place: a data-subject
export waited for someone to repair the row. They now go on past it, mark it in its place
(a marker with no hash), name it on stderr and exit with 3, and the export still fails
verification.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from _cli import loomflow
from test_users_export_damaged_trail import _pg_tamper, _seed

from loomflow.audit import ChainProblem, verify_lines
from loomflow.audit._store import AuditStore
from loomflow.config import Settings
from loomflow.errors import AuditIntegrityError
from loomflow.stores import Stores

# What someone with the SQLite file leaves in alice's entry 2 (SQLite keeps any type in any
# column), and the seq the damaged row still shows (None: it is no number).
SQLITE_DAMAGE: dict[str, tuple[str, int | None]] = {
    "text seq": ("seq = 'two'", None),
    "unparsable time": ("time_us = 'yesterday'", 2),
    "bytes in the actor": ("actor = X'ff00'", 2),
    "bytes in the action": ("action = CAST('custom.note' AS BLOB)", 2),
}
# What a PostgreSQL table, typed as it is, can be edited into: rows that read as entries
# no writer makes, shown marked.
PG_DAMAGE = {
    "payload not JSON": "payload = '{not json'",
    "time beyond year 9999": "time_us = 9000000000000000000",
}


def _sqlite_damage(path: Path, change: str) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DROP TRIGGER loom_audit_no_update")
        conn.execute(f"UPDATE loom_audit SET {change} WHERE user_id = 'alice' AND id = 2")
    conn.close()


async def _pg_damage(dsn: str, change: str) -> None:
    await _pg_tamper(dsn, f"UPDATE loom_audit SET {change} WHERE user_id = 'alice' AND seq = 2")


async def _check_api(store: AuditStore, path: Path, seq: int | None, marked: bool) -> None:
    """Query, export and the users export go on past alice's damaged entry 2 and say so."""
    page = await store.query(user_id="alice")
    if marked:  # a row that reads as an entry no writer makes: in place, marked
        assert [e.seq for e in page.entries] == [1, 2, 3]
        assert page.entries[1].unreadable is not None
        assert page.damaged == []
    else:
        assert [e.seq for e in page.entries] == [1, 3]
        assert [(p.user_id, p.kind, p.seq) for p in page.damaged] == [("alice", "unreadable", seq)]
        assert page.damaged[0].position == 2  # its row id
    heard: list[ChainProblem] = []
    export = path / "alice.jsonl"
    assert await store.export(export, user_id="alice", on_damaged=heard.append) == (
        3 if marked else 2
    )
    assert [(p.user_id, p.seq) for p in heard] == [("alice", 2 if marked else seq)]
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert [("hash" in line, "unreadable" in line) for line in lines[1:]] == [
        (True, False),
        (marked, True),  # in its place, and no hash unless it reads as an entry
        (True, False),
    ]
    with export.open(encoding="utf-8", errors="surrogateescape") as fh:
        offline = verify_lines(fh, user_id="alice")
    assert not offline.ok
    assert "unreadable" in {p.kind for p in offline.problems}
    assert not (await store.verify(user_id="alice")).ok
    # entries() yields entries only: a row that is none is an error there, not a gap.
    refused = pytest.raises(AuditIntegrityError) if not marked else contextlib.nullcontext()
    with refused:
        assert len([e async for e in store.entries(user_id="alice")]) == 3


@pytest.mark.parametrize("damage", list(SQLITE_DAMAGE))
async def test_sqlite_query_and_exports_go_on_past_a_damaged_row(
    tmp_path: Path, damage: str
) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    await _seed(url)
    change, seq = SQLITE_DAMAGE[damage]
    _sqlite_damage(tmp_path / "journal.db", change)
    async with Stores(Settings(runtime_url=url)) as stores:
        await _check_api(stores.audit, tmp_path, seq, marked=False)
        document = await stores.export_user("alice")
    assert [("hash" in e, e.get("seq")) for e in document["audit"]] == [
        (True, 1),
        (False, seq),
        (True, 3),
    ]
    assert document["audit"][1]["row"] == 2
    assert document["counts"]["audit entries"] == 2
    assert document["counts"]["damaged audit rows"] == 1
    assert document["audit_problems"]


@pytest.mark.postgres
@pytest.mark.parametrize("damage", list(PG_DAMAGE))
async def test_postgres_query_and_exports_go_on_past_a_damaged_row(
    tmp_path: Path, damage: str, pg_dsn: str
) -> None:
    await _seed(pg_dsn)
    await _pg_damage(pg_dsn, PG_DAMAGE[damage])
    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        await _check_api(stores.audit, tmp_path, 2, marked=True)
        document = await stores.export_user("alice")
    assert [("unreadable" in e) for e in document["audit"]] == [False, True, False]
    assert document["counts"]["damaged audit rows"] == 1
    for command in (["audit", "export"], ["users", "export", "alice"]):
        done = _run(pg_dsn, *command)
        assert done.returncode == 3, done.stderr
        assert "damaged audit row: the trail of user 'alice', entry 2" in done.stderr


def _run(url: str, *args: str) -> Any:
    return loomflow("--url", url, *args)


def test_the_cli_exports_past_a_damaged_row_and_exits_3(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_seed(url))
    healthy = {
        "query": _run(url, "audit", "query", "--json"),
        "export": _run(url, "audit", "export"),
    }
    assert all(done.returncode == 0 for done in healthy.values())
    assert "damaged" not in json.loads(healthy["query"].stdout)  # intact: as it was
    _sqlite_damage(tmp_path / "journal.db", SQLITE_DAMAGE["text seq"][0])

    table = _run(url, "audit", "query")
    assert table.returncode == 3, table.stderr
    assert "damaged audit row: row 2 of the trail of user 'alice', entry ?" in table.stderr
    assert "1 audit row(s) could not be read (each named above): this page is" in table.stderr
    assert table.stdout.count("custom.note") == 3

    query = _run(url, "audit", "query", "--json")
    assert query.returncode == 3, query.stderr
    answer = json.loads(query.stdout)
    assert [e["seq"] for e in answer["entries"]] == [1, 3, 1]
    assert [(d["user_id"], d["seq"], d["position"]) for d in answer["damaged"]] == [
        ("alice", None, 2)
    ]

    out = tmp_path / "all.jsonl"
    export = _run(url, "audit", "export", "-o", str(out))
    assert export.returncode == 3, export.stderr
    assert "exported 3 audit entries" in export.stderr
    assert "the export is incomplete" in export.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 4
    assert json.loads(lines[1])["row"] == 2
    verify = _run(url, "audit", "verify", "--file", str(out))
    assert verify.returncode == 1, verify.stdout

    doc = tmp_path / "alice.json"
    users = _run(url, "users", "export", "alice", "-o", str(doc))
    assert users.returncode == 3, users.stderr
    assert "the export's audit trail is incomplete" in users.stderr
    assert json.loads(doc.read_text())["audit"][1]["unreadable"]
