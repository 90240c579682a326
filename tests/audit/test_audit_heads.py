"""``AuditStore.heads()``: every user's recorded head, alike on every backend."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from loomflow.audit import (
    AuditRecord,
    AuditStore,
    ChainHead,
    ChainProblem,
    InMemoryAuditStore,
    JsonlAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
)
from loomflow.errors import AuditIntegrityError


def _store(kind: str, tmp_path: Path) -> AuditStore:
    if kind == "memory":
        return InMemoryAuditStore()
    if kind == "jsonl":
        return JsonlAuditStore(tmp_path / "audit.jsonl")
    return SqliteAuditStore(tmp_path / "audit.db")


@pytest.mark.parametrize("kind", ["memory", "jsonl", "sqlite"])
async def test_heads_name_every_user_with_their_last_entry(kind: str, tmp_path: Path) -> None:
    store = _store(kind, tmp_path)
    try:
        assert await store.heads() == []
        users = ["b/..", None, "a", "<é>"]
        written = await store.append(
            [AuditRecord(user_id=u, actor="t", action="x") for u in users for _ in range(2)]
        )
        heads = await store.heads()
        last = {e.user_id: e for e in written}
        assert sorted(heads, key=lambda h: str(h.user_id)) == sorted(
            (ChainHead(u, 2, last[u].hash) for u in users), key=lambda h: str(h.user_id)
        )
        assert heads == await store.heads()
    finally:
        await store.close()


async def test_iter_heads_pages_through_every_head_once(store: AuditStore) -> None:
    users = [None, "a", "b/..", "<é>", 'q"uote', "z" * 40, "A", "b"]
    await store.append([AuditRecord(user_id=u, actor="t", action="x") for u in users])
    listed = [h async for h in store.iter_heads(page_size=3)]  # pages of 3, 3 and 2
    assert sorted(listed, key=lambda h: str(h.user_id)) == sorted(
        await store.heads(), key=lambda h: str(h.user_id)
    )
    assert len({h.user_id for h in listed}) == len(users)
    assert [h async for h in store.iter_heads(page_size=len(users))] == listed  # a full page


async def test_iter_heads_refuses_a_page_size_below_one(store: AuditStore) -> None:
    with pytest.raises(ValueError, match="page_size must be at least 1, not 0"):
        [h async for h in store.iter_heads(page_size=0)]


async def test_a_head_key_edited_to_a_blob_is_an_integrity_error_not_an_endless_walk(
    tmp_path: Path,
) -> None:
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        await store.append([AuditRecord(user_id=u, actor="t", action="x") for u in "abc"])
    finally:
        await store.close()
    with sqlite3.connect(tmp_path / "audit.db") as db:
        db.execute("DROP TRIGGER loom_audit_heads_forward")  # as one who edits rows would
        db.execute("UPDATE loom_audit_heads SET user_key = CAST(user_key AS BLOB)")
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        with pytest.raises(AuditIntegrityError, match="user key is not text"):
            [h async for h in store.iter_heads(page_size=2)]
    finally:
        await store.close()


async def test_iter_head_rows_lists_every_head_with_a_damaged_one_in_its_place(
    tmp_path: Path,
) -> None:
    # iter_heads stops at the first head row edited by hand, so a listing of users through it
    # showed none of them; iter_head_rows goes on, with the row's problem in its place.
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        await store.append([AuditRecord(user_id=u, actor="t", action="x") for u in "abcde"])
    finally:
        await store.close()
    with sqlite3.connect(tmp_path / "audit.db") as db:
        db.execute("DROP TRIGGER loom_audit_heads_forward")
        db.execute("""UPDATE loom_audit_heads SET seq = 'two' WHERE user_key = '"b"'""")
        db.execute("""UPDATE loom_audit_heads SET user_id = X'64' WHERE user_key = '"d"'""")
        db.execute("""INSERT INTO loom_audit_heads VALUES (X'00', 'z', 1, 'x')""")
        db.execute("""INSERT INTO loom_audit_heads VALUES (X'01', 'z', 1, 'x')""")
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        for size in (1, 2, 1000):  # the blob keys are pages of their own too
            rows = [h async for h in store.iter_head_rows(page_size=size)]
            shown = [(h.user_id, getattr(h, "kind", None)) for h in rows]
            assert shown == [
                ("a", None),
                ("b", "head_mismatch"),
                ("c", None),
                ("d", "head_mismatch"),
                ("e", None),
                (None, "unreadable"),
                (None, "unreadable"),
            ], size
        [b] = [h for h in rows if h.user_id == "b"]
        assert isinstance(b, ChainProblem)
        assert "seq is 'two', not a whole number" in b.detail
        # iter_heads still refuses them, naming whose head it is.
        with pytest.raises(AuditIntegrityError, match=r"not a whole number\).*of user 'b'"):
            [h async for h in store.iter_heads()]
    finally:
        await store.close()


@pytest.mark.parametrize(
    "kind", ["sqlite", "jsonl", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_verify_while_another_process_appends_finds_nothing_wrong(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # `loomflow audit verify` on a store workers keep writing: entries appended after the
    # heads were read came "after the recorded head" (unanchored), exit status 1, every time.
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""

    def make() -> AuditStore:
        if kind == "postgres":
            return PostgresAuditStore(dsn)
        return _store(kind, tmp_path)

    def records(n: int) -> list[AuditRecord]:
        return [AuditRecord(user_id=u, actor="t", action="x") for u in ("ana", "bo")] * n

    async def append_elsewhere() -> None:
        other = make()
        try:
            await other.append(records(2))
        finally:
            await other.close()

    def meanwhile(done: int, total: int | None) -> None:
        if done == 0:  # verify has read the heads and not yet the entries
            writer = threading.Thread(target=asyncio.run, args=(append_elsewhere(),))
            writer.start()
            writer.join()

    store = make()
    try:
        await store.append(records(3))
        report = await store.verify(on_progress=meanwhile)
        assert (report.problems, report.warnings) == ([], []), report
        assert report.entries in (6, 10)  # JSONL reads one snapshot, the others read on
    finally:
        await store.close()
