"""``Database.insert_new``: a plain INSERT that reports a taken unique key as ``None``.

The journal's hot write is tried this way and retried as an upsert only on ``None``, so the
duplicate must be told apart from every other failure, on both real databases, and leave the
connection (PostgreSQL's lane included) fit for the next statement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loomflow.errors import MigrationError, StoreUnavailableError
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.runtime._store import StoredEntry, path_key
from loomflow.runtime.codec import CODEC_VERSION
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
    ("sql", "args", "named", "error"),
    [
        (
            "INSERT INTO t (k, u, v) VALUES ($1, $2, NULL)",
            ("a", "x"),
            "null",
            StoreUnavailableError,
        ),
        # A table that is not there was dropped outside loomflow: a schema error, not an outage.
        ("INSERT INTO missing (k) VALUES ($1)", ("a",), "missing", MigrationError),
    ],
)
async def test_any_other_failure_is_a_store_error(
    db: Database, sql: str, args: tuple[str, ...], named: str, error: type[Exception]
) -> None:
    with pytest.raises(error, match=f"(?i)test insert failed: .*{named}"):
        await db.insert_new(sql, *args, what="test insert")
    assert await db.insert_new(_INSERT, "a", "x", 1) == 1


# -- the journal's write: a plain insert, rewritten only over an entry already there ----------


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def two_runtimes(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[JournalRuntime, JournalRuntime]]:
    """Two runtimes (two workers) over one journal."""
    made: list[JournalRuntime] = []
    for _ in range(2):
        if request.param == "sqlite":
            made.append(SqliteRuntime(tmp_path / "journal.db"))
        else:
            made.append(await PostgresRuntime.connect(request.getfixturevalue("pg_dsn")))
    try:
        yield made[0], made[1]
    finally:
        for runtime in made:
            await runtime.close()


async def _rewrite_in_a_race(
    two_runtimes: tuple[JournalRuntime, JournalRuntime], *, taken_over: bool
) -> tuple[bool, bytes, bytes]:
    """Journal step "a", then write over it again as if the first insert had met the entry
    (a duplicate key) and, with ``taken_over``, a newer owner took the turn right then.

    Returns whether the rewrite was journaled, the value first written and the stored one.
    """
    old, new = two_runtimes
    await new.open()
    store: Any = old._store
    real_insert = store.db.insert_new

    async def insert_meets_the_entry(sql: str, *args: Any, what: str = "statement") -> Any:
        if taken_over:
            holder = await new._store.holder(run.scope)
            assert holder is not None
            assert await new._store.steal(run.scope, holder[1], "newer-owner", 30.0)
        return None  # what insert_new says for a duplicate key

    with pytest.raises(RuntimeError, match="kept open"):
        async with old.session("s", "u") as run:
            await old.step("a", lambda: "first")
            [(fp, entry)] = run.entries[(path_key(()), "a")].items()
            again = StoredEntry(entry.path, "a", fp, "step", "json", CODEC_VERSION, b'"again"')
            store.db.insert_new = insert_meets_the_entry
            try:
                written = await store.write_entry(run.scope, run.token, run.epoch, again)
            finally:
                store.db.insert_new = real_insert
            raise RuntimeError("kept open")
    [row] = await new._store.load_run(run.scope, run.epoch)
    return written, entry.value, row.value


async def test_the_rewrite_replaces_the_entry_for_its_owner(
    two_runtimes: tuple[JournalRuntime, JournalRuntime],
) -> None:
    written, _, stored = await _rewrite_in_a_race(two_runtimes, taken_over=False)
    assert written
    assert stored == b'"again"'


async def test_a_takeover_before_the_rewrite_fences_it_out(
    two_runtimes: tuple[JournalRuntime, JournalRuntime],
) -> None:
    written, first, stored = await _rewrite_in_a_race(two_runtimes, taken_over=True)
    assert not written
    assert stored == first
