"""Rows edited by hand in a real database read as damaged data, never as a Python error.

SQLite keeps any type in any column, so `UPDATE loom_entries SET value = '{...}'` stores text
where the value's bytes belong, and a number column can hold text; PostgreSQL's double holds
a created_at of 1e300 that no datetime can. Each case below raised a bare TypeError,
ValueError, OverflowError or RecursionError from a resume, a checkpoint load, a memory read or
an audit verify before; now it is the documented outcome (re-run, fall back, a typed error or
a verify problem).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from _cli import loomflow

from loomflow.agent import Agent, Tuning
from loomflow.audit import AuditLog, JsonlAuditStore, PostgresAuditStore, SqliteAuditStore
from loomflow.audit.offline import verify_lines
from loomflow.errors import AuditIntegrityError, CheckpointError, CorruptEntryError
from loomflow.memory import SqliteMemory
from loomflow.runtime import PostgresRuntime, SqliteRuntime, codec
from loomflow.testing.checkpoint_conformance import Shop


def sqlite_exec(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path)
    try:
        with conn:
            for sql in statements:
                conn.execute(sql)
    finally:
        conn.close()


async def pg_exec(dsn: str, *statements: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


# -- the codec ---------------------------------------------------------------------------------


@pytest.mark.parametrize("days", ["1e300", "99999999999", "-99999999999"])
def test_a_timedelta_out_of_range_is_a_malformed_value(days: str) -> None:
    raw = f'{{"$t":"timedelta","v":[{days},0,0]}}'.encode()
    with pytest.raises(codec.UnknownTagError, match="malformed 'timedelta'"):
        codec.loads(raw)


# -- journal rows --------------------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> dict[str, int]:
        self.calls += 1
        return {"fresh": self.calls}


async def _journal_with_open_run(path: Path, body: Counter) -> None:
    runtime = SqliteRuntime(path)
    try:
        with pytest.raises(RuntimeError, match="crash"):
            async with runtime.session("s", "u"):
                await runtime.step("charge", body)
                raise RuntimeError("crash")
    finally:
        await runtime.close()


async def _resume(path: Path, body: Counter, *, strict: bool = False) -> tuple[Any, int]:
    runtime = SqliteRuntime(path, strict_replay=strict)
    try:
        async with runtime.session("s", "u", resume=True) as run:
            value = await runtime.step("charge", body)
            return value, run.stats.corrupt
    finally:
        await runtime.close()


async def test_a_value_stored_as_sqlite_text_is_read_as_its_json(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    body = Counter()
    await _journal_with_open_run(path, body)
    sqlite_exec(path, """UPDATE loom_entries SET value = '{"fresh":41}'""")
    assert await _resume(path, body) == ({"fresh": 41}, 0)  # the same JSON, read as text
    assert body.calls == 1


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE loom_entries SET value = '{\"fresh\":'",  # text, and not JSON
        "UPDATE loom_entries SET codec_version = 'one'",
        # No loomflow writes a version below 1: it was read as the current one and replayed.
        "UPDATE loom_entries SET codec_version = -1",
        "UPDATE loom_entries SET codec_version = 0",
    ],
)
async def test_a_row_with_text_where_a_value_belongs_is_corrupt(tmp_path: Path, edit: str) -> None:
    path = tmp_path / "journal.db"
    body = Counter()
    await _journal_with_open_run(path, body)
    sqlite_exec(path, edit)
    with pytest.raises(CorruptEntryError):
        await _resume(path, body, strict=True)
    assert await _resume(path, body) == ({"fresh": 2}, 1)  # ran again, once
    assert await _resume(path, body) == ({"fresh": 2}, 0)  # and its result replaced the row
    assert body.calls == 2


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        # TEXT affinity turns a number into text; a blob stays a blob.
        ("UPDATE loom_entries SET name = CAST('charge' AS BLOB)", "a bytes for its name"),
        ("UPDATE loom_entries SET path = CAST(path AS BLOB)", "a bytes for its path"),
        ("UPDATE loom_entries SET fingerprint = x'00ff'", "a bytes for its fingerprint"),
        # Text SQLite holds whatever its bytes: not UTF-8, it read as an outage before
        # (StoreUnavailableError), now as the damaged key it is.
        *(
            (
                f"UPDATE loom_entries SET {column} = CAST(x'ff41' AS TEXT)",
                f"text that is not UTF-8 for its {column}",
            )
            for column in ("name", "path", "fingerprint")
        ),
    ],
)
async def test_a_row_whose_key_columns_no_step_can_match_is_corrupt(
    tmp_path: Path, edit: str, named: str
) -> None:
    # Never matched, such a row used to let its step run again silently, strict or not.
    path = tmp_path / "journal.db"
    body = Counter()
    await _journal_with_open_run(path, body)
    sqlite_exec(path, edit)
    with pytest.raises(CorruptEntryError, match=f"position 0 of run 0 .* has {named}"):
        await _resume(path, body, strict=True)
    assert body.calls == 1  # strict: nothing ran
    assert await _resume(path, body) == ({"fresh": 2}, 1)  # counted, and run again once
    assert body.calls == 2


async def test_a_text_seq_does_not_stop_a_resume(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    body = Counter()
    await _journal_with_open_run(path, body)
    sqlite_exec(path, "UPDATE loom_entries SET seq = 'first'")
    assert await _resume(path, body) == ({"fresh": 1}, 0)


async def test_an_idempotency_row_stored_as_text_replays(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    body = Counter()
    runtime = SqliteRuntime(path)
    try:
        async with runtime.session("s", "u"):
            await runtime.step("pay", body, idempotency_key="order-1")
        sqlite_exec(path, """UPDATE loom_idempotency SET value = '{"fresh":7}'""")
        async with runtime.session("s2", "u"):
            assert await runtime.step("pay", body, idempotency_key="order-1") == {"fresh": 7}
        assert body.calls == 1
    finally:
        await runtime.close()


# -- checkpoints -----------------------------------------------------------------------------


# Values a snapshot's transcript disagrees with: restored, the loop would look for journal
# steps of turns that never ran and run the tools of the turns that did a second time.
_INCONSISTENT = [
    "UPDATE loom_checkpoints SET turn = 5",
    "UPDATE loom_checkpoints SET turn = 0",
    "UPDATE loom_checkpoints SET turn = 2147483647",
    "UPDATE loom_checkpoints SET final = 1",
    "UPDATE loom_checkpoints SET prompt_index = 0",
]
# A row whose own session or user is not the one its scope key files it under: moved from
# another user's (or session's) snapshots, it must not be restored as this one's.
_MOVED = [
    "UPDATE loom_checkpoints SET user_id = 'mallory'",
    "UPDATE loom_checkpoints SET session_id = 'elsewhere'",
]
CHECKPOINT_EDITS = {
    "sqlite": [
        "UPDATE loom_checkpoints SET messages = 'not json'",
        "UPDATE loom_checkpoints SET epoch = 'x'",
        "UPDATE loom_checkpoints SET codec_version = 'x'",
        "UPDATE loom_checkpoints SET codec_version = -1",
        "UPDATE loom_checkpoints SET cost_usd = 'x'",
        "UPDATE loom_checkpoints SET cost_usd = 1e999",  # infinity: restored, the run's cost
        "UPDATE loom_checkpoints SET created_at = 1e300",
        *_INCONSISTENT,
        *_MOVED,
    ],
    "postgres": [
        "UPDATE loom_checkpoints SET created_at = 1e300",
        "UPDATE loom_checkpoints SET created_at = 'NaN'",
        "UPDATE loom_checkpoints SET cost_usd = 'Infinity'",
        "UPDATE loom_checkpoints SET codec_version = 0",
        *_INCONSISTENT,
        *_MOVED,
    ],
}


@pytest.mark.parametrize(
    ("kind", "edit"),
    [("sqlite", e) for e in CHECKPOINT_EDITS["sqlite"]]
    + [
        pytest.param("postgres", e, marks=pytest.mark.postgres)
        for e in CHECKPOINT_EDITS["postgres"]
    ],
)
async def test_a_hand_edited_checkpoint_falls_back_to_journal_replay(
    kind: str, edit: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path) if kind == "sqlite" else await PostgresRuntime.connect(dsn)
    try:
        shop = Shop(fail_at=2)

        def agent(strict: bool) -> Agent:
            tuning = Tuning(checkpoint=True, strict_replay=strict)
            return Agent(
                "You shop.", model=shop.model, tools=[shop.tool], runtime=runtime, tuning=tuning
            )

        with pytest.raises(ConnectionError):
            await agent(False).run("shop", session_id="s", user_id="u")
        if kind == "sqlite":
            await asyncio.to_thread(sqlite_exec, path, edit)
        else:
            await pg_exec(dsn, edit)
        with pytest.raises(
            CheckpointError,
            match=r"malformed|cannot be decoded|model turn|answer|user message|was moved",
        ):
            await agent(True).resume("shop", session_id="s", user_id="u")
        result = await agent(False).resume("shop", session_id="s", user_id="u")
        assert result.restored_from is None
        assert result.replayed_steps == 4
        assert shop.bought == ["apples", "bread", "cheese"]
    finally:
        await runtime.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_checkpoint_column_dropped_by_hand_is_a_migration_error_naming_it(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Before: StoreUnavailableError ("checkpoints read failed: UndefinedColumnError"), which
    # reads as a database that is down and is retried as one; the column is gone for good.
    from loomflow.errors import MigrationError, StoreUnavailableError

    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    path = tmp_path / "journal.db"

    async def runtime() -> Any:
        return SqliteRuntime(path) if kind == "sqlite" else await PostgresRuntime.connect(dsn)

    shop = Shop(fail_at=2)

    def agent(runtime: Any) -> Agent:
        tuning = Tuning(checkpoint=True)
        return Agent(
            "You shop.", model=shop.model, tools=[shop.tool], runtime=runtime, tuning=tuning
        )

    first = await runtime()
    try:
        with pytest.raises(ConnectionError):
            await agent(first).run("shop", session_id="s", user_id="u")
    finally:
        await first.close()
    drop = "ALTER TABLE loom_checkpoints DROP COLUMN cost_usd"
    if kind == "sqlite":
        await asyncio.to_thread(sqlite_exec, path, drop)
    else:
        await pg_exec(dsn, drop)
    second = await runtime()
    try:
        with pytest.raises(MigrationError, match=r"cost_usd.*changed outside loomflow") as caught:
            await agent(second).resume("shop", session_id="s", user_id="u")
        assert not isinstance(caught.value, StoreUnavailableError)
    finally:
        await second.close()


# -- memory episodes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE loom_memory_episodes SET created_at = 1e300",
        "UPDATE loom_memory_episodes SET codec_version = 'x'",
        # No run journals at a negative epoch, and no loomflow writes a version below 1.
        "UPDATE loom_memory_episodes SET epoch = -1",
        "UPDATE loom_memory_episodes SET codec_version = -1",
    ],
)
async def test_a_hand_edited_episode_is_a_corrupt_entry(tmp_path: Path, edit: str) -> None:
    path = tmp_path / "memory.db"
    memory = SqliteMemory(path)
    try:
        await memory.record_episode("s", user_id="u", key="k", messages=[], output="done")
        await asyncio.to_thread(sqlite_exec, path, edit)
        with pytest.raises(CorruptEntryError, match="malformed"):
            await memory.episodes("s", user_id="u")
    finally:
        await memory.close()


@pytest.mark.parametrize(
    ("kind", "when"),
    [
        ("sqlite", "1e300"),
        ("sqlite", "'yesterday'"),
        pytest.param("postgres", "'Infinity'", marks=pytest.mark.postgres),
        pytest.param("postgres", "'NaN'", marks=pytest.mark.postgres),
    ],
)
async def test_re_recording_an_episode_heals_a_creation_time_no_date_holds(
    kind: str, when: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # A run resumed after an approval records its episode again under the same key: the
    # upsert handed back the damaged created_at, and the run failed with an OverflowError.
    from loomflow.memory import PostgresMemory

    path = tmp_path / "memory.db"
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    memory = SqliteMemory(path) if kind == "sqlite" else PostgresMemory(dsn)
    edit = f"UPDATE loom_memory_episodes SET created_at = {when}"
    try:
        first = await memory.record_episode("s", user_id="u", key="k", messages=[], output="a")
        if kind == "sqlite":
            await asyncio.to_thread(sqlite_exec, path, edit)
        else:
            await pg_exec(dsn, edit)
        again = await memory.record_episode("s", user_id="u", key="k", messages=[], output="b")
        assert again.id == first.id
        assert abs((again.created_at - first.created_at).total_seconds()) < 60
        (episode,) = await memory.episodes("s", user_id="u")
        assert episode.output == "b"
    finally:
        await memory.close()


async def test_an_episode_stored_as_sqlite_text_is_read(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    memory = SqliteMemory(path)
    try:
        await memory.record_episode("s", user_id="u", key="k", messages=[], output="done")
        await asyncio.to_thread(
            sqlite_exec, path, "UPDATE loom_memory_episodes SET messages = '[]'"
        )
        (episode,) = await memory.episodes("s", user_id="u")
        assert episode.messages == []
    finally:
        await memory.close()


# -- audit rows --------------------------------------------------------------------------------

DEEP = "[" * 50_000 + "]" * 50_000  # PostgreSQL TEXT holds it; Python's parser recurses


async def _audit_rows(log: AuditLog) -> None:
    for i in range(3):
        await log.record("custom.note", user_id="alice", actor="test", payload={"i": i})


Tamper = Callable[..., Awaitable[None]]


@contextlib.asynccontextmanager
async def _edited_audit(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[AuditLog, Tamper]]:
    """Alice's three entries in a real audit store, and a way to edit its rows past the
    append-only triggers, as someone with write access to the database can."""
    path = tmp_path / "audit.db"
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    log = AuditLog(SqliteAuditStore(path) if kind == "sqlite" else PostgresAuditStore(dsn))

    async def tamper(*statements: str) -> None:
        if kind == "sqlite":
            await asyncio.to_thread(
                sqlite_exec, path, "DROP TRIGGER IF EXISTS loom_audit_no_update",
                "DROP TRIGGER IF EXISTS loom_audit_heads_forward", *statements,
            )  # fmt: skip
        else:
            tables = ("loom_audit", "loom_audit_heads")
            await pg_exec(
                dsn,
                *(f"ALTER TABLE {t} DISABLE TRIGGER USER" for t in tables),
                *statements,
                *(f"ALTER TABLE {t} ENABLE TRIGGER USER" for t in tables),
            )

    try:
        await _audit_rows(log)
        yield log, tamper
    finally:
        await log.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_an_audit_payload_nested_too_deep_is_an_unreadable_entry(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    async with _edited_audit(kind, request, tmp_path) as (log, tamper):
        await tamper(f"UPDATE loom_audit SET payload = '{DEEP}' WHERE seq = 2")
        report = await log.verify()
        assert not report.ok
        assert any(p.kind == "unreadable" and p.seq == 2 for p in report.problems)
        page = await log.query(user_id="alice")
        assert len(page.entries) == 3
        assert "unreadable_payload" in page.entries[1].payload


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
@pytest.mark.parametrize("time_us", [-99_999_999_999_999_999, 9_000_000_000_000_000_000])
async def test_an_audit_time_no_date_can_hold_is_an_unreadable_entry(
    kind: str, time_us: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Both fit a 64-bit column; neither is a date, and each was an OverflowError mid-verify.
    async with _edited_audit(kind, request, tmp_path) as (log, tamper):
        await tamper(f"UPDATE loom_audit SET time_us = {time_us} WHERE seq = 2")
        report = await log.verify()
        assert [(p.kind, p.seq) for p in report.problems] == [("unreadable", 2)]
        assert "time_us" in report.problems[0].detail
        page = await log.query(user_id="alice")  # shown, at the nearest date
        assert [e.seq for e in page.entries] == [1, 2, 3]
        assert page.entries[1].time.year in (1, 9999)
        lines = [e.to_json() async for e in log.store.entries(user_id="alice")]
        assert len(lines) == 3


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_entries_moved_under_another_trail_key_are_reported(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # No hash covers the key queries and erasure look up: moving a trail, head and all, kept
    # every chain intact while the user's own trail came back empty.
    async with _edited_audit(kind, request, tmp_path) as (log, tamper):
        await tamper(
            """UPDATE loom_audit SET user_key = '"zz"' WHERE user_key = '"alice"'""",
            """UPDATE loom_audit_heads SET user_key = '"zz"' WHERE user_key = '"alice"'""",
        )
        report = await log.verify()
        assert not report.ok
        problems = [(p.kind, p.seq) for p in report.problems]
        # The moved head names alice while it is filed under "zz" (no hash covers either).
        assert problems == [("head_mismatch", 3), ("edited", 1), ("edited", 2), ("edited", 3)]
        assert "filed under the trail key" in report.problems[1].detail


async def _entries_of_alice(log: AuditLog) -> list[int]:
    return [e.seq for e in (await log.query(user_id="alice")).entries]


HEAD_EDITS = ["seq = -1", "seq = 0", "hash = 'not a hash'", "hash = upper(hash)"]


@pytest.mark.parametrize(
    ("kind", "edit"),
    [
        *(("sqlite", edit) for edit in [*HEAD_EDITS, "seq = 'x'", "hash = x'00'"]),
        *(pytest.param("postgres", edit, marks=pytest.mark.postgres) for edit in HEAD_EDITS),
    ],
)
async def test_a_malformed_chain_head_refuses_appends_with_an_integrity_error(
    kind: str, edit: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # A head of seq -1 made the next entry seq 0 (a pydantic ValidationError out of every
    # audited run of the user); a text seq a ValueError. (SQLite alone keeps text in its
    # number column and a blob in its text one.)
    async with _edited_audit(kind, request, tmp_path) as (log, tamper):
        await tamper(f"""UPDATE loom_audit_heads SET {edit} WHERE user_key = '"alice"'""")
        with pytest.raises(AuditIntegrityError, match="chain head of user 'alice' is malformed"):
            await log.record("custom.note", user_id="alice", actor="test", payload={"i": 3})
        assert await _entries_of_alice(log) == [1, 2, 3]  # nothing appended
        await log.record("custom.note", user_id="bob", actor="test", payload={})  # others go on


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_trail_whose_head_row_is_gone_refuses_a_second_chain(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # The next entry started a new chain at seq 1 and hit UNIQUE (user_key, seq): reported as
    # StoreUnavailableError, an outage a worker retries for ever.
    async with _edited_audit(kind, request, tmp_path) as (log, tamper):
        await tamper("""UPDATE loom_audit_heads SET user_key = '"zz"' WHERE user_key = '"alice"'""")
        with pytest.raises(AuditIntegrityError, match=r"has entries \(up to seq 3\) but no chain"):
            await log.record("custom.note", user_id="alice", actor="test", payload={"i": 3})
        assert await _entries_of_alice(log) == [1, 2, 3]


async def test_an_exported_line_without_its_time_is_an_unreadable_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(JsonlAuditStore(path))
    try:
        await _audit_rows(log)
    finally:
        await log.close()
    lines = path.read_text().splitlines()
    edited = json.loads(lines[1])
    del edited["time"]
    lines[1] = json.dumps(edited)
    path.write_text("\n".join(lines) + "\n")
    log = AuditLog(JsonlAuditStore(path))
    try:
        report = await log.verify()
    finally:
        await log.close()
    assert ("unreadable", "no time") in [(p.kind, p.detail[-7:]) for p in report.problems]
    offline = verify_lines(lines)
    assert any(p.kind == "unreadable" for p in offline.problems)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "loomflow.cli", "audit", "verify"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={"LOOMFLOW_AUDIT_URL": f"jsonl:///{path}", "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "line 2 is not an entry: no time" in done.stdout


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE loom_audit SET seq = 'two' WHERE seq = 2",
        "UPDATE loom_audit SET seq = 2.5 WHERE seq = 2",  # int() read it as 2: verified OK
        "UPDATE loom_audit SET time_us = 'noon' WHERE seq = 2",
        "UPDATE loom_audit SET schema_version = 'v1' WHERE seq = 2",
        "UPDATE loom_audit_heads SET seq = 'three'",
    ],
)
async def test_an_audit_row_with_text_in_a_number_column_is_an_integrity_error(
    tmp_path: Path, edit: str
) -> None:
    path = tmp_path / "audit.db"
    log = AuditLog(SqliteAuditStore(path))
    try:
        await _audit_rows(log)
        await asyncio.to_thread(
            sqlite_exec,
            path,
            "DROP TRIGGER loom_audit_no_update",
            "DROP TRIGGER loom_audit_heads_forward",
            edit,
        )
        if "loom_audit_heads" in edit:  # a head no chain can be checked against: reported
            report = await log.verify()
            assert not report.ok
            assert "head_mismatch" in [p.kind for p in report.problems], report.problems
        else:  # a failed check in its place; the rest of the log is still checked
            report = await log.verify()
            assert not report.ok
            # (a seq that is no number also leaves its place in the chain empty: missing)
            unreadable = [p for p in report.problems if p.kind == "unreadable"]
            assert len(unreadable) == 1, report.problems
            assert "malformed" in unreadable[0].detail
    finally:
        await log.close()
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "loomflow.cli", "audit", "verify"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"LOOMFLOW_AUDIT_URL": f"sqlite:///{path}", "PATH": ""},
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "malformed" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("column", "blob"),
    [
        ("user_id", "X'fffe'"),  # no text at all: str() of it was filed as user "b'\\xff\\xfe'"
        ("user_id", "X'6d616c6c6f7279'"),  # b'mallory': read as an entry of user mallory
        ("user_id", "X'616c696365'"),  # b'alice': read as alice's own entry, and passed
        ("actor", "X'74657374'"),  # b'test': passed as the text it spells
    ],
)
async def test_an_audit_row_with_bytes_in_a_text_column_is_unreadable_in_its_trail(
    tmp_path: Path, column: str, blob: str
) -> None:
    path = tmp_path / "audit.db"
    log = AuditLog(SqliteAuditStore(path))
    try:
        await _audit_rows(log)
        await log.record("custom.note", user_id="bob", actor="test", payload={})
    finally:
        await log.close()
    await asyncio.to_thread(
        sqlite_exec,
        path,
        "DROP TRIGGER loom_audit_no_update",
        f"UPDATE loom_audit SET {column} = {blob} WHERE seq = 2 AND user_key = '\"alice\"'",
    )
    # The code under test, also when it is not the installed copy (a worktree on PYTHONPATH).
    env = {
        "LOOMFLOW_AUDIT_URL": f"sqlite:///{path}",
        "PATH": "",
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "loomflow.cli", "audit", "verify", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    report = json.loads(done.stdout)
    # Alice's trail, where the row lies, holds the problem; no user is made up from the bytes.
    assert [(p["user_id"], p["kind"], p["seq"]) for p in report["problems"]] == [
        ("alice", "unreadable", 2)
    ]
    assert f"{column} is stored as bytes, not text" in report["problems"][0]["detail"]
    assert report["users"] == 2
    text = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "loomflow.cli", "audit", "verify"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert text.returncode == 1
    assert "b'" not in text.stdout, text.stdout


def test_an_export_line_nested_too_deep_is_an_unreadable_line() -> None:
    good = {"schema_version": 1, "user_id": "alice", "seq": 1, "actor": "a", "action": "x"}
    report = verify_lines([json.dumps(good), DEEP])
    assert any(p.kind == "unreadable" and p.position == 2 for p in report.problems)


async def test_a_damaged_episode_does_not_fail_every_later_run_of_the_session(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        shop = Shop()

        def agent(strict: bool) -> Agent:
            return Agent(
                "You shop.",
                model=shop.model,
                tools=[shop.tool],
                runtime=runtime,
                tuning=Tuning(strict_replay=strict),
            )

        await agent(False).run("shop", session_id="s", user_id="u")
        await asyncio.to_thread(
            sqlite_exec, path, "UPDATE loom_memory_episodes SET messages = X'00'"
        )
        with pytest.raises(CorruptEntryError, match="cannot be decoded"):
            await agent(True).run("shop", session_id="s", user_id="u")
        result = await agent(False).run("shop", session_id="s", user_id="u")
        assert result.output.startswith("bought:")
        assert "an episode of session 's' is left out of memory" in caplog.text
    finally:
        await runtime.close()


# -- budget reservations -----------------------------------------------------------------------


@pytest.mark.parametrize("buckets", ["not json", "[1, 2]", '["[\\"user\\"]"]'])
async def test_a_malformed_dead_reservation_does_not_fail_every_model_call(
    tmp_path: Path, buckets: str, caplog: pytest.LogCaptureFixture
) -> None:
    from loomflow.governance.budget import Cap, StandardBudget
    from loomflow.governance.budget.sql import SqlBudgetStore

    path = tmp_path / "budget.db"
    url = f"sqlite:///{path}"
    first = StandardBudget([Cap("tokens_total", 100_000)], store=SqlBudgetStore(url))
    worker = StandardBudget([Cap("tokens_total", 100_000)], store=SqlBudgetStore(url))
    try:
        await first.reserve(user_id="alice", model="scripted", max_tokens=10)  # makes tables
        await asyncio.to_thread(
            sqlite_exec,
            path,
            "INSERT INTO loom_budget_reservations (id, owner, buckets, tokens_in, tokens_out, "
            "cost_nanousd, on_expiry, created_at, expires_at) VALUES "
            f"('crafted', 'someone', '{buckets}', 1, 1, 1, 'charge', 0, 0)",
        )
        # A new worker reclaims expired holds before its first reservation.
        ticket = await worker.reserve(user_id="bob", model="scripted", max_tokens=10)
        assert ticket is not None
        assert "'crafted' is malformed and was not reclaimed" in caplog.text
        rows = await asyncio.to_thread(_reservation_ids, path)
        assert "crafted" in rows  # left for an operator, not settled blindly
    finally:
        await first.close()
        await worker.close()


@pytest.mark.parametrize("edit", ["tokens_in = 'x'", "wall_s = x'00'", "calls = 1.5"])
async def test_a_budget_bucket_with_text_for_a_total_is_a_storage_error(
    tmp_path: Path, edit: str
) -> None:
    from loomflow.errors import StorageError
    from loomflow.governance.budget import Cap, StandardBudget
    from loomflow.governance.budget.sql import SqlBudgetStore

    path = tmp_path / "budget.db"
    store = SqlBudgetStore(f"sqlite:///{path}")
    budget = StandardBudget([Cap("tokens_total", 100_000)], store=store)
    try:
        ticket = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        assert ticket is not None
        await asyncio.to_thread(sqlite_exec, path, f"UPDATE loom_budget_buckets SET {edit}")
        with pytest.raises(StorageError, match="budget bucket row is damaged"):
            await store.usage()  # was a ValueError from int('x')
    finally:
        await budget.close()
    # The report shows the row as unreadable, with why, as listings show a damaged checkpoint.
    done = await asyncio.to_thread(_cli, path, "budget", "show")
    assert done.returncode == 0, done.stderr
    assert "unreadable" in done.stdout
    assert done.stderr.startswith("loomflow: a budget bucket row is damaged"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_jsonl_head_with_text_for_its_seq_is_an_integrity_error(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"

    async def write() -> None:
        log = AuditLog(JsonlAuditStore(path))
        try:
            await _audit_rows(log)
        finally:
            await log.close()

    asyncio.run(write())
    heads = path.with_name(path.name + ".heads")
    data = json.loads(heads.read_text())
    for head in data["users"].values():
        head["seq"] = "x"
    heads.write_text(json.dumps(data))

    async def verify_and_append() -> None:
        log = AuditLog(JsonlAuditStore(path))
        try:
            with pytest.raises(AuditIntegrityError, match="head of user key"):
                await log.verify()
            with pytest.raises(AuditIntegrityError, match="head of user key"):
                await log.record("custom.note", user_id="alice", actor="t", payload={})
        finally:
            await log.close()

    asyncio.run(verify_and_append())
    done = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "audit", "verify"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={"LOOMFLOW_AUDIT_URL": f"jsonl:///{path}", "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("loomflow: error:"), done.stderr


def _reservation_ids(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM loom_budget_reservations")]
    finally:
        conn.close()


# -- journal listings and the session row ------------------------------------------------------

LISTING_EDITS = [
    "UPDATE loom_entries SET seq = 'x'",
    "UPDATE loom_entries SET size = 'x'",
    "UPDATE loom_entries SET created_at = 'x'",
    "UPDATE loom_entries SET created_at = 1e300",  # PostgreSQL's double holds it too
    "UPDATE loom_entries SET path = 'not json'",
    "UPDATE loom_sessions SET updated_at = 1e300",
]


@pytest.mark.parametrize("edit", LISTING_EDITS)
async def test_cli_listings_show_a_hand_edited_journal_row(tmp_path: Path, edit: str) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        async with runtime.session("s", "u"):
            await runtime.step("charge", Counter())
    finally:
        await runtime.close()
    await asyncio.to_thread(sqlite_exec, path, edit)
    for command in (["runs", "list"], ["runs", "list", "--json"], ["runs", "show", "s"]):
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", *command],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr


async def test_a_session_row_with_a_text_epoch_is_a_corrupt_entry_error(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        async with runtime.session("s", "u"):
            await runtime.step("charge", Counter())
        await asyncio.to_thread(sqlite_exec, path, "UPDATE loom_sessions SET epoch = 'x'")
        with pytest.raises(CorruptEntryError, match="lease row is damaged"):
            async with runtime.session("s", "u"):
                pass
    finally:
        await runtime.close()


_TOP = 2**63 - 1  # the largest BIGINT / SQLite INTEGER: one more does not fit


@pytest.mark.parametrize(
    "edit",
    [
        f"UPDATE loom_sessions SET epoch = {_TOP}",
        "UPDATE loom_sessions SET epoch = -1",
        f"UPDATE loom_sessions SET token = {_TOP}",  # the next claim adds one (SQLite: a REAL)
        "UPDATE loom_sessions SET token = -5",
        # Text: 'tok' + 1 is 1 in SQLite, the number the last owner held; it must not be
        # taken for a token that grew.
        "UPDATE loom_sessions SET token = 'tok'",
        "UPDATE loom_sessions SET token = 'tok', owner = 'gone', lease_until = 0, open = 1",
        # Held by a live owner: the takeover reads the holder's token first.
        "UPDATE loom_sessions SET token = 'tok', owner = 'gone', lease_until = 1e18, open = 1",
    ],
)
async def test_a_session_number_no_run_reaches_is_refused_before_any_step(
    tmp_path: Path, edit: str
) -> None:
    path = tmp_path / "journal.db"
    body = Counter()
    runtime = SqliteRuntime(path)
    try:
        async with runtime.session("s", "u"):
            await runtime.step("charge", body)
        await asyncio.to_thread(sqlite_exec, path, edit)
        for _ in range(2):  # the first refusal must leave nothing that reads differently
            with pytest.raises(CorruptEntryError, match="lease row is damaged"):
                async with runtime.session("s", "u"):
                    await runtime.step("charge", body)
        assert body.calls == 1  # the refused runs ran nothing
    finally:
        await runtime.close()


@pytest.mark.postgres
async def test_a_postgres_epoch_at_the_top_of_bigint_is_refused_before_any_step(
    pg_dsn: str,
) -> None:
    body = Counter()
    runtime = await PostgresRuntime.connect(pg_dsn)
    try:
        async with runtime.session("s-top", "u"):
            await runtime.step("charge", body)
        await pg_exec(pg_dsn, f"UPDATE loom_sessions SET epoch = {_TOP} WHERE session_id = 's-top'")
        with pytest.raises(CorruptEntryError, match="lease row is damaged"):
            async with runtime.session("s-top", "u"):
                await runtime.step("charge", body)
        assert body.calls == 1
    finally:
        await runtime.close()


def _cli(path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", *command],
        capture_output=True, text=True, cwd=path.parent, timeout=120,
    )  # fmt: skip


async def _journal_edited(tmp_path: Path, *edits: str) -> Path:
    """A journal of one finished one-step run, then edited by hand."""
    path = tmp_path / "journal.db"
    async with SqliteRuntime(path) as runtime, runtime.session("s", "u"):
        await runtime.step("charge", Counter())
    await asyncio.to_thread(sqlite_exec, path, *edits)
    return path


async def test_a_text_schema_version_is_a_migration_error_naming_the_table(tmp_path: Path) -> None:
    from loomflow.errors import MigrationError

    path = await _journal_edited(
        tmp_path,
        "UPDATE loom_schema_version SET version = 'two' WHERE component = 'journal' "
        "AND version = (SELECT MAX(version) FROM loom_schema_version WHERE component = 'journal')",
    )
    with pytest.raises(MigrationError, match="loom_schema_version is 'two'"):
        async with SqliteRuntime(path) as runtime, runtime.session("s", "u"):
            pass
    for command in (["runs", "list"], ["migrate"]):
        done = await asyncio.to_thread(_cli, path, *command)
        assert done.returncode == 1, command
        assert done.stderr.startswith("loomflow: error: the journal schema version"), done.stderr
        assert "Traceback" not in done.stderr


LOST_VERSION_ROWS = [
    ("DELETE FROM loom_schema_version", "table loom_sessions"),
    (
        "DELETE FROM loom_schema_version WHERE component = 'journal' AND version = 2",
        "column loom_sessions.",
    ),
]


@pytest.mark.parametrize(
    ("kind", "edit", "named"),
    [("sqlite", e, n) for e, n in LOST_VERSION_ROWS]
    + [pytest.param("postgres", e, n, marks=pytest.mark.postgres) for e, n in LOST_VERSION_ROWS],
)
async def test_lost_version_rows_are_a_migration_error_not_an_outage(
    kind: str, edit: str, named: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Re-running the migrations would fail with "table already exists", which read as the
    # store being unavailable; the schema is further along than its version table says.
    from loomflow.errors import MigrationError

    assert kind in ("sqlite", "postgres")
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    path = tmp_path / "journal.db"

    def runtime() -> Any:
        return SqliteRuntime(path) if kind == "sqlite" else PostgresRuntime(dsn)

    async with runtime() as journal, journal.session("s", "u"):
        await journal.step("charge", Counter())
    if kind == "sqlite":
        await asyncio.to_thread(sqlite_exec, path, edit)
    else:
        await pg_exec(dsn, edit)
    with pytest.raises(MigrationError, match=f"{named}.*already exists.*restore its rows"):
        async with runtime() as journal, journal.session("s2", "u"):
            pass
    if kind == "sqlite":
        done = await asyncio.to_thread(_cli, path, "migrate")
        assert done.returncode == 1
        assert "already exists: the version table lost rows" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        with sqlite3.connect(path) as db:  # nothing journaled was touched
            assert db.execute("SELECT COUNT(*) FROM loom_entries").fetchone() == (1,)


async def test_listings_escape_the_control_characters_of_a_crafted_row(tmp_path: Path) -> None:
    path = await _journal_edited(
        tmp_path,
        "UPDATE loom_sessions SET session_id = 'evil' || char(27) || ']0;pwned' || char(7), "
        "user_id = 'u' || char(13) || char(10) || 'bob  bob  1  finished'",
        "UPDATE loom_entries SET name = 'x' || char(27) || '[2Kfake'",
    )
    listing = await asyncio.to_thread(_cli, path, "runs", "list")
    assert listing.returncode == 0, listing.stderr
    assert "\x1b" not in listing.stdout
    assert "\r" not in listing.stdout
    assert r"evil\x1b]0;pwned\x07" in listing.stdout
    assert len(listing.stdout.splitlines()) == 2  # the header and the one row: none forged


async def test_a_cancel_leaves_a_text_token_for_the_next_claim_to_report(tmp_path: Path) -> None:
    from loomflow.recovery import cancel_run

    path = await _journal_edited(tmp_path, "UPDATE loom_sessions SET token = 'tok', open = 1")
    runtime = SqliteRuntime(path)
    try:
        assert await cancel_run(runtime, "s", user_id="u")
        with sqlite3.connect(path) as conn:
            (token,) = conn.execute("SELECT token FROM loom_sessions").fetchone()
        assert token == "tok"  # not 'tok' + 1, which is 1
        with pytest.raises(CorruptEntryError, match="lease row is damaged"):
            async with runtime.session("s", "u"):
                pass
    finally:
        await runtime.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_session_row_whose_user_was_edited_stays_its_users_runs(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # The scope key says whose run it is; the user_id column was the only thing looked at:
    # edited to bob, alice's runs left her listing and export, `users forget alice` left
    # them behind, and a prune that keeps alice's (legal hold) deleted them.
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path) if kind == "sqlite" else await PostgresRuntime.connect(dsn)
    try:
        for user in ("alice", "bob"):
            async with runtime.session(f"{user}-s", user):
                await runtime.step("charge", Counter())
        edit = "UPDATE loom_sessions SET user_id = 'bob' WHERE session_id = 'alice-s'"
        if kind == "sqlite":
            await asyncio.to_thread(sqlite_exec, path, edit)
        else:
            await pg_exec(dsn, edit)
        listed = await runtime.sessions(user_id="alice")
        assert [(s.session_id, s.state) for s in listed] == [("alice-s", "unreadable")]
        bobs = {s.session_id: s.state for s in await runtime.sessions(user_id="bob")}
        assert bobs == {"bob-s": "finished", "alice-s": "unreadable"}  # it names bob
        assert await runtime.prune(user_id="bob", include_open=True, keep_users=["alice"]) == 1
        assert len(await runtime.sessions(user_id="alice")) == 1  # still there
        assert await runtime.forget_user("alice") == 2  # its entry, then its session row
        assert await runtime.sessions(user_id="alice") == []
    finally:
        await runtime.close()


@pytest.mark.parametrize("column", ["user_id", "session_id"])
async def test_a_session_row_whose_id_was_made_a_blob_reads_as_unreadable(
    column: str, tmp_path: Path
) -> None:
    # SQLite keeps a blob in a text column. Made one, alice's user id listed as None: `runs
    # list` showed her finished run as the anonymous user's ("-"), and `users export alice`
    # gave it with "user_id": null, as if it were no one's.
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        async with runtime.session("alice-s", "alice"):
            await runtime.step("charge", Counter())
        edit = f"UPDATE loom_sessions SET {column} = CAST({column} AS BLOB)"
        await asyncio.to_thread(sqlite_exec, path, edit)
        [listed] = await runtime.sessions(user_id="alice")
        assert listed.state == "unreadable"
        assert [s.state for s in await runtime.sessions()] == ["unreadable"]
        assert await runtime.sessions(user_id=None) == []  # not the anonymous user's
        if column == "user_id":  # `runs show` finds a session by its session_id column
            # `runs show` read the entries of the user the damaged column named (None): "session
            # 'alice-s' has no journal entries", of a session that has one.
            url = f"sqlite:///{path}"
            shown = loomflow("--url", url, "runs", "show", "alice-s", "--user", "alice", "--json")
            assert shown.returncode == 0, shown.stderr
            assert [json.loads(line)["name"] for line in shown.stdout.splitlines()] == ["charge"]
            unnamed = loomflow("--url", url, "runs", "show", "alice-s")
            assert unnamed.returncode == 1
            assert "has an unreadable row" in unnamed.stderr
            assert "name the user with --user" in unnamed.stderr, unnamed.stderr
        assert await runtime.forget_user("alice") == 2  # still found by its key, and erased
    finally:
        await runtime.close()


def test_runs_show_of_a_damaged_anonymous_session_named_so_is_not_sent_to_user(
    tmp_path: Path,
) -> None:
    # `runs show --anonymous` of a session of the runs without a user, its user column made a
    # blob and with no entries, said "name the user with --user": the operator had named
    # whose it is, and no --user can name the runs without a user.
    path = tmp_path / "journal.db"

    async def make() -> None:
        runtime = SqliteRuntime(path)
        try:
            async with runtime.session("anon-s", None):
                pass  # a run stopped before its first step
        finally:
            await runtime.close()

    asyncio.run(make())
    sqlite_exec(path, "UPDATE loom_sessions SET user_id = X'00'")
    shown = loomflow("--url", f"sqlite:///{path}", "runs", "show", "--anonymous", "anon-s")
    assert shown.returncode == 0, shown.stderr
    assert "session 'anon-s' has no journal entries" in shown.stdout
