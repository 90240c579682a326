"""Hash version 2 (RFC 8785) for new entries, version 1 kept verifying, both in one chain."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from loomflow.audit import (
    GENESIS,
    AuditEntry,
    AuditRecord,
    JsonlAuditStore,
    SqliteAuditStore,
    verify_lines,
)
from loomflow.audit._entry import canonical_bytes, canonical_json
from loomflow.audit.migrations import COMPONENT, migrations_for
from loomflow.errors import AuditError, StoreUnavailableError
from loomflow.storage import Database, PostgresDatabase, SqliteDatabase, apply_migrations

T0 = 1_778_230_443_512_000  # 2026-05-08T08:54:03.512Z, in microseconds

# Values whose spelling differs between Python's json.dumps (hash version 1) and RFC 8785,
# with the RFC 8785 spelling written out by hand rather than by the library under test.
TRICKY: dict[str, Any] = {
    "\uffff": "last by code point",
    "\U0001f600": "first by UTF-16 unit (D83D < FFFF)",
    "big": 1e20,
    "huge": 1e21,
    "negzero": -0.0,
    "sep": "a\u2028b",
    "tiny": 1.5e-07,
    "whole": 5.0,
}
TRICKY_JCS = (
    '{"big":100000000000000000000,"huge":1e+21,"negzero":0,"sep":"a\u2028b","tiny":1.5e-7,'
    '"whole":5,"\U0001f600":"first by UTF-16 unit (D83D < FFFF)","\uffff":"last by code point"}'
)


def _v1(seq: int, prev: str, payload: dict[str, Any], user: str = "alice") -> AuditEntry:
    """An entry as loomflow before hash versions wrote it (the version 1 hash, no field)."""
    draft = AuditEntry(
        user_id=user,
        seq=seq,
        time_us=T0 + seq,
        actor="agent:old",
        action="tool.call",
        payload=payload,
        prev_hash=prev,
        hash="",
    )
    assert draft.hash_version == 1
    return draft.model_copy(update={"hash": draft.computed_hash()})


def _v1_trail(count: int, user: str = "alice") -> list[AuditEntry]:
    out: list[AuditEntry] = []
    for seq in range(1, count + 1):
        out.append(_v1(seq, out[-1].hash if out else GENESIS, {"i": seq, **TRICKY}, user))
    return out


def _body(line_or_entry: str | AuditEntry) -> dict[str, Any]:
    data = json.loads(line_or_entry) if isinstance(line_or_entry, str) else line_or_entry.to_json()
    return {k: v for k, v in data.items() if k != "hash"}


def test_a_new_entry_is_version_2_and_hashes_its_rfc8785_form() -> None:
    record = AuditRecord(user_id="alice", actor="a", action="x", payload=TRICKY).checked()
    entry = AuditEntry.seal(record, seq=1, time_us=T0, prev_hash=GENESIS, hash_version=2)
    assert entry.hash_version == 2
    line = json.loads(entry.to_line())
    assert line["hash_version"] == 2
    payload_bytes = TRICKY_JCS.encode("utf-8")
    assert payload_bytes in entry.canonical_bytes()
    assert entry.hash == hashlib.sha256(entry.canonical_bytes()).hexdigest()
    assert entry.canonical_bytes() == rfc8785.dumps(_body(entry.to_line()))
    # The same content under Python's spelling is another hash: the version matters.
    assert entry.model_copy(update={"hash_version": 1}).computed_hash() != entry.hash, (
        "version 1 and 2 must not coincide on these values"
    )
    assert canonical_json(TRICKY).encode() != payload_bytes


@pytest.mark.parametrize(
    ("value", "spelled"),
    [
        (1.5e-07, b"1.5e-7"),
        (1e21, b"1e+21"),
        (1e20, b"100000000000000000000"),
        (-0.0, b"0"),
        (5.0, b"5"),
        (0.1, b"0.1"),
        (9007199254740991, b"9007199254740991"),
        ("\u2028\x7f\x1f", '"\u2028\x7f\\u001f"'.encode()),
    ],
)
def test_numbers_and_text_take_their_rfc8785_spelling(value: Any, spelled: bytes) -> None:
    record = AuditRecord(user_id="u", actor="a", action="x", payload={"v": value}).checked()
    entry = AuditEntry.seal(record, seq=1, time_us=T0, prev_hash=GENESIS, hash_version=2)
    assert b'"payload":{"v":' + spelled + b"}" in entry.canonical_bytes()


def test_keys_sort_by_utf16_units_in_version_2_and_by_code_points_in_version_1() -> None:
    payload = {"\uffff": 1, "\U0001f600": 2}
    record = AuditRecord(user_id="u", actor="a", action="x", payload=payload).checked()
    entry = AuditEntry.seal(record, seq=1, time_us=T0, prev_hash=GENESIS, hash_version=2)
    assert '{"\U0001f600":2,"\uffff":1}'.encode() in entry.canonical_bytes()
    old = entry.model_copy(update={"hash_version": 1})
    assert '{"\uffff":1,"\U0001f600":2}'.encode() in old.canonical_bytes()


def test_integers_beyond_2_53_are_stored_as_strings_and_bad_text_is_replaced() -> None:
    record = AuditRecord(
        user_id="u",
        actor="a",
        action="x",
        payload={
            "max": 2**53 - 1,
            "over": 2**53,
            "under": -(2**53),
            "huge": [10**30],
            "lone": "a\ud800b",
            "\udc00key": True,
        },
    ).checked()
    assert record.payload == {
        "max": 2**53 - 1,
        "over": "9007199254740992",
        "under": "-9007199254740992",
        "huge": ["1" + "0" * 30],
        "lone": "a\ufffdb",
        "\ufffdkey": True,
    }
    entry = AuditEntry.seal(record, seq=1, time_us=T0, prev_hash=GENESIS, hash_version=2)
    assert verify_lines([entry.to_line()]).ok


@pytest.mark.parametrize(
    "payload", [{"n": 2**60}, {"n": float("nan")}, {"s": "\ud800"}, {"k": object()}]
)
def test_sealing_content_without_a_canonical_form_is_a_typed_error(payload: Any) -> None:
    # Stores pass records through checked() first; a direct seal must not crash untyped.
    record = AuditRecord.model_construct(
        user_id="u", session_id=None, run_id=None, actor="a", action="x", payload=payload
    )
    with pytest.raises(AuditError, match="hash version 2"):
        AuditEntry.seal(record, seq=1, time_us=T0, prev_hash=GENESIS, hash_version=2)


def _v2_chain(count: int, start: AuditEntry | None = None) -> list[AuditEntry]:
    out: list[AuditEntry] = []
    prev, seq = (start.hash, start.seq) if start is not None else (GENESIS, 0)
    for i in range(count):
        seq += 1
        record = AuditRecord(
            user_id="alice", actor="agent:new", action="tool.call", payload={"i": i, **TRICKY}
        ).checked()
        entry = AuditEntry.seal(
            record, seq=seq, time_us=T0 + 100 + seq, prev_hash=prev, hash_version=2
        )
        out.append(entry)
        prev = entry.hash
    return out


def test_an_export_mixing_versions_verifies_and_every_kind_of_tampering_is_found() -> None:
    old = _v1_trail(3)
    new = _v2_chain(3, start=old[-1])
    lines = [e.to_line() for e in old + new]
    assert all("hash_version" not in json.loads(line) for line in lines[:3])
    report = verify_lines(lines)
    assert report.ok, report.problems
    assert report.entries == 6

    def kinds(changed: list[str]) -> list[tuple[str, int | None]]:
        return [(p.kind, p.seq) for p in verify_lines(changed).problems]

    edited = json.loads(lines[4])
    edited["payload"]["tiny"] = 1.5e-06
    assert kinds([*lines[:4], canonical_json(edited), *lines[5:]]) == [("edited", 5)]
    # Relabelled as version 1 (the field dropped): Python's spelling gives another hash.
    downgraded = json.loads(lines[4])
    del downgraded["hash_version"]
    assert kinds([*lines[:4], canonical_json(downgraded), *lines[5:]]) == [("edited", 5)]
    upgraded = json.loads(lines[1]) | {"hash_version": 2}
    assert kinds([lines[0], canonical_json(upgraded), *lines[2:]]) == [("edited", 2)]
    # Spelled differently but the same values: still intact (the hash is over values).
    respelled = (
        lines[4].replace('"whole":5.0', '"whole":5').replace('"tiny":1.5e-07', '"tiny":1.5e-7')
    )
    assert respelled != lines[4]
    assert verify_lines([*lines[:4], respelled, *lines[5:]]).ok


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"payload": {"n": 2**60}}, "cannot be hashed"),
        ({"hash_version": 4}, "unknown audit hash version 4"),
    ],
)
def test_content_that_cannot_be_hashed_is_reported_as_edited(
    change: dict[str, Any], why: str
) -> None:
    entry = _v2_chain(1)[0]
    data = entry.to_json() | change
    line = json.dumps(data)
    report = verify_lines([line])
    assert [(p.kind, p.seq) for p in report.problems] == [("edited", 1)]
    assert why in report.problems[0].detail


@pytest.mark.parametrize("schema", [2, 0, -1])
def test_an_entry_of_a_layout_this_loomflow_does_not_know_is_not_vouched_for(
    schema: int, tmp_path: Path
) -> None:
    # Hashed whole (a writer, or someone re-hashing the trail, made it so), but its fields
    # may mean what this loomflow does not know: verify must not call it intact.
    first, last = _v2_chain(2)
    relabelled = last.model_copy(update={"schema_version": schema})
    relabelled = relabelled.model_copy(update={"hash": relabelled.computed_hash()})
    report = verify_lines([first.to_line(), relabelled.to_line()])
    assert [(p.kind, p.seq) for p in report.problems] == [("edited", 2)]
    assert f"schema version {schema}" in report.problems[0].detail
    assert "reads version 1" in report.problems[0].detail


def test_a_nan_in_an_exported_line_is_unreadable() -> None:
    # NaN is not JSON: Python's parser alone takes it, so a line holding one is not read as
    # an entry (as the Node verifier cannot read it either).
    data = _v2_chain(1)[0].to_json() | {"payload": {"n": float("nan")}}
    report = verify_lines([json.dumps(data)])  # allow_nan: what a forger could write
    assert [(p.kind, p.position) for p in report.problems] == [("unreadable", 1)]
    assert "NaN is not JSON" in report.problems[0].detail


@pytest.mark.parametrize("version", [True, "2", 2.0, None])
def test_a_hash_version_of_another_type_is_unreadable(version: Any) -> None:
    data = _v2_chain(1)[0].to_json() | {"hash_version": version}
    report = verify_lines([json.dumps(data)])
    assert [p.kind for p in report.problems] == ["unreadable"]


async def _old_sql_trail(db: Database, trail: list[AuditEntry]) -> None:
    """The tables as audit schema version 2 left them, holding a version 1 trail."""
    await db.open()
    assert await apply_migrations(db, COMPONENT, migrations_for(db.dialect.name)[:2]) == 2
    for e in trail:
        # The column list of loomflow before hash versions: no hash_version.
        await db.execute(
            "INSERT INTO loom_audit (user_key, user_id, seq, time_us, session_id, run_id, "
            "actor, action, payload, schema_version, prev_hash, hash) "
            "VALUES ($1, $2, $3, $4, NULL, NULL, $5, $6, $7, $8, $9, $10)",
            json.dumps(e.user_id),
            e.user_id,
            e.seq,
            e.time_us,
            e.actor,
            e.action,
            canonical_json(e.payload),
            e.schema_version,
            e.prev_hash,
            e.hash,
        )
    await db.close()


async def _upgrade_and_extend(store: SqliteAuditStore | Any, old: list[AuditEntry]) -> None:
    assert await store.migrate() == 4
    assert (await store.verify()).ok  # the version 1 rows, untouched by the migration
    new = await store.append(
        [AuditRecord(user_id="alice", actor="agent:new", action="x", payload=TRICKY)] * 2
    )
    assert [(e.seq, e.hash_version, e.prev_hash) for e in new] == [
        (4, 3, old[-1].hash),
        (5, 3, new[0].hash),
    ]
    stored = [e async for e in store.entries(user_id="alice")]
    assert [e.hash_version for e in stored] == [1, 1, 1, 3, 3]
    assert stored[:3] == old
    report = await store.verify()
    assert report.ok, report.problems
    assert (report.entries, report.heads[0].hash) == (5, new[-1].hash)


async def test_a_sqlite_trail_written_before_hash_versions_goes_on_as_version_3(
    tmp_path: Path,
) -> None:
    old = _v1_trail(3)
    await _old_sql_trail(SqliteDatabase(tmp_path / "audit.db"), old)
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        await _upgrade_and_extend(store, old)
        out = tmp_path / "export.jsonl"
        assert await store.export(out) == 5
        lines = out.read_text(encoding="utf-8").splitlines()
        assert verify_lines(lines, heads=(await store.verify()).heads).ok
    finally:
        await store.close()
    # Edit a version 2 row behind the store's back (triggers off, as a file writer could).
    import sqlite3

    with sqlite3.connect(tmp_path / "audit.db") as conn:
        conn.execute("DROP TRIGGER loom_audit_no_update")
        conn.execute(
            "UPDATE loom_audit SET payload = ? WHERE seq = 5",
            (canonical_json(TRICKY | {"tiny": 2.5e-07}),),
        )
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        assert [(p.kind, p.seq) for p in (await store.verify()).problems] == [("edited", 5)]
    finally:
        await store.close()


async def test_a_postgres_trail_written_before_hash_versions_goes_on_as_version_3(
    pg_dsn: str,
) -> None:
    from loomflow.audit import PostgresAuditStore

    old = _v1_trail(3)
    await _old_sql_trail(PostgresDatabase(pg_dsn), old)
    store = PostgresAuditStore(pg_dsn)
    try:
        await _upgrade_and_extend(store, old)
        # The insert trigger still guards the head with the new column in place.
        with pytest.raises(StoreUnavailableError, match="does not extend its chain head"):
            await store.db.execute(
                "INSERT INTO loom_audit (user_key, user_id, seq, time_us, actor, action, "
                "payload, schema_version, prev_hash, hash, hash_version) "
                "VALUES ('\"alice\"', 'alice', 9, 0, 'a', 'x', '{}', 1, $1, 'f', 2)",
                GENESIS,
            )
    finally:
        await store.close()


def _write_old_jsonl(path: Path, old: list[AuditEntry]) -> None:
    """A JSON-lines log and heads file as loomflow before hash versions left them."""
    data = "".join(e.to_line() + "\n" for e in old).encode("utf-8")
    path.write_bytes(data)
    last = old[-1].to_line().encode("utf-8") + b"\n"
    heads = {
        "size": len(data),
        "users": {'"alice"': {"user_id": "alice", "seq": len(old), "hash": old[-1].hash}},
        "last": {"start": len(data) - len(last), "sha256": hashlib.sha256(last).hexdigest()},
    }
    Path(str(path) + ".heads").write_text(json.dumps(heads), encoding="utf-8")


async def test_a_jsonl_trail_written_before_hash_versions_goes_on_as_version_3(
    tmp_path: Path,
) -> None:
    old = _v1_trail(3)
    path = tmp_path / "audit.jsonl"
    _write_old_jsonl(path, old)
    store = JsonlAuditStore(path, fsync=False)
    assert (await store.verify()).ok
    new = await store.append(AuditRecord(user_id="alice", actor="a", action="x", payload=TRICKY))
    assert (new[0].seq, new[0].hash_version, new[0].prev_hash) == (4, 3, old[-1].hash)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[-1])["hash_version"] == 3
    assert "hash_version" not in json.loads(lines[0])
    report = await store.verify()
    assert report.ok, report.problems
    assert report.entries == 4


def test_export_lines_escape_the_characters_line_readers_break_at() -> None:
    record = AuditRecord(
        user_id="u", actor="a", action="x", payload={"t": "a\u2028b\u2029c\x85d"}
    ).checked()
    entry = AuditEntry.seal(record, seq=1, time_us=T0, prev_hash=GENESIS, hash_version=2)
    line = entry.to_line()
    assert '"t":"a\\u2028b\\u2029c\\u0085d"' in line
    assert line.splitlines() == [line]
    assert AuditEntry.from_json(json.loads(line)) == entry
    assert "a\u2028b\u2029c\x85d".encode() in entry.canonical_bytes()  # raw in RFC 8785


def test_the_hash_is_the_same_in_another_process() -> None:
    """No dependence on hash seeds, dict order or the process: a fresh interpreter agrees."""
    entries = [*_v1_trail(2), *_v2_chain(2)]
    lines = [e.to_line() for e in entries]
    script = (
        "import json, sys\n"
        "from loomflow.audit import AuditEntry\n"
        "for line in sys.stdin.read().splitlines():\n"
        "    print(AuditEntry.from_json(json.loads(line)).computed_hash())\n"
    )
    for seed in ("0", "12345"):
        done = subprocess.run(
            [sys.executable, "-c", script],
            input="\n".join(lines),
            capture_output=True,
            text=True,
            encoding="utf-8",
            env={**os.environ, "PYTHONHASHSEED": seed},
            check=True,
        )
        assert done.stdout.split() == [e.hash for e in entries]


# Text that leans on the cases that matter: beyond U+FFFF, just below it, lone surrogates.
_TEXT = st.text(
    st.characters()
    | st.sampled_from(["\ud800", "\udfff", "\U0001f600", "\uffff", "\ue000", "\x00", "\u2028"]),
    max_size=4,
)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(_JSON)
def test_version_2_bytes_are_rfc8785_on_any_json(value: Any) -> None:
    """The fast path (Python's spelling where it coincides) never differs from rfc8785."""
    try:
        expected: bytes | None = rfc8785.dumps(value)
    except ValueError:  # rfc8785's own errors, and UnicodeEncodeError on a surrogate key
        expected = None
    if expected is None:
        with pytest.raises(AuditError):
            canonical_bytes(value, 2)
    else:
        assert canonical_bytes(value, 2) == expected


@pytest.mark.parametrize(
    "value",
    [
        {"\U0001f600": 1, "\uffff": 2, "a": 3},
        {"k": [1, 2.0]},
        {"k": 2**53},
        {1: "int key"},
        {"s": "\ud800"},
        {"\ud800": 1},
        {"c": '\x00\x1f\x7f\u2028"\\'},
    ],
)
def test_version_2_bytes_are_rfc8785_on_the_edges_of_the_fast_path(value: Any) -> None:
    try:
        expected: bytes | None = rfc8785.dumps(value)
    except ValueError:  # rfc8785's own errors, and UnicodeEncodeError on a surrogate key
        expected = None
    if expected is None:
        with pytest.raises(AuditError):
            canonical_bytes(value, 2)
    else:
        assert canonical_bytes(value, 2) == expected
