"""A user's export and erasure find memory rows through indexes, on a database of any age."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import asyncpg
import pytest

from loomflow.errors import MigrationError
from loomflow.memory import PostgresMemory, SqliteMemory
from loomflow.memory._sql import _OF_USER, _TABLES
from loomflow.memory.migrations import COMPONENT, MIGRATIONS, SCHEMA_VERSION
from loomflow.storage import PostgresDatabase, SqliteDatabase, apply_migrations

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from _cli import loomflow

_INDEXES = {
    "loom_memory_episodes": "loom_memory_episodes_user",
    "loom_memory_facts": "loom_memory_facts_user",
    "loom_memory_blocks": "loom_memory_blocks_user",
}


def _of_user(table: str) -> str:
    # What export_user and forget_user ask of each table, in SQLite's placeholders.
    return f"SELECT * FROM {table} WHERE {_OF_USER}".replace("$1", "?").replace("$2", "?")


async def _first_version(db: SqliteDatabase | PostgresDatabase) -> None:
    """The memory tables as loomflow 0.20 left them (schema version 1), holding a user."""
    await db.open()
    assert await apply_migrations(db, COMPONENT, MIGRATIONS[:1]) == 1
    await db.close()


async def test_an_existing_sqlite_database_gets_the_user_indexes_from_migrate(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    await _first_version(SqliteDatabase(path))
    memory = SqliteMemory(path, auto_migrate=False)
    with pytest.raises(MigrationError, match=r"version 1 and this loomflow needs 2.*migrate"):
        await memory.remember("alice", "lives_in", "Paris", user_id="alice")
    await memory.close()
    with sqlite3.connect(path) as conn:  # a row of the old version, to be found afterwards
        conn.execute(
            "INSERT INTO loom_memory_facts (fact_id, user_key, user_id, subject, predicate, "
            "object, valid_from) VALUES ('f1', '[\"alice\"]', 'alice', 'alice', 'lives_in', "
            "'Paris', 1.0)"
        )
    done = loomflow("--url", f"sqlite:///{path}", "migrate")
    assert done.returncode == 0, done.stderr
    assert f"memory schema at version {SCHEMA_VERSION}" in done.stdout
    assert SCHEMA_VERSION == 2
    with sqlite3.connect(path) as conn:
        for table, index in _INDEXES.items():
            plan = " ".join(
                row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {_of_user(table)}", ("k", "u"))
            )
            assert "MULTI-INDEX OR" in plan, plan
            assert f"USING INDEX {index} (user_id=?)" in plan, plan
            assert "SCAN" not in plan, plan
    memory = SqliteMemory(path)
    assert [f.object for f in await memory.facts(user_id="alice")] == ["Paris"]
    assert (await memory.forget_user("alice"))["facts"] == 1
    await memory.close()


@pytest.mark.postgres
async def test_an_existing_postgres_database_gets_the_user_indexes_from_migrate(
    pg_dsn: str,
) -> None:
    await _first_version(PostgresDatabase(pg_dsn))
    done = loomflow("--url", pg_dsn, "migrate")
    assert done.returncode == 0, done.stderr
    assert f"memory schema at version {SCHEMA_VERSION}" in done.stdout
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("SET enable_seqscan = off")
        for table, index in _INDEXES.items():
            sql = f"EXPLAIN SELECT * FROM {table} WHERE {_OF_USER}"
            plan = " ".join(r[0] for r in await conn.fetch(sql, "k", "u"))
            assert index in plan, plan
            assert "Seq Scan" not in plan, plan
            delete = f"EXPLAIN DELETE FROM {table} WHERE {_OF_USER}"
            assert index in " ".join(r[0] for r in await conn.fetch(delete, "k", "u"))
    finally:
        await conn.close()
    memory = PostgresMemory(pg_dsn)
    await memory.set_block("notes", "x", user_id="alice")
    assert (await memory.forget_user("alice"))["blocks"] == 1
    await memory.close()


def test_the_export_and_erasure_tables_are_all_indexed() -> None:
    assert set(_TABLES.values()) == set(_INDEXES)
