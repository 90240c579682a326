"""What an application, a crafted cursor or a hand-edited row can and cannot do to the trail.

Holds move only with their own placement and release; actions loomflow gives meaning to are
not the application's to write; a cursor is a seq we handed out or a clear error; a row
edited into something no writer makes is reported where it is, and the other users' chains
are still checked.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from loomflow.agent import Agent
from loomflow.audit import (
    AuditLog,
    AuditRecord,
    AuditStore,
    InMemoryAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
    verify_lines,
)
from loomflow.audit._entry import MAX_PAYLOAD_DEPTH
from loomflow.errors import (
    AuditIntegrityError,
    InvalidArgumentError,
    InvalidIdError,
    LegalHoldError,
    UserError,
)
from loomflow.models import ScriptedModel


def _record(user: str, action: str = "tool.call", **payload: Any) -> AuditRecord:
    return AuditRecord(user_id=user, actor="agent:x", action=action, payload=payload or {"n": 1})


async def test_only_a_release_lifts_a_hold(store: AuditStore) -> None:
    await store.append(_record("bob"))
    await store.place_hold("bob", reason="litigation L-7", actor="legal:dana")
    # Past the checks (record() and append() refuse the prefix; an older release or a script
    # writing rows could have written them): a note, and a look-alike of a release.
    await store._write(_record("bob", "legal_hold.reviewed", note="still needed"))
    await store._write(_record("bob", "legal_hold.released_later"))
    hold = await store.legal_hold("bob")
    assert hold is not None
    assert hold.reason == "litigation L-7"
    assert [h.user_id for h in await store.legal_holds()] == ["bob"]
    with pytest.raises(LegalHoldError, match="litigation L-7"):
        await store.erase("bob", reason="forget")
    await store.release_hold("bob", actor="legal:dana")
    assert await store.legal_hold("bob") is None


@pytest.mark.parametrize(
    "action", ["legal_hold.placed", "legal_hold.released", "legal_hold.note", "audit.erasure",
               "console.query", "console.signin"]
)  # fmt: skip
async def test_the_log_refuses_actions_loomflow_gives_meaning_to(action: str) -> None:
    log = AuditLog(InMemoryAuditStore())
    with pytest.raises(UserError, match="kept for loomflow's own entries"):
        await log.record(action, user_id="bob", actor="app")
    with pytest.raises(UserError, match="console chain"):
        await log.record("app.note", user_id="console:ops", actor="app")
    assert await log.store.count() == 0
    entry = await log.record("legal.review", user_id="bob", actor="app", payload={"ok": True})
    assert entry.seq == 1  # a name of the application's own is fine


@pytest.mark.parametrize(
    "action",
    ["legaI_hold.placed", "audit\u2024erasure", "AUDIT.erasure", "Legal_Hold.placed",
     "legal_hold\uff0ereleased", "\u0430udit.erasure", "legal\u200b_hold.placed", "C0NSOLE.query",
     "legal-hold.placed"],
)  # fmt: skip
async def test_the_log_refuses_lookalikes_of_its_own_actions(action: str) -> None:
    # Shown by `audit query` and the console, these read as a hold placed or an erasure made.
    log = AuditLog(InMemoryAuditStore())
    with pytest.raises(UserError, match="looks like loomflow's own"):
        await log.record(action, user_id="bob", actor="app")
    assert await log.store.count() == 0
    for own in ("legal.review", "auditor.note", "consoles.sync", "hold.placed", "app.audit"):
        await log.record(own, user_id="bob", actor="app")
    assert await log.store.count() == 5


async def test_an_audited_run_refuses_a_user_id_that_names_a_console_chain() -> None:
    # Its entries would join the console's record of looks, which erasure never removes.
    log = AuditLog(InMemoryAuditStore())
    agent = Agent("x", model=ScriptedModel(["ok"]), audit=log, memory=False)
    with pytest.raises(UserError, match="console chain"):
        await agent.run("hi", user_id="console:ada")
    assert await log.store.count() == 0
    assert (await agent.run("hi", user_id="ada")).output == "ok"


@pytest.mark.parametrize("bad", [b"bob", 5, "", "a\x00b", "x" * 300])
async def test_the_log_refuses_ids_that_are_not_ids(bad: Any) -> None:
    log = AuditLog(InMemoryAuditStore())
    with pytest.raises(InvalidIdError, match="user_id"):
        await log.record("app.note", user_id=bad, actor="app")
    with pytest.raises(InvalidIdError, match="session_id"):
        await log.record("app.note", user_id="bob", session_id=bad, actor="app")
    assert await log.store.count() == 0
    # Nor does the record model take bytes for text (they would land in the user "bob").
    with pytest.raises(ValueError, match="user_id"):
        AuditRecord(user_id=b"bob", actor="app", action="app.note")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cursor",
    ["99999999999999999999999", str(2**63), "²", "١٢", "1" * 5000, "-1", " 1", "1.0", ""],
)
async def test_a_cursor_we_never_gave_out_is_a_user_error(store: AuditStore, cursor: str) -> None:
    await store.append([_record("ana"), _record("ana")])
    with pytest.raises(UserError, match="bad cursor"):
        await store.query(user_id="ana", cursor=cursor, limit=1)
    page = await store.query(user_id="ana", limit=1)
    assert page.next_cursor is not None
    rest = await store.query(user_id="ana", cursor=page.next_cursor, limit=5)
    assert [e.seq for e in rest.entries] == [2]
    assert (await store.query(user_id="ana", cursor=str(2**63 - 1))).entries == []


async def _relabel_postgres(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SET session_replication_role = replica")  # triggers off
        await conn.execute(sql)
    finally:
        await conn.close()


Edit = Callable[[str], Awaitable[None]]


@contextlib.asynccontextmanager
async def _tampered(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[AuditStore, Edit]]:
    """An open audit store of ``kind``, and how someone with the database edits it (the
    tables' triggers out of the way)."""
    store: AuditStore
    dsn = ""
    if kind == "sqlite":
        store = SqliteAuditStore(tmp_path / "audit.db")
    else:
        dsn = request.getfixturevalue("pg_dsn")
        store = PostgresAuditStore(dsn)

    async def edit(sql: str) -> None:
        if kind != "sqlite":
            await _relabel_postgres(dsn, sql)
            return
        with sqlite3.connect(tmp_path / "audit.db") as conn:
            for trigger in ("loom_audit_no_update", "loom_audit_heads_forward"):
                conn.execute(f"DROP TRIGGER IF EXISTS {trigger}")
            conn.execute(sql)
        conn.close()

    await store.open()
    try:
        yield store, edit
    finally:
        await store.close()


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE loom_audit SET hash_version = 2 WHERE user_id = 'alice' AND seq = 2",
        "UPDATE loom_audit SET payload_digest = NULL WHERE user_id = 'alice' AND seq = 2",
    ],
)
@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_row_no_writer_makes_is_reported_in_place_and_the_rest_is_checked(
    kind: str, edit: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    async with _tampered(kind, tmp_path, request) as (store, tamper):
        await store.append([_record("alice") for _ in range(3)] + [_record("bob")] * 2)
        assert (await store.verify()).ok
        await tamper(edit)
        report = await store.verify()
        assert [(p.user_id, p.kind, p.seq) for p in report.problems] == [
            ("alice", "unreadable", 2)
        ], report.problems
        assert "does not read as an audit entry" in report.problems[0].detail
        assert report.users == 2
        assert (await store.verify(user_id="bob")).ok
        # Queries still read every row, the edited one as it is stored.
        page = await store.query(limit=10)
        assert [(e.user_id, e.seq) for e in page.entries] == [
            ("alice", 1), ("alice", 2), ("alice", 3), ("bob", 1), ("bob", 2)
        ]  # fmt: skip


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_row_moved_under_another_key_is_reported_as_each_users_problem(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Alice's last entry moved under a key nobody had: the gap and the missing head are the
    # problems of that key's trail (carol's), the moved entry is alice's own, and alice,
    # whose head is in place, has lost her last entry.
    async with _tampered(kind, tmp_path, request) as (store, tamper):
        await store.append([_record("alice") for _ in range(5)] + [_record("bob")] * 2)
        edit = """UPDATE loom_audit SET user_key = '"carol"' WHERE user_id = 'alice' AND seq = 5"""
        await tamper(edit)
        report = await store.verify()
        assert [(p.user_id, p.kind, p.seq) for p in report.problems] == [
            ("alice", "truncated", 5),
            ("alice", "edited", 5),
            ("carol", "missing", 1),
            ("carol", "unanchored", 1),
        ], report.problems
        assert "filed under the trail key '\"carol\"'" in report.problems[1].detail
        assert "entries 1-4 are missing before entry 5" in report.problems[2].detail
        carol = await store.verify(user_id="carol")
        assert [(p.user_id, p.kind) for p in carol.problems] == [
            ("alice", "edited"),
            ("carol", "missing"),
            ("carol", "unanchored"),
        ]


async def test_an_export_line_with_retyped_numbers_is_unreadable(tmp_path: Path) -> None:
    store = InMemoryAuditStore()
    await store.append([_record("ana") for _ in range(3)])
    lines = [e.to_line() for e in [e async for e in store.entries(user_id="ana")]]
    assert verify_lines(lines).ok
    time = json.loads(lines[1])["time"]
    for field, value in (
        ("seq", "2"),
        ("seq", 2.0),
        ("seq", 0),
        ("seq", 2**53),  # beyond what JSON readers hold exactly
        ("schema_version", "1"),
        ("time", time[:-4] + "Z"),  # ...03.51Z: hashed as ...03.510000Z, never written so
        ("time", time.replace("T", " ")),
    ):
        data = json.loads(lines[1])
        data[field] = value
        report = verify_lines([lines[0], json.dumps(data), lines[2]])
        kinds = [(p.kind, p.position) for p in report.problems]
        assert ("unreadable", 2) in kinds, (field, value, report.problems)
        assert field in report.problems[0].detail
    # NaN and Infinity are not JSON, though Python's parser takes them.
    line = lines[1].replace('"payload":{"n":1}', '"payload":{"n":NaN}')
    assert line != lines[1]
    report = verify_lines([lines[0], line, lines[2]])
    assert ("unreadable", 2) in [(p.kind, p.position) for p in report.problems]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_payload_nested_too_deep_to_hash_is_reported_not_a_crash(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # 700 lists deep: Python's JSON parser still reads it, but walking it for the hash ran
    # out of stack, and verify, an export's check and forget died with a RecursionError.
    # Deeper than MAX_JSON_DEPTH, it is not read at all: unreadable, whatever the stack.
    deep = '{"n":' + "[" * 700 + "]" * 700 + "}"
    async with _tampered(kind, tmp_path, request) as (store, tamper):
        await store.append([_record("alice") for _ in range(3)] + [_record("bob")] * 2)
        edit = f"UPDATE loom_audit SET payload = '{deep}' WHERE user_id = 'alice' AND seq = 2"
        await tamper(edit)
        report = await store.verify()
        found = [(p.user_id, p.kind, p.seq) for p in report.problems]
        assert found == [("alice", "unreadable", 2)]
        assert "nested more than 256" in report.problems[0].detail
        assert (await store.verify(user_id="bob")).ok
        # The erasure that would hide the change is refused, as for any edited payload.
        with pytest.raises(AuditIntegrityError, match="seq 2"):
            await store.check_erasable("alice")
        lines = [e.to_line() async for e in store.entries()]
        offline = verify_lines(lines)
        assert [(p.user_id, p.kind, p.seq) for p in offline.problems] == found


@pytest.mark.parametrize("shape", ["deep", "past the cap", "cycle"])
async def test_a_payload_too_deep_to_store_is_a_typed_error(store: AuditStore, shape: str) -> None:
    # It was a bare RecursionError out of the redactor or the JSON conversion; and a payload
    # some 320 lists deep was stored, then reported as edited by a verify whose stack was
    # deeper than the writer's.
    payload: dict[str, Any] = {}
    if shape != "cycle":
        value: Any = 1
        for _ in range(5000 if shape == "deep" else 250):
            value = [value]
        payload["v"] = value
    else:
        payload["self"] = payload
    log = AuditLog(store)
    with pytest.raises(InvalidArgumentError, match="nested too deep"):
        await log.record("app.note", user_id="ana", actor="app", payload=payload)
    with pytest.raises(InvalidArgumentError, match="nested too deep"):
        await store.append(
            AuditRecord(user_id="ana", actor="app", action="app.note", payload=payload)
        )
    assert await store.count() == 0
    await log.record("app.note", user_id="ana", actor="app", payload={"v": [[[1]]]})
    deepest: Any = 1
    for _ in range(MAX_PAYLOAD_DEPTH - 1):  # with the payload object itself: the cap
        deepest = [deepest]
    await log.record("app.note", user_id="ana", actor="app", payload={"v": deepest})
    assert (await store.verify()).ok


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_seq_edited_past_any_entry_claims_no_place_in_the_chain(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The unreadable row was taken at its word: "entries 4-9223372036854775806 are missing"
    # and "entries 4-9223372036854775807 come after the recorded head".
    async with _tampered(kind, tmp_path, request) as (store, tamper):
        await store.append([_record("alice") for _ in range(3)])
        edit = f"UPDATE loom_audit SET seq = {2**63 - 1} WHERE user_id = 'alice' AND seq = 2"
        await tamper(edit)
        report = await store.verify()
        assert [(p.kind, p.seq) for p in report.problems] == [
            ("missing", 2),
            ("unreadable", 2**63 - 1),
        ], report.problems
        assert report.warnings == []


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_head_edited_to_name_another_user_is_reported_and_not_saved_so(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # No hash covers a head's user column. verify passed, and its report, the heads saved
    # away each day, named alice's head "mallory": the next check against them would look
    # for mallory's trail, and no saved head would guard alice's.
    async with _tampered(kind, tmp_path, request) as (store, tamper):
        await store.append([_record("alice") for _ in range(3)] + [_record("bob")])
        edit = """UPDATE loom_audit_heads SET user_id = 'mallory' WHERE user_key = '"alice"'"""
        await tamper(edit)
        report = await store.verify()
        assert [(p.user_id, p.kind, p.seq) for p in report.problems] == [
            ("alice", "head_mismatch", 3)
        ], report.problems
        assert "names user 'mallory'" in report.problems[0].detail
        assert [(h.user_id, h.seq) for h in report.heads] == [("alice", 3), ("bob", 1)]
        # Nor do heads() (who the log knows: the console's search, a forget's look for
        # console chains) list mallory in alice's place.
        assert [(h.user_id, h.seq) for h in await store.heads()] == [("alice", 3), ("bob", 1)]
        alice = await store.head("alice")
        assert alice is not None
        assert alice.user_id == "alice"


@pytest.mark.parametrize("seq", [0, -5])
@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_head_edited_to_a_seq_no_entry_has_is_named_as_the_damage(
    kind: str, seq: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # It was read as a head the trail had grown past: "entries -4-4 come after the recorded
    # head (seq -5)", an `unanchored` that names the entries, not the edited head.
    async with _tampered(kind, tmp_path, request) as (store, tamper):
        await store.append([_record("alice") for _ in range(3)] + [_record("bob")])
        await tamper(f"""UPDATE loom_audit_heads SET seq = {seq} WHERE user_key = '"alice"'""")
        report = await store.verify()
        assert [(p.user_id, p.kind, p.seq) for p in report.problems] == [
            ("alice", "head_mismatch", seq)
        ], report.problems
        assert f"the recorded head names seq {seq}, which no entry has" in (
            report.problems[0].detail
        )
        assert report.warnings == []
