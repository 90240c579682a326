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
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    await store._write(_records("ana", 3) + _records("bob", 2))
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
    await store._write(_records("ana", 1))
    assert (await store.verify()).ok
    lines = [e.to_line() async for e in store.entries()]
    offline = verify_lines(lines)
    assert offline.ok, offline.problems
    assert offline.erased == 3


async def test_a_second_forget_erases_what_came_after_the_first(store: AuditStore) -> None:
    await store._write(_records("ana", 2))
    await store.erase("ana", reason="forget")
    await store._write(_records("ana", 2))
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
    await store._write(_records("ana", 1))
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
    await store._write(_records("console:ops", 4))  # seqs 3-6
    await store._write(_records("bob", 2))
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
    await store._write(_records("ana", 2) + _records("bob", 2) + _records("cy", 1))
    await store.place_hold("bob", reason="litigation L-7", actor="legal:dana")
    # The fresh record must stay younger than the cut-off through the three retains below,
    # on a loaded runner too (0.2 s was not enough on PostgreSQL under load).
    await asyncio.sleep(2.5)
    await store._write(_records("ana", 1, fresh=True))
    dry = await store.retain(dt.timedelta(seconds=2.0), dry_run=True)
    assert dry.erased == {"ana": 2, "cy": 1}
    assert dry.held == ["bob"]
    assert SECRET in await _stored_text(store)

    report = await store.retain(dt.timedelta(seconds=2.0), actor="test")
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
    again = await store.retain(dt.timedelta(seconds=2.0))
    assert again.erased == {}
    assert await store.count(action="audit.erasure") == 2


async def test_a_legal_hold_blocks_erasure_until_released(store: AuditStore) -> None:
    await store._write(_records("ana", 2))
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
    await store._write(_records("ana", 2))
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


async def _blank(store: AuditStore, user: str, seq: int) -> None:
    """Erase one payload behind the store's back, shaped exactly like an erasure: what the
    SQL update triggers let through, and what anyone who can write a file can do."""
    key = user_key(user)
    if isinstance(store, InMemoryAuditStore):
        for i, e in enumerate(store.all_entries):
            if user_key(e.user_id) == key and e.seq == seq:
                store.all_entries[i] = e.tombstoned()
    elif isinstance(store, JsonlAuditStore):
        lines = store.path.read_text(encoding="utf-8").splitlines(keepends=True)
        for i, line in enumerate(lines):
            e = AuditEntry.from_line(line)
            if user_key(e.user_id) == key and e.seq == seq:
                lines[i] = e.tombstoned().to_line() + "\n"
        store.path.write_text("".join(lines), encoding="utf-8")
    else:
        assert isinstance(store, SqliteAuditStore | PostgresAuditStore)
        await store.db.execute(
            "UPDATE loom_audit SET payload = 'null', payload_salt = NULL "
            "WHERE user_key = $1 AND seq = $2",
            key,
            seq,
        )
    [blanked] = [e async for e in store.entries(user_id=user) if e.seq == seq]
    assert blanked.payload is None


async def _both_ways(store: AuditStore) -> list[tuple[str | None, str, int | None]]:
    """The problems of the store's own verify, which must be those of its export's."""
    report = await store.verify()
    lines = [e.to_line() async for e in store.entries()]
    offline = verify_lines(lines)
    found = [(p.user_id, p.kind, p.seq) for p in report.problems]
    assert [(p.user_id, p.kind, p.seq) for p in offline.problems] == found
    assert [p.detail for p in offline.problems] == [p.detail for p in report.problems]
    return found


async def test_an_erasure_after_a_retention_cut_off_is_not_on_record(store: AuditStore) -> None:
    # The retention record comes after the entry, but its cut-off does not reach it.
    await store._write(_records("ana", 2))
    await asyncio.sleep(2.5)  # see the retention test above: room for a loaded runner
    await store._write(AuditRecord(user_id="ana", actor="app", action="note.after"))
    report = await store.retain(dt.timedelta(seconds=2.0), actor="test")
    assert report.erased == {"ana": 2}
    ana = [e async for e in store.entries(user_id="ana")]
    assert [(e.action, e.payload is None) for e in ana] == [
        ("tool.call", True),
        ("tool.call", True),
        ("note.after", False),  # kept: written after the cut-off
        ("audit.erasure", False),
    ]
    assert (await store.verify()).ok
    await _blank(store, "ana", 3)
    assert await _both_ways(store) == [("ana", "erased", 3)]
    detail = (await store.verify()).problems[0].detail
    assert "no erasure record covers it: the one at seq 4 erased what was written before" in detail
    assert detail.endswith(f"(entry 3 was written at {ana[2].to_json()['time']})")


async def test_an_erasure_of_chosen_seqs_covers_those_seqs_only(store: AuditStore) -> None:
    # A forget's console erasure lists the seqs it erased; the rest of the chain keeps its
    # payloads, so a blank elsewhere is on no record, before the record or not.
    await store._write(_records("console:ada", 6))
    done = await store.erase_entries("console:ada", [3, 4], reason="forget")
    assert (done.record_seq, done.erased) == (7, 2)
    assert (await store.verify()).ok
    for seq in (1, 2, 5):
        await _blank(store, "console:ada", seq)
    found = await _both_ways(store)
    assert found == [("console:ada", "erased", s) for s in (1, 2, 5)]
    detail = (await store.verify()).problems[0].detail
    assert "the one at seq 7 erased entries 3-4 only" in detail


async def test_a_record_written_under_a_legal_hold_covers_nothing(store: AuditStore) -> None:
    # The hold lands just before the record (as in the race erasure loses): the record is
    # there, but erasure stopped, so no payload may be gone under it.
    await store._write(_records("ana", 2))
    append = store._write

    async def racing(records: Any) -> list[AuditEntry]:
        if getattr(records, "action", None) == "audit.erasure":
            store._write = append  # type: ignore[method-assign]
            await store.place_hold("ana", reason="late subpoena", actor="legal")
        return await append(records)

    store._write = racing  # type: ignore[method-assign]
    with pytest.raises(LegalHoldError):
        await store.erase("ana", reason="forget")
    assert [e.action async for e in store.entries(user_id="ana")][-2:] == [
        "legal_hold.placed",
        "audit.erasure",
    ]
    assert (await store.verify()).ok
    await _blank(store, "ana", 1)
    assert await _both_ways(store) == [("ana", "erased", 1)]
    assert "was written under a legal hold and erased nothing" in (
        (await store.verify()).problems[0].detail
    )


async def test_the_payload_of_a_hold_or_an_erasure_record_is_never_on_record(
    store: AuditStore,
) -> None:
    await store._write(_records("ana", 1))
    await store.place_hold("ana", reason="subpoena", actor="legal")
    await store.release_hold("ana", actor="legal")
    await store.erase("ana", reason="forget")  # seq 4: erases entry 1, keeps 2 and 3
    await store.erase("ana", reason="forget")  # seq 5: nothing left to take, recorded anyway
    assert (await store.verify()).ok
    await _blank(store, "ana", 2)  # the hold's reason
    await _blank(store, "ana", 4)  # the first record
    assert await _both_ways(store) == [("ana", "erased", 2), ("ana", "erased", 4)]
    assert "erasure keeps the payloads of legal_hold.placed entries" in (
        (await store.verify()).problems[0].detail
    )


async def test_sqlite_verify_catches_a_payload_erased_behind_its_back(tmp_path: Path) -> None:
    store = SqliteAuditStore(tmp_path / "audit.db")
    await store._write(_records("ana", 3))
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
    await store._write(_records("ana", 2))
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
    await store._write(_records("ana", 2))
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
    await store._write(_records("ana", 2))
    placed = False
    append = store._write

    async def racing(records: Any) -> list[AuditEntry]:
        # The hold lands after erase() checked for one, just before its record is written.
        nonlocal placed
        if not placed and getattr(records, "action", None) == "audit.erasure":
            placed = True
            await store.place_hold("ana", reason="late subpoena", actor="legal")
        return await append(records)

    store._write = racing  # type: ignore[method-assign]
    with pytest.raises(LegalHoldError, match="late subpoena"):
        await store.erase("ana", reason="forget")
    assert SECRET in await _stored_text(store)
    assert (await store.verify()).ok


# -- the erasure records' index picks every record that covers an entry ----------------------

_records_strategy = st.lists(
    st.tuples(
        st.integers(1, 40),  # seq
        st.one_of(st.none(), st.frozensets(st.integers(1, 40), max_size=6)),  # seqs
        st.one_of(st.none(), st.integers(0, 50)),  # before (time)
        st.booleans(),  # cut-off readable
        st.booleans(),  # written under a hold
        st.dictionaries(st.integers(1, 40).map(str), st.sampled_from(["d1", "d2"]), max_size=4),
    ),
    max_size=8,
)
_erased_strategy = st.lists(
    st.tuples(
        st.integers(1, 40),  # seq
        st.integers(0, 50),  # time
        st.sampled_from(["tool.call", "audit.erasure", "legal_hold.placed"]),
        st.sampled_from([2, 3]),  # hash version
        st.sampled_from(["d1", "d2"]),  # digest of the rest (version 2)
    ),
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(records=_records_strategy, erased=_erased_strategy)
def test_the_records_index_finds_what_checking_every_record_finds(
    records: list[Any], erased: list[Any]
) -> None:
    from loomflow.audit._store import VerifyReport, _ChainCheck, _Erased, _ErasureRecord

    check = _ChainCheck('"u"', "u")
    check.records = [
        _ErasureRecord(seq, {k: v for k, v in old.items()}, seqs, before, readable, void)
        for seq, seqs, before, readable, void, old in records
    ]
    check.erased = [
        _Erased(seq, seq, rest if version == 2 else None, time, action, version)
        for seq, time, action, version, rest in erased
    ]
    report = VerifyReport()
    check.finish_erasures(report)
    expected = []
    for gone in check.erased:
        later = [r for r in check.records if r.seq > gone.seq]
        covering = [r for r in later if r.covers(gone)]
        if not later or not covering:
            expected.append(("erased", gone.seq))
        elif gone.rest is not None and not any(
            r.pre_v3.get(str(gone.seq)) == gone.rest for r in covering
        ):
            expected.append(("edited", gone.seq))
    assert [(p.kind, p.seq) for p in report.problems] == expected


async def _edit_behind_its_back(backend: str, where: Any, *statements: str) -> None:
    """Run ``statements`` against the audit tables with their triggers out of the way."""
    if backend == "sqlite":
        with sqlite3.connect(where) as conn:
            conn.execute("DROP TRIGGER loom_audit_no_update")
            conn.execute("DROP TRIGGER loom_audit_no_delete")
            for sql in statements:
                if not sql.startswith("UPDATE loom_audit_heads"):  # the trigger moved it
                    conn.execute(sql)
        return
    conn = await asyncpg.connect(where)
    try:
        await conn.execute("ALTER TABLE loom_audit DISABLE TRIGGER USER")
        await conn.execute("ALTER TABLE loom_audit_heads DISABLE TRIGGER USER")
        for sql in statements:
            await conn.execute(sql)
        await conn.execute("ALTER TABLE loom_audit ENABLE TRIGGER USER")
        await conn.execute("ALTER TABLE loom_audit_heads ENABLE TRIGGER USER")
    finally:
        await conn.close()


EDITED_PAYLOAD = (
    """UPDATE loom_audit SET payload = '{"email":"x","i":0}' WHERE seq = 1 AND user_id = 'ana'"""
)
FORGED_V2 = (
    "INSERT INTO loom_audit (user_key, user_id, seq, time_us, session_id, run_id, actor, "
    "action, payload, schema_version, prev_hash, hash, hash_version) SELECT user_key, user_id, "
    "3, time_us + 1, NULL, NULL, actor, 'tool.call', '{\"tool\":\"rm\"}', schema_version, hash, "
    "repeat('a', 64), 2 FROM loom_audit WHERE seq = 2 AND user_id = 'ana'",
    "UPDATE loom_audit_heads SET seq = 3, hash = repeat('a', 64) WHERE user_id = 'ana'",
)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
@pytest.mark.parametrize("edit", ["payload", "forged"])
async def test_erasure_never_launders_an_edited_or_forged_entry(
    backend: str, edit: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """An erased payload can no longer be held against its digest, and an erasure record
    vouches for a version 2 entry by a digest taken when it erases: erasing the payload of an
    entry changed in the database would turn a failing verify into a passing one. Forget and
    retention refuse that user instead, and verify keeps reporting the change."""
    from loomflow.errors import AuditIntegrityError

    def open_store() -> AuditStore:
        if backend == "sqlite":
            return SqliteAuditStore(tmp_path / "audit.db")
        return PostgresAuditStore(request.getfixturevalue("pg_dsn"))

    where: Any = tmp_path / "audit.db" if backend == "sqlite" else request.getfixturevalue("pg_dsn")
    store = open_store()
    await store._write(_records("ana", 2) + _records("bob", 2))
    await store.close()
    statements = (EDITED_PAYLOAD,) if edit == "payload" else FORGED_V2
    if backend == "sqlite":
        statements = tuple(s.replace("repeat('a', 64)", "'" + "a" * 64 + "'") for s in statements)
    await _edit_behind_its_back(backend, where, *statements)

    store = open_store()
    try:
        before = [(p.kind, p.seq) for p in (await store.verify(user_id="ana")).problems]
        assert before
        assert all(kind == "edited" for kind, _ in before)
        with pytest.raises(AuditIntegrityError, match=r"ana.*nothing was erased"):
            await store.erase("ana", reason="forget")
        with pytest.raises(AuditIntegrityError, match="ana"):
            await store.check_erasable("ana")
        await asyncio.sleep(0.01)
        report = await store.retain(dt.timedelta(milliseconds=1))
        assert "ana" in report.refused
        assert report.erased == {"bob": 2}
        assert report.to_json()["refused"][0]["user_id"] == "ana"
        after = [(p.kind, p.seq) for p in (await store.verify(user_id="ana")).problems]
        assert after == before
        assert (await store.verify(user_id="bob")).ok
    finally:
        await store.close()


# Damage that no single entry shows (each left entry still matches its own hash): only the
# chain, as verify walks it, does.
DAMAGE = {
    "deleted": ("DELETE FROM loom_audit WHERE user_id = 'ana' AND seq = 2",),
    "reordered": (
        "UPDATE loom_audit SET seq = 99 WHERE user_id = 'ana' AND seq = 2",
        "UPDATE loom_audit SET seq = 2 WHERE user_id = 'ana' AND seq = 3",
        "UPDATE loom_audit SET seq = 3 WHERE user_id = 'ana' AND seq = 99",
    ),
}


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_retention_leaves_a_damaged_trail_alone_and_says_why(
    backend: str, damage: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Retention (dry run or not) refuses any trail verify finds damaged, naming the damage,
    and the CLI exits 1 as verify does; the other users' payloads still go."""
    where: Any = tmp_path / "audit.db" if backend == "sqlite" else request.getfixturevalue("pg_dsn")
    url = f"sqlite:///{where}" if backend == "sqlite" else where

    def open_store() -> AuditStore:
        return SqliteAuditStore(where) if backend == "sqlite" else PostgresAuditStore(where)

    store = open_store()
    await store._write(_records("ana", 4) + _records("bob", 2))
    await store.close()
    await _edit_behind_its_back(backend, where, *DAMAGE[damage])
    kind = "missing" if damage == "deleted" else "reordered"
    store = open_store()
    try:
        before = (await store.verify(user_id="ana")).problems
        assert kind in {p.kind for p in before}
        await asyncio.sleep(0.01)
        for dry_run in (True, False):
            report = await store.retain(dt.timedelta(milliseconds=1), dry_run=dry_run)
            assert list(report.refused) == ["ana"]
            assert f"{kind}: entr" in report.refused["ana"]
            assert "nothing of it was erased" in report.refused["ana"]
            assert list(report.erased) == ["bob"]
        assert (await store.verify(user_id="ana")).problems == before
        assert all([e.payload is not None async for e in store.entries(user_id="ana")])
        assert (await store.verify(user_id="bob")).ok
    finally:
        await store.close()
    await asyncio.sleep(1.1)  # ana's entries older than the CLI's shortest age
    for flag in ("--dry-run", "--yes"):
        done = _retain_cli(url, flag)
        assert done.returncode == 1, done.stderr
        assert "loomflow: error: the audit trail of user 'ana' is damaged (" in done.stderr
        assert f"{kind}: entr" in done.stderr
        assert "audit verify --user ana" in done.stderr


def _retain_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    command = ["audit", "--audit-url", url, "retain", "--older-than", "1s", *args]
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *command],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
@pytest.mark.parametrize("key_too", [False, True], ids=["user_id", "user_id_and_key"])
async def test_retention_survives_a_user_id_edited_into_no_valid_id(
    backend: str, key_too: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A row's user id edited to hold a control character (no writer makes one) named a
    user retention could not even look up: it stopped with an id error, nobody's payloads
    went and no trail was reported. The trail is refused, the others are retained."""
    where: Any = tmp_path / "audit.db" if backend == "sqlite" else request.getfixturevalue("pg_dsn")

    def open_store() -> AuditStore:
        return SqliteAuditStore(where) if backend == "sqlite" else PostgresAuditStore(where)

    store = open_store()
    await store._write(_records("ana", 2) + _records("bob", 2))
    await store.close()
    bad = "'bob' || chr(27) || '[1m'".replace("chr(", "char(" if backend == "sqlite" else "chr(")
    key = f", user_key = '\"' || {bad} || '\"'" if key_too else ""
    await _edit_behind_its_back(
        backend, where, f"UPDATE loom_audit SET user_id = {bad}{key} WHERE user_id = 'bob'"
    )
    store = open_store()
    try:
        await asyncio.sleep(0.01)
        for dry_run in (True, False):
            report = await store.retain(dt.timedelta(milliseconds=1), dry_run=dry_run)
            assert list(report.erased) == ["ana"]
            [(user, why)] = report.refused.items()
            assert "nothing of it was erased" in why
            assert user == ("bob\x1b[1m" if key_too else "bob")
        assert all([e.payload is not None async for e in store.entries(user_id="bob")])
    finally:
        await store.close()


async def _held_then_edited(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, edit: str
) -> Any:
    """ana's trail: two entries and a legal hold, then ``edit`` run behind the store's back.
    Returns where the store is (a SQLite path or a PostgreSQL DSN)."""
    where: Any = tmp_path / "audit.db" if backend == "sqlite" else request.getfixturevalue("pg_dsn")
    store = SqliteAuditStore(where) if backend == "sqlite" else PostgresAuditStore(where)
    await store._write(_records("ana", 2))
    await store.place_hold("ana", reason="litigation L-7", actor="legal")
    await store.close()
    await _edit_behind_its_back(backend, where, edit)
    return where


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_hold_edited_into_a_release_does_not_let_erasure_through(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The payloads of holds and erasure records are never erased, so their entries were
    left out of the check for edited entries: a `legal_hold.placed` edited in the database
    into `legal_hold.released` (its hash no longer matches) lifted the hold, and forget
    erased the held user's payloads. The changed entry refuses the erasure instead."""
    from loomflow.errors import AuditIntegrityError

    where = await _held_then_edited(
        backend,
        tmp_path,
        request,
        "UPDATE loom_audit SET action = 'legal_hold.released' WHERE action = 'legal_hold.placed'",
    )
    store = SqliteAuditStore(where) if backend == "sqlite" else PostgresAuditStore(where)
    try:
        assert [(p.kind, p.seq) for p in (await store.verify(user_id="ana")).problems] == [
            ("edited", 3)
        ]
        with pytest.raises(AuditIntegrityError, match=r"ana.*\(seq 3\)"):
            await store.check_erasable("ana")
        with pytest.raises(AuditIntegrityError, match=r"ana.*nothing was erased"):
            await store.erase("ana", reason="forget")
        assert [e.payload is not None async for e in store.entries(user_id="ana")] == [True] * 3
    finally:
        await store.close()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_forget_leaves_a_trail_alone_whose_hold_was_moved_out_of_it(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A hold is looked up in the user's trail. Its row moved under another trail key (no
    hash covers the key) left the trail `truncated`, the hold unseen, and a forget erased the
    held user's data. As retention does, a forget leaves a trail verify finds damaged alone."""
    from loomflow.config import Settings
    from loomflow.errors import AuditIntegrityError
    from loomflow.stores import Stores

    where = await _held_then_edited(
        backend,
        tmp_path,
        request,
        """UPDATE loom_audit SET user_key = '"zed"' WHERE action = 'legal_hold.placed'""",
    )
    url = f"sqlite:///{where}" if backend == "sqlite" else where
    async with Stores(Settings(runtime_url=url)) as stores:
        assert await stores.audit.legal_hold("ana") is None  # the trail no longer shows it
        found = {p.kind for p in (await stores.audit.verify(user_id="ana")).problems}
        assert "truncated" in found
        with pytest.raises(AuditIntegrityError, match=r"stopped before deleting anything.*ana"):
            await stores.forget_user("ana")
        kept = [e.payload async for e in stores.audit.entries(user_id="ana")]
        assert len(kept) == 2
        assert None not in kept
        assert "erased" not in {p.kind for p in (await stores.audit.verify()).problems}
