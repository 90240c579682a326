"""Erasure, retention and legal hold on every audit backend, with real files and databases.

A payload is erased in place; the chain keeps verifying because hash version 3 covers a salted
digest of the payload, and an erased entry of an older version is vouched for by the erasure
record that follows it. What must not pass: a payload erased with no record after it, an
erased old entry changed afterwards, a payload edited under its digest.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sqlite3
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from loomflow.audit import (
    GENESIS,
    AuditEntry,
    AuditRecord,
    AuditStore,
    InMemoryAuditStore,
    JsonlAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
    verify_lines,
)
from loomflow.audit._entry import canonical_json, user_key
from loomflow.errors import InvalidArgumentError, LegalHoldError, UserError

SECRET = "ana.secret@example.com"


def _records(user: str, n: int, **extra: Any) -> list[AuditRecord]:
    return [
        AuditRecord(
            user_id=user,
            session_id="s-1",
            actor="agent:support",
            action="tool.call",
            payload={"i": i, "email": SECRET if user == "ana" else "bob@x.io", **extra},
        )
        for i in range(n)
    ]


async def _v2_entries(store: AuditStore, user: str, n: int) -> list[AuditEntry]:
    """Write ``n`` hash version 2 entries (as loomflow 0.21 before erasure did) into storage."""
    out: list[AuditEntry] = []
    for seq in range(1, n + 1):
        record = AuditRecord(
            user_id=user, actor="agent:old", action="tool.call", payload={"email": SECRET}
        ).checked()
        prev = out[-1].hash if out else GENESIS
        out.append(AuditEntry.seal(record, seq=seq, time_us=seq, prev_hash=prev, hash_version=2))
    if isinstance(store, InMemoryAuditStore):
        from loomflow.audit import ChainHead

        store.all_entries.extend(out)
        store._heads_by_key[user_key(user)] = ChainHead(user, n, out[-1].hash)
    elif isinstance(store, JsonlAuditStore):
        store.path.write_text("".join(e.to_line() + "\n" for e in out), encoding="utf-8")
        data = store.path.read_bytes()
        last = data.splitlines(keepends=True)[-1]
        import hashlib

        store.heads_path.write_text(
            json.dumps(
                {
                    "size": len(data),
                    "users": {user_key(user): {"user_id": user, "seq": n, "hash": out[-1].hash}},
                    "last": {
                        "start": len(data) - len(last),
                        "sha256": hashlib.sha256(last).hexdigest(),
                    },
                }
            ),
            encoding="utf-8",
        )
    else:
        assert isinstance(store, SqliteAuditStore | PostgresAuditStore)
        for e in out:
            await store.db.fetch(
                "INSERT INTO loom_audit (user_key, user_id, seq, time_us, actor, action, "
                "payload, schema_version, prev_hash, hash, hash_version) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, 1, $8, $9, 2)",
                user_key(user),
                user,
                e.seq,
                e.time_us,
                e.actor,
                e.action,
                canonical_json(e.payload),
                e.prev_hash,
                e.hash,
            )
    return out


async def _stored_text(store: AuditStore) -> str:
    """Everything the storage holds, as text: what an attacker reading it would see."""
    if isinstance(store, InMemoryAuditStore):
        return "\n".join(e.to_line() for e in store.all_entries)
    if isinstance(store, JsonlAuditStore):
        return store.path.read_text(encoding="utf-8")
    assert isinstance(store, SqliteAuditStore | PostgresAuditStore)
    rows = await store.db.fetch("SELECT payload, payload_salt FROM loom_audit")
    return "\n".join(f"{r[0]} {r[1]}" for r in rows)


async def test_forget_erases_payloads_and_the_chain_still_verifies(store: AuditStore) -> None:
    await store.append(_records("ana", 3) + _records("bob", 2))
    before = await store.verify()
    assert before.ok
    assert SECRET in await _stored_text(store)

    done = await store.erase("ana", reason="forget", actor="test", deleted={"journal": 4})
    assert (done.record_seq, done.erased) == (4, 3)
    assert SECRET not in await _stored_text(store)

    report = await store.verify()
    assert report.ok, report.problems
    assert report.erased == 3
    ana = [e async for e in store.entries(user_id="ana")]
    assert [e.payload is None for e in ana] == [True, True, True, False]
    record = ana[-1]
    assert record.action == "audit.erasure"
    assert record.payload == {
        "reason": "forget",
        "before": None,
        "entries": 3,
        "pre_v3": {},
        "deleted": {"journal": 4},
    }
    # Hashes and links did not move: the heads saved before still match.
    assert (await store.verify(heads=before.heads)).ok
    bob = [e async for e in store.entries(user_id="bob")]
    assert all(e.payload is not None and e.payload["email"] == "bob@x.io" for e in bob)
    # The trail goes on, and an export checks out offline.
    await store.append(_records("ana", 1))
    assert (await store.verify()).ok
    lines = [e.to_line() async for e in store.entries()]
    offline = verify_lines(lines)
    assert offline.ok, offline.problems
    assert offline.erased == 3


async def test_a_second_forget_erases_what_came_after_the_first(store: AuditStore) -> None:
    await store.append(_records("ana", 2))
    await store.erase("ana", reason="forget")
    await store.append(_records("ana", 2))
    again = await store.erase("ana", reason="forget")
    assert (again.record_seq, again.erased) == (6, 2)
    ana = [e async for e in store.entries(user_id="ana")]
    # The first erasure record keeps its payload: it holds no personal data.
    assert [e.action for e in ana if e.payload is not None] == ["audit.erasure"] * 2
    assert (await store.verify()).ok


async def test_erased_entries_of_hash_version_2_are_vouched_for_by_the_record(
    store: AuditStore,
) -> None:
    old = await _v2_entries(store, "ana", 2)
    await store.append(_records("ana", 1))
    assert (await store.verify()).ok
    done = await store.erase("ana", reason="forget")
    assert done.erased == 3
    ana = [e async for e in store.entries(user_id="ana")]
    assert ana[-1].payload is not None
    assert ana[-1].payload["pre_v3"] == {"1": old[0].rest_digest(), "2": old[1].rest_digest()}
    assert SECRET not in await _stored_text(store)
    report = await store.verify()
    assert report.ok, report.problems
    assert report.erased == 3
    # Offline: relabelling an erased version 2 entry is caught by the recorded digest.
    lines = [e.to_line() async for e in store.entries()]
    forged = json.loads(lines[0]) | {"action": "tool.replay"}
    kinds = [(p.kind, p.seq) for p in verify_lines([canonical_json(forged), *lines[1:]]).problems]
    assert kinds == [("edited", 1)]
    # Without the record, the erasure of every entry before it is unauthorised.
    kinds = [(p.kind, p.seq) for p in verify_lines(lines[:-1]).problems]
    assert kinds == [("erased", 1), ("erased", 2), ("erased", 3)]


async def test_erase_entries_takes_only_the_chosen_payloads_and_the_chain_verifies(
    store: AuditStore,
) -> None:
    old = await _v2_entries(store, "console:ops", 2)  # seqs 1-2, hash version 2
    await store.append(_records("console:ops", 4))  # seqs 3-6
    await store.append(_records("bob", 2))
    done = await store.erase_entries("console:ops", [2, 4, 6, 99], reason="forget")
    assert done.erased == 3
    chain = [e async for e in store.entries(user_id="console:ops")]
    assert [e.seq for e in chain if e.payload is None] == [2, 4, 6]
    record = chain[-1]
    assert record.action == "audit.erasure"
    assert record.payload is not None
    assert record.payload["seqs"] == [2, 4, 6]
    assert record.payload["pre_v3"] == {"2": old[1].rest_digest()}
    report = await store.verify()
    assert report.ok, report.problems
    assert report.erased == 3
    # Again: nothing left to take, nothing written; records and holds are never taken.
    again = await store.erase_entries("console:ops", [2, 4, record.seq], reason="forget")
    assert (again.erased, again.record_seq) == (0, None)
    assert len([e async for e in store.entries(user_id="console:ops")]) == len(chain)
    await store.place_hold("console:ops", reason="audit of the audit")
    with pytest.raises(LegalHoldError):
        await store.erase_entries("console:ops", [3], reason="forget")


async def test_retention_erases_only_old_payloads_and_spares_held_users(
    store: AuditStore,
) -> None:
    await store.append(_records("ana", 2) + _records("bob", 2) + _records("cy", 1))
    await store.place_hold("bob", reason="litigation L-7", actor="legal:dana")
    await asyncio.sleep(0.3)
    await store.append(_records("ana", 1, fresh=True))
    dry = await store.retain(dt.timedelta(seconds=0.2), dry_run=True)
    assert dry.erased == {"ana": 2, "cy": 1}
    assert dry.held == ["bob"]
    assert SECRET in await _stored_text(store)

    report = await store.retain(dt.timedelta(seconds=0.2), actor="test")
    assert report.erased == {"ana": 2, "cy": 1}
    assert report.held == ["bob"]
    ana = [e async for e in store.entries(user_id="ana")]
    assert [e.payload is None for e in ana] == [True, True, False, False]
    assert ana[2].payload is not None
    assert ana[2].payload["fresh"] is True
    assert ana[3].action == "audit.erasure"
    assert ana[3].payload is not None
    assert ana[3].payload["reason"] == "retention"
    bob = [e async for e in store.entries(user_id="bob")]
    assert all(e.payload is not None for e in bob)
    verified = await store.verify()
    assert verified.ok, verified.problems
    assert verified.erased == 3
    # Nothing left to erase: no new records.
    again = await store.retain(dt.timedelta(seconds=0.2))
    assert again.erased == {}
    assert await store.count(action="audit.erasure") == 2


async def test_a_legal_hold_blocks_erasure_until_released(store: AuditStore) -> None:
    await store.append(_records("ana", 2))
    hold = await store.place_hold("ana", reason="subpoena 2026-14", actor="legal:dana")
    assert (hold.user_id, hold.reason, hold.actor, hold.seq) == (
        "ana",
        "subpoena 2026-14",
        "legal:dana",
        3,
    )
    assert await store.legal_hold("ana") == hold
    assert [h.user_id for h in await store.legal_holds()] == ["ana"]
    with pytest.raises(LegalHoldError, match="subpoena 2026-14") as caught:
        await store.erase("ana", reason="forget")
    assert caught.value.user_id == "ana"
    assert caught.value.reason == "subpoena 2026-14"
    with pytest.raises(LegalHoldError, match="already under legal hold"):
        await store.place_hold("ana", reason="again")
    assert SECRET in await _stored_text(store)
    assert await store.count(user_id="ana", action="audit.erasure") == 0

    released = await store.release_hold("ana", actor="legal:dana", reason="case closed")
    assert released == hold
    assert await store.legal_hold("ana") is None
    assert await store.legal_holds() == []
    with pytest.raises(UserError, match="not under legal hold"):
        await store.release_hold("ana")
    done = await store.erase("ana", reason="forget")
    assert done.erased == 2  # the hold's own entries keep their payloads
    trail = [e async for e in store.entries(user_id="ana")]
    assert [e.action for e in trail if e.payload is not None] == [
        "legal_hold.placed",
        "legal_hold.released",
        "audit.erasure",
    ]
    assert (await store.verify()).ok


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"reason": ""}, "reason"),
        ({"reason": "x", "actor": ""}, "actor"),
    ],
)
async def test_erase_refuses_bad_arguments(
    store: AuditStore, bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        await store.erase("ana", **bad)
    with pytest.raises(UserError, match="user_id"):
        await store.erase("a\x00b", reason="forget")
    with pytest.raises(UserError, match="older_than"):
        await store.retain(dt.timedelta(0))


async def test_times_out_of_range_are_refused_not_overflowed(store: AuditStore) -> None:
    await store.append(_records("ana", 2))
    with pytest.raises(InvalidArgumentError, match="older_than"):
        await store.retain(dt.timedelta(days=999_999_999), dry_run=True)
    for bad in (1e300, -1e300, float("inf"), float("nan")):
        with pytest.raises(InvalidArgumentError, match="out of range"):
            await store.query(since=bad)
        with pytest.raises(InvalidArgumentError, match="out of range"):
            await store.count(until=bad)
    # The ends of the calendar are times like any other.
    early = dt.datetime(1, 1, 1, tzinfo=dt.UTC)
    late = dt.datetime(9999, 12, 31, tzinfo=dt.UTC)
    assert len((await store.query(since=early, until=late)).entries) == 2
    assert (await store.retain(dt.timedelta(days=365_000), dry_run=True)).erased == {}


async def test_sqlite_verify_catches_a_payload_erased_behind_its_back(tmp_path: Path) -> None:
    store = SqliteAuditStore(tmp_path / "audit.db")
    await store.append(_records("ana", 3))
    await store.close()
    with sqlite3.connect(tmp_path / "audit.db") as conn:
        # The trigger lets an erasure through (it is shaped like one); the chain tells.
        conn.execute("UPDATE loom_audit SET payload = 'null', payload_salt = NULL WHERE seq = 2")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("UPDATE loom_audit SET payload = '{}' WHERE seq = 1")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("UPDATE loom_audit SET payload = 'null', action = 'x' WHERE seq = 1")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM loom_audit WHERE seq = 1")
    store = SqliteAuditStore(tmp_path / "audit.db")
    report = await store.verify()
    await store.close()
    assert [(p.kind, p.seq) for p in report.problems] == [("erased", 2)]


async def test_a_payload_edited_under_its_digest_is_found(tmp_path: Path) -> None:
    store = SqliteAuditStore(tmp_path / "audit.db")
    await store.append(_records("ana", 2))
    await store.close()
    with sqlite3.connect(tmp_path / "audit.db") as conn:
        conn.execute("DROP TRIGGER loom_audit_no_update")
        conn.execute("""UPDATE loom_audit SET payload = '{"email":"x","i":0}' WHERE seq = 1""")
    store = SqliteAuditStore(tmp_path / "audit.db")
    report = await store.verify()
    await store.close()
    assert [(p.kind, p.seq) for p in report.problems] == [("edited", 1)]
    assert "no longer matches its digest" in report.problems[0].detail


@pytest.mark.postgres
async def test_postgres_lets_the_owner_erase_and_nothing_else(pg_dsn: str) -> None:
    store = PostgresAuditStore(pg_dsn)
    await store.append(_records("ana", 2))
    conn = await asyncpg.connect(pg_dsn)
    try:
        for sql in (
            "UPDATE loom_audit SET payload = '{}'",
            "UPDATE loom_audit SET payload = 'null', payload_salt = NULL, hash = 'x'",
            "DELETE FROM loom_audit",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
                await conn.execute(sql)
    finally:
        await conn.close()
    assert (await store.erase("ana", reason="forget")).erased == 2
    assert (await store.verify()).ok
    await store.close()


async def test_a_hold_placed_while_an_erasure_runs_still_wins(store: AuditStore) -> None:
    await store.append(_records("ana", 2))
    placed = False
    append = store.append

    async def racing(records: Any) -> list[AuditEntry]:
        # The hold lands after erase() checked for one, just before its record is written.
        nonlocal placed
        if not placed and getattr(records, "action", None) == "audit.erasure":
            placed = True
            await store.place_hold("ana", reason="late subpoena", actor="legal")
        return await append(records)

    store.append = racing  # type: ignore[method-assign]
    with pytest.raises(LegalHoldError, match="late subpoena"):
        await store.erase("ana", reason="forget")
    assert SECRET in await _stored_text(store)
    assert (await store.verify()).ok
