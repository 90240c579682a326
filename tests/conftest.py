"""Shared fixtures: a fresh SQLite file and a fresh PostgreSQL database per test.

PostgreSQL comes from ``LOOMFLOW_TEST_PG_DSN`` (default: the local server as ``postgres``).
When it cannot be reached the PostgreSQL tests fail under ``CI=true`` and skip elsewhere.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from ulid import ULID

PG_ADMIN_DSN = os.environ.get(
    "LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)


def _dsn_for(database: str) -> str:
    base, _, _ = PG_ADMIN_DSN.rpartition("/")
    return f"{base}/{database}"


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _create_database() -> str:
    name = f"loom_test_{str(ULID()).lower()}"
    try:
        asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    except (OSError, ImportError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL is required in CI and unreachable at {PG_ADMIN_DSN}: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_DSN}: {exc}")
    return name


@pytest.fixture
def pg_dsn() -> Iterator[str]:
    """The DSN of a brand-new, empty PostgreSQL database, dropped after the test."""
    name = _create_database()
    try:
        yield _dsn_for(name)
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"
