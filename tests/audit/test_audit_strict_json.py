"""Stored payloads and export lines are JSON read strictly.

Python's parser takes a key given twice (keeping the last value, where SQLite's
``json_extract`` reads the first), ``NaN`` and ``1e400`` (infinity). A payload or a line with
any of them is reported (``unreadable``, naming what is wrong), never verified as intact, and
a row holding one is still queried and exported (as the other unreadable rows are), without a
traceback or a bare ``NaN`` in the output.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from loomflow.audit import (
    AuditRecord,
    AuditStore,
    ChainProblem,
    InMemoryAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
    heads_from_json,
    verify_lines,
)
from loomflow.errors import AuditError


def _record(user: str, i: int) -> AuditRecord:
    return AuditRecord(
        user_id=user,
        actor="agent:x",
        action="tool.call",
        payload={"arguments": {"order": f"A{i}"}, "call_id": f"c{i}"},
    )


def _strict(text: str) -> Any:
    """JSON as every reader takes it: no NaN, no Infinity."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in the output")

    return json.loads(text, parse_constant=refuse)


# Stored payload texts, each a damage that must be reported, and what the report names.
DAMAGED = {
    "a key twice": ('{"call_id":"zzz","arguments":{"order":"A1"},"call_id":"c1"}', '"call_id"'),
    "a key twice, nested": ('{"arguments":{"order":"A9","order":"A1"},"call_id":"c1"}', '"order"'),
    "a key twice in a list": ('{"a":[{"k":1,"k":2}]}', '"k"'),
    "NaN": ('{"a":NaN}', "NaN"),
    "Infinity": ('{"a":-Infinity}', "Infinity"),
    "a number beyond a double": ('{"a":1e400}', "1e400"),
    "a lone surrogate": ('{"a":"\\ud800"}', "lone surrogate"),
}


async def _edit_sqlite(path: Path, payload: str) -> None:
    with sqlite3.connect(path) as conn:  # as someone with the file would: triggers first
        conn.execute("DROP TRIGGER loom_audit_no_update")
        conn.execute(
            "UPDATE loom_audit SET payload = ? WHERE user_id = 'alice' AND seq = 2", (payload,)
        )


async def _edit_postgres(dsn: str, payload: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SET session_replication_role = replica")  # triggers off
        await conn.execute(
            "UPDATE loom_audit SET payload = $1 WHERE user_id = 'alice' AND seq = 2", payload
        )
    finally:
        await conn.close()


@pytest.mark.parametrize("damage", list(DAMAGED))
@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_stored_payload_that_is_not_strict_json_is_reported_and_still_exported(
    kind: str, damage: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    payload, named = DAMAGED[damage]
    store: AuditStore
    if kind == "sqlite":
        store = SqliteAuditStore(tmp_path / "audit.db")
    else:
        dsn = request.getfixturevalue("pg_dsn")
        store = PostgresAuditStore(dsn)
    await store.open()
    try:
        await store.append([_record("alice", i) for i in range(4)])
        await store.append([_record("bob", i) for i in range(2)])
        assert (await store.verify()).ok
        if kind == "sqlite":
            await _edit_sqlite(tmp_path / "audit.db", payload)
        else:
            await _edit_postgres(dsn, payload)
        report = await store.verify()
        assert [(p.user_id, p.kind, p.seq) for p in report.problems] == [
            ("alice", "unreadable", 2)
        ], report.problems
        assert "unreadable payload" in report.problems[0].detail
        assert named in report.problems[0].detail
        assert (await store.verify(user_id="bob")).ok
        # Queried and exported as stored, like any unreadable payload.
        page = await store.query(user_id="alice", limit=10)
        assert page.entries[1].payload == {"unreadable_payload": payload}
        out = tmp_path / "export.jsonl"
        assert await store.export(out) == 6
        lines = out.read_text(encoding="utf-8").splitlines()
        assert len(lines) == 6
        for line in lines:
            _strict(line)
        offline = verify_lines(lines, heads=heads_from_json(report.to_json()))
        # The line says its row was unreadable: verify --file reports it as verify does (it
        # called it edited), and nothing else (no gap, no broken link after it).
        assert [(p.user_id, p.kind, p.seq) for p in offline.problems] == [
            ("alice", "unreadable", 2)
        ], offline.problems
        assert report.problems[0].detail in offline.problems[0].detail.encode().decode(
            "unicode_escape"
        )
        assert offline.entries == report.entries
    finally:
        await store.close()


def _lines() -> tuple[list[str], list[Any]]:
    async def build() -> tuple[list[str], list[Any]]:
        store = InMemoryAuditStore()
        await store.append([_record("alice", i) for i in range(3)])
        entries = [e async for e in store.entries(user_id="alice")]
        return [e.to_line() for e in entries], await store.heads()

    return asyncio.run(build())


@pytest.mark.parametrize("with_heads", [False, True], ids=["alone", "heads"])
@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        # The first value is what SQLite's json_extract and others would read; Python's
        # parser (and JavaScript's) keep the last, the one the entry was hashed with.
        ('{"action":', '{"action":"tool.denied","action":', '"action"'),
        ('"payload":{"arguments":{', '"payload":{"arguments":{"order":"B7",', '"order"'),
        ('"payload":{', '"payload":{"call_id":"zzz",', '"call_id"'),
        ('"payload":{', '"payload":{"x":1e400,', "1e400"),
    ],
    ids=["top level", "nested", "payload", "beyond a double"],
)
def test_an_export_line_that_is_not_strict_json_is_unreadable(
    old: str, new: str, named: str, with_heads: bool
) -> None:
    lines, heads = _lines()
    assert verify_lines(lines, heads=heads).ok
    assert old in lines[1]
    edited = [lines[0], lines[1].replace(old, new, 1), lines[2]]
    report = verify_lines(edited, heads=heads if with_heads else None)
    assert not report.ok
    assert ("unreadable", 2) in [(p.kind, p.position) for p in report.problems], report.problems
    unreadable = next(p for p in report.problems if p.kind == "unreadable")
    assert named in unreadable.detail


def test_a_header_with_a_key_twice_is_no_header() -> None:
    lines, _ = _lines()
    header = '{"filters":{"user_id":"mallory","user_id":"alice"},"loomflow_audit_export":1}'
    report = verify_lines([header, *lines])
    assert [(p.kind, p.position) for p in report.problems] == [("unreadable", 1)]
    assert '"user_id"' in report.problems[0].detail
    assert report.export_filters is None


@pytest.mark.parametrize(
    "text",
    ['{"a":1,"a":1}', '[{"b":{"c":0,"c":0}}]', '{"a":NaN}', '{"a":Infinity}', '{"a":-1e309}'],
)
def test_read_json_refuses_what_careful_readers_refuse(text: str) -> None:
    from loomflow.audit._entry import read_json

    with pytest.raises(ValueError, match=r"given twice|is not JSON|beyond the range"):
        read_json(text)
    # What it takes: equal keys in different objects, big integers, small numbers.
    assert read_json('{"a":{"a":1},"b":[{"a":1},{"a":2}],"n":1e308,"z":1e-400}')["n"] == 1e308
    assert read_json('{"i":' + "9" * 400 + "}")["i"] == int("9" * 400)


async def test_an_export_that_fails_leaves_no_file(tmp_path: Path) -> None:
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        await store.append([_record("alice", i) for i in range(3)])
        with sqlite3.connect(tmp_path / "audit.db") as conn:
            conn.execute("DROP TRIGGER loom_audit_no_update")
            conn.execute("UPDATE loom_audit SET seq = 'two' WHERE seq = 2")
        out = tmp_path / "export.jsonl"

        def refuse(problem: ChainProblem) -> None:
            raise AuditError(f"stopped at {problem.detail}")

        # The damaged row is exported marked now; an export stopped part way (here by its
        # caller, at that row) still leaves no file to pass for a smaller export.
        with pytest.raises(AuditError, match="malformed"):
            await store.export(out, on_damaged=refuse)
        assert not out.exists()
    finally:
        await store.close()
