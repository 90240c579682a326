"""Migrations, store URLs and driver errors on the real databases."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from loomflow.config import Settings
from loomflow.errors import ConfigurationError, MigrationError, StoreUnavailableError
from loomflow.runtime import (
    InMemoryRuntime,
    PostgresRuntime,
    SqliteRuntime,
    runtime_from_url,
)
from loomflow.runtime.migrations import SCHEMA_VERSION


async def test_sqlite_uses_wal_full_sync_and_busy_timeout(sqlite_path: Path) -> None:
    runtime = SqliteRuntime(sqlite_path)
    await runtime.open()
    try:
        conn = runtime.database.conn
        assert (await conn.execute_fetchall("PRAGMA journal_mode"))[0][0] == "wal"
        assert (await conn.execute_fetchall("PRAGMA synchronous"))[0][0] == 2  # FULL
        assert (await conn.execute_fetchall("PRAGMA busy_timeout"))[0][0] == 5000
    finally:
        await runtime.close()


async def test_sqlite_migrations_are_recorded_once(sqlite_path: Path) -> None:
    runtimes = [SqliteRuntime(sqlite_path, auto_migrate=False) for _ in range(4)]
    versions = await asyncio.gather(*(rt.migrate() for rt in runtimes))
    assert versions == [SCHEMA_VERSION] * 4
    for rt in runtimes:
        await rt.close()
    with sqlite3.connect(sqlite_path) as conn:
        rows = conn.execute(
            "SELECT version FROM loom_schema_version WHERE component = 'journal'"
        ).fetchall()
    assert rows == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


async def test_a_newer_schema_is_refused(sqlite_path: Path) -> None:
    runtime = SqliteRuntime(sqlite_path)
    await runtime.migrate()
    await runtime.close()
    with sqlite3.connect(sqlite_path) as conn:
        conn.execute("INSERT INTO loom_schema_version VALUES ('journal', 999, 'future', 0)")
    runtime = SqliteRuntime(sqlite_path)
    with pytest.raises(MigrationError, match="999"):
        await runtime.open()
    await runtime.close()


@pytest.mark.postgres
async def test_postgres_concurrent_migrations_apply_once(pg_dsn: str) -> None:
    runtimes = [PostgresRuntime(pg_dsn, auto_migrate=False) for _ in range(4)]
    versions = await asyncio.gather(*(rt.migrate() for rt in runtimes))
    assert versions == [SCHEMA_VERSION] * 4
    rows = await runtimes[0].pool.fetch(
        "SELECT version FROM loom_schema_version WHERE component = 'journal'"
    )
    assert [r[0] for r in rows] == list(range(1, SCHEMA_VERSION + 1))
    for rt in runtimes:
        await rt.close()


@pytest.mark.postgres
async def test_postgres_runtime_from_an_existing_pool(pg_dsn: str) -> None:
    import asyncpg

    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    runtime = PostgresRuntime(pool)
    async with runtime.session("s", "u"):
        assert await runtime.step("a", lambda: 41 + 1) == 42
    await runtime.close()
    assert await pool.fetchval("SELECT count(*) FROM loom_entries") == 1  # pool still open
    await pool.close()


async def test_unreachable_postgres_is_a_store_error() -> None:
    runtime = PostgresRuntime("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(StoreUnavailableError, match="connect"):
        await runtime.open()


async def test_unopenable_sqlite_file_is_a_store_error(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    runtime = SqliteRuntime(tmp_path / "dir.db")
    with pytest.raises(StoreUnavailableError):
        await runtime.open()
    await runtime.close()


def test_urls_name_their_backend(tmp_path: Path) -> None:
    assert isinstance(runtime_from_url("memory://"), InMemoryRuntime)
    rt = runtime_from_url(f"sqlite:///{tmp_path}/x.db")
    assert isinstance(rt, SqliteRuntime)
    assert rt.path == tmp_path / "x.db"
    assert runtime_from_url("sqlite:///rel.db").path == Path("rel.db")  # type: ignore[attr-defined]
    assert isinstance(runtime_from_url("postgresql://u@h/db"), PostgresRuntime)
    with pytest.raises(ConfigurationError, match="scheme"):
        runtime_from_url("mysql://u@h/db")


def test_options_come_from_settings_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMFLOW_TURN_TIMEOUT_SECONDS", "7")
    monkeypatch.setenv("LOOMFLOW_STRICT_REPLAY", "true")
    rt = InMemoryRuntime()
    assert (rt.turn_timeout, rt.strict_replay) == (7, True)
    assert InMemoryRuntime(turn_timeout=3).turn_timeout == 3
    assert InMemoryRuntime(settings=Settings(lease_seconds=5)).lease_seconds == 5


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_without_auto_migration_an_unmigrated_journal_says_to_migrate(
    backend: str, request: pytest.FixtureRequest
) -> None:
    def make() -> SqliteRuntime | PostgresRuntime:
        if backend == "sqlite":
            return SqliteRuntime(request.getfixturevalue("sqlite_path"), auto_migrate=False)
        return PostgresRuntime(request.getfixturevalue("pg_dsn"), auto_migrate=False)

    runtime = make()
    with pytest.raises(MigrationError, match="loomflow migrate"):
        await runtime.open()
    await runtime.close()
    runtime = make()
    assert await runtime.migrate() == SCHEMA_VERSION  # the deploy step
    await runtime.close()
    runtime = make()
    async with runtime.session("s", "u"):  # now it opens without migrating
        assert await runtime.step("a", lambda: 1) == 1
    await runtime.close()


async def test_sqlite_overwrites_deleted_content_whatever_sqlite_was_built_with(
    sqlite_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Debian builds SQLite with SECURE_DELETE; python.org's and macOS's builds do not, and
    # there a forgotten user's prompts stayed readable in the file's free pages after
    # `users forget` had deleted them. Such a build is simulated by switching it off first.
    connect = sqlite3.connect

    def without_secure_delete(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)
        conn.execute("PRAGMA secure_delete = OFF")
        return conn

    monkeypatch.setattr(sqlite3, "connect", without_secure_delete)
    runtime = SqliteRuntime(sqlite_path)
    await runtime.open()
    try:
        conn = runtime.database.conn
        assert (await conn.execute_fetchall("PRAGMA secure_delete"))[0][0] == 1
        await conn.execute("CREATE TABLE t (v TEXT)")
        await conn.execute("INSERT INTO t VALUES (?)", ("quixotic-zanzibar " * 50,))
        await conn.execute("DELETE FROM t")
        await conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        await runtime.close()
    stored = await asyncio.to_thread(sqlite_path.read_bytes)
    assert b"quixotic-zanzibar" not in stored


@pytest.mark.postgres
async def test_migrate_finds_the_tables_where_the_search_path_finds_them(pg_dsn: str) -> None:
    """With ``search_path=app2,app`` and the tables in ``app``, every statement reaches them
    (unqualified names follow the search path), so ``migrate`` must find them there too; it
    said they were missing and to restore the database from a backup."""
    import asyncpg

    from loomflow.stores import Stores

    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("CREATE SCHEMA app; CREATE SCHEMA app2")
    finally:
        await conn.close()
    first = f"{pg_dsn}?options=-c%20search_path%3Dapp"
    async with Stores(Settings(runtime_url=first)) as stores:
        await stores.migrate()
    both = f"{pg_dsn}?options=-c%20search_path%3Dapp2,app"
    async with Stores(Settings(runtime_url=both)) as stores:
        report = await stores.migrate()
    assert "journal schema at version" in " ".join(step.message for step in report.steps)
