"""Backend specifics: append-only triggers, shared connections, JSONL crash recovery, URLs."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from loomflow.audit import (
    AuditLog,
    AuditRecord,
    InMemoryAuditStore,
    JsonlAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
    audit_store_from_url,
    verify_lines,
)
from loomflow.audit.migrations import SCHEMA_VERSION
from loomflow.errors import AuditIntegrityError, ConfigurationError, StoreUnavailableError
from loomflow.runtime import PostgresRuntime, SqliteRuntime


def rec(user: str | None, **payload: object) -> AuditRecord:
    return AuditRecord(user_id=user, actor="t", action="test.x", payload=payload)


# -- PostgreSQL: append-only in the database ------------------------------------------------


@pytest.mark.postgres
async def test_postgres_refuses_update_delete_and_truncate(pg_dsn: str) -> None:
    import asyncpg

    store = PostgresAuditStore(pg_dsn)
    await store.append([rec("alice", i=1), rec("alice", i=2)])
    conn = await asyncpg.connect(pg_dsn)
    try:
        for sql in (
            "UPDATE loom_audit SET payload = '{}' WHERE seq = 1",
            "DELETE FROM loom_audit WHERE seq = 2",
            "DELETE FROM loom_audit",
            "TRUNCATE loom_audit",
            "TRUNCATE loom_audit CASCADE",
            "DELETE FROM loom_audit_heads",
            "UPDATE loom_audit_heads SET seq = 1",
            "TRUNCATE loom_audit_heads",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="refused"):
                await conn.execute(sql)
        assert await conn.fetchval("SELECT count(*) FROM loom_audit") == 2
        # Moving a head forward is how appends work, so that stays allowed.
        await conn.execute("UPDATE loom_audit_heads SET seq = seq + 0 WHERE false")
    finally:
        await conn.close()
    # Through the store the refusal is a StoreUnavailableError, like any driver failure.
    with pytest.raises(StoreUnavailableError, match="append-only"):
        await store.db.execute("DELETE FROM loom_audit")
    (entry,) = await store.append(rec("alice", i=3))
    assert entry.seq == 3
    assert (await store.verify()).ok
    await store.close()


@pytest.mark.postgres
async def test_postgres_store_shares_the_runtime_pool(pg_dsn: str) -> None:
    runtime = await PostgresRuntime.connect(pg_dsn)
    store = PostgresAuditStore(runtime.database)
    await store.append(rec("alice"))
    await store.close()  # not ours to close
    async with runtime.session("s", "alice"):
        assert await runtime.step("a", lambda: 1) == 1
    versions = await runtime.database.fetch(
        "SELECT component, MAX(version) FROM loom_schema_version WHERE component = 'audit' "
        "GROUP BY component"
    )
    assert [tuple(v) for v in versions] == [("audit", SCHEMA_VERSION)]
    await runtime.close()


# -- SQLite ---------------------------------------------------------------------------------


async def test_sqlite_triggers_refuse_edits_and_the_store_shares_the_journal(
    tmp_path: Path,
) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    store = SqliteAuditStore(runtime.database)
    await store.append([rec("alice"), rec("alice")])
    await store.close()
    async with runtime.session("s", "alice"):
        await runtime.step("a", lambda: 1)
    await runtime.close()
    with sqlite3.connect(tmp_path / "journal.db") as conn:
        for sql in (
            "UPDATE loom_audit SET payload = '{}'",
            "DELETE FROM loom_audit WHERE seq = 1",
            "DELETE FROM loom_audit_heads",
            "UPDATE loom_audit_heads SET seq = 1",
        ):
            with pytest.raises(sqlite3.IntegrityError, match=r"append-only|forward"):
                conn.execute(sql)
        assert conn.execute("SELECT count(*) FROM loom_audit").fetchone() == (2,)


async def test_concurrent_sqlite_migrators_apply_the_schema_once(tmp_path: Path) -> None:
    stores = [SqliteAuditStore(tmp_path / "audit.db") for _ in range(4)]
    await asyncio.gather(*(s.open() for s in stores))
    versions = await asyncio.gather(*(s.migrate() for s in stores))
    assert versions == [SCHEMA_VERSION] * 4
    for s in stores:
        await s.close()


async def test_an_unusable_sqlite_path_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    store = SqliteAuditStore(tmp_path / "dir.db")
    with pytest.raises(StoreUnavailableError):
        await store.append(rec("alice"))


# -- JSONL ----------------------------------------------------------------------------------


async def test_jsonl_lines_are_the_exported_form(tmp_path: Path) -> None:
    store = JsonlAuditStore(tmp_path / "audit.jsonl")
    written = await store.append([rec("alice", i=1), rec(None)])
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert lines == [e.to_line() for e in written]
    heads = json.loads((tmp_path / "audit.jsonl.heads").read_text())
    assert heads["size"] == (tmp_path / "audit.jsonl").stat().st_size
    assert heads["users"]['"alice"']["seq"] == 1


async def test_jsonl_refuses_to_append_to_a_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store = JsonlAuditStore(path)
    await store.append([rec("alice", i=i) for i in range(3)])
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))
    with pytest.raises(
        AuditIntegrityError, match=r"'alice' .* damaged \(truncated: entry 3 is missing at the end"
    ):
        await store.append(rec("alice"))
    report = await store.verify()
    assert [(p.kind, p.seq) for p in report.problems] == [("truncated", 3)]


async def test_jsonl_reports_unreadable_lines_by_number(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    store = JsonlAuditStore(path)
    await store.append([rec("alice", i=i) for i in range(3)])
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = "this is not json\n"
    path.write_text("".join(lines))
    report = await store.verify()
    kinds = [(p.kind, p.position) for p in report.problems]
    assert ("unreadable", 2) in kinds
    assert ("missing", 3) in kinds  # entry 2 is gone from the chain


async def test_an_export_file_can_be_verified_on_its_own(tmp_path: Path) -> None:
    store = InMemoryAuditStore()
    await store.append([rec("alice", i=i) for i in range(5)] + [rec("bob")])
    await store.export(tmp_path / "export.jsonl", user_id="alice")
    exported = JsonlAuditStore(tmp_path / "export.jsonl")
    report = await exported.verify()
    # No heads file: as a store, nothing vouches for its lines, and the export's header line
    # (it was made for alice only) is not an entry; verify_lines checks exports.
    assert report.entries == 5
    assert [(p.kind, p.position) for p in report.problems] == [
        ("unreadable", 1),
        ("unanchored", None),
    ]
    assert verify_lines((tmp_path / "export.jsonl").read_text().splitlines()).ok


# -- URLs -----------------------------------------------------------------------------------


def test_store_urls(tmp_path: Path) -> None:
    assert isinstance(audit_store_from_url("memory://"), InMemoryAuditStore)
    jsonl = audit_store_from_url("jsonl:///logs/audit.jsonl")
    assert isinstance(jsonl, JsonlAuditStore)
    assert jsonl.path == Path("logs/audit.jsonl")
    absolute = audit_store_from_url(f"jsonl:///{tmp_path}/a.jsonl")
    assert isinstance(absolute, JsonlAuditStore)
    assert absolute.path == tmp_path / "a.jsonl"
    assert isinstance(audit_store_from_url("audit.jsonl"), JsonlAuditStore)
    assert isinstance(audit_store_from_url("sqlite:///audit.db"), SqliteAuditStore)
    assert isinstance(audit_store_from_url("postgresql://u@h/db"), PostgresAuditStore)
    for bad in ("mysql://x", "jsonl://relative.jsonl"):
        with pytest.raises(ConfigurationError):
            audit_store_from_url(bad)


async def test_the_audit_log_forwards_count_and_progress() -> None:
    audit = AuditLog(InMemoryAuditStore(), redact_logs=False)
    for i in range(3):
        await audit.record("test.x", user_id="alice", actor="t", payload={"i": i})
    await audit.record("test.y", user_id="bob", actor="t")
    assert await audit.count() == 4
    assert await audit.count(user_id="alice", action="test.*") == 3
    calls: list[tuple[int, int | None]] = []
    assert await audit.export(io.StringIO(), user_id="alice", on_progress=_keep(calls)) == 3
    assert calls == [(0, 3), (3, 3)]
    calls.clear()
    assert (await audit.verify(on_progress=_keep(calls))).ok
    assert calls == [(0, 4), (4, 4)]


def _keep(calls: list[tuple[int, int | None]]) -> Callable[[int, int | None], None]:
    return lambda done, total: calls.append((done, total))
