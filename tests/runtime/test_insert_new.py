"""``Database.insert_new``: a plain INSERT that reports a taken unique key as ``None``.

The journal's hot write is tried this way and retried as an upsert only on ``None``, so the
duplicate must be told apart from every other failure, on both real databases, and leave the
connection (PostgreSQL's lane included) fit for the next statement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.errors import StoreUnavailableError
from loomflow.storage import Database, PostgresDatabase, SqliteDatabase

_DDL = (
    "CREATE TABLE t (k TEXT PRIMARY KEY, u TEXT NOT NULL, v INTEGER NOT NULL)",
    "CREATE UNIQUE INDEX t_u ON t (u)",
)
_INSERT = "INSERT INTO t (k, u, v) VALUES ($1, $2, $3)"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    database: Database
    if request.param == "sqlite":
        database = SqliteDatabase(tmp_path / "t.db")
    else:
        database = PostgresDatabase(request.getfixturevalue("pg_dsn"))
    try:
        for ddl in _DDL:
            await database.execute(ddl)
        yield database
    finally:
        await database.close()


async def _rows(db: Database) -> list[tuple[str, str, int]]:
    return [(r[0], r[1], r[2]) for r in await db.fetch("SELECT k, u, v FROM t ORDER BY k")]


async def test_a_new_row_is_counted(db: Database) -> None:
    assert await db.insert_new(_INSERT, "a", "x", 1) == 1
    assert await _rows(db) == [("a", "x", 1)]


async def test_a_taken_primary_key_is_none_and_changes_nothing(db: Database) -> None:
    await db.insert_new(_INSERT, "a", "x", 1)
    assert await db.insert_new(_INSERT, "a", "y", 2) is None
    assert await _rows(db) == [("a", "x", 1)]
    # The connection is fit for the next statement (on PostgreSQL, whichever served it).
    assert await db.insert_new(_INSERT, "b", "y", 2) == 1


async def test_a_taken_unique_index_is_none_too(db: Database) -> None:
    await db.insert_new(_INSERT, "a", "x", 1)
    assert await db.insert_new(_INSERT, "b", "x", 2) is None
    assert await _rows(db) == [("a", "x", 1)]


async def test_an_insert_that_selects_nothing_adds_nothing(db: Database) -> None:
    # The journal's fenced write: no owner row, no insert, and no error.
    sql = "INSERT INTO t (k, u, v) SELECT $1, $2, CAST($3 AS INTEGER) FROM t WHERE k = 'absent'"
    assert await db.insert_new(sql, "a", "x", 1) == 0
    assert await _rows(db) == []


@pytest.mark.parametrize(
    ("sql", "args", "named"),
    [
        ("INSERT INTO t (k, u, v) VALUES ($1, $2, NULL)", ("a", "x"), "null"),
        ("INSERT INTO missing (k) VALUES ($1)", ("a",), "missing"),
    ],
)
async def test_any_other_failure_is_a_store_error(
    db: Database, sql: str, args: tuple[str, ...], named: str
) -> None:
    with pytest.raises(StoreUnavailableError, match=f"(?i)test insert failed: .*{named}"):
        await db.insert_new(sql, *args, what="test insert")
    assert await db.insert_new(_INSERT, "a", "x", 1) == 1
