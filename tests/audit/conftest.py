"""The audit store every backend's test body runs on: memory, SQLite, JSONL and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.audit import (
    AuditStore,
    InMemoryAuditStore,
    JsonlAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
)


@pytest.fixture(
    params=["memory", "sqlite", "jsonl", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditStore]:
    made: AuditStore
    if request.param == "memory":
        made = InMemoryAuditStore()
    elif request.param == "sqlite":
        made = SqliteAuditStore(tmp_path / "audit.db")
    elif request.param == "jsonl":
        made = JsonlAuditStore(tmp_path / "audit.jsonl", fsync=False)
    else:
        made = PostgresAuditStore(request.getfixturevalue("pg_dsn"))
    await made.open()
    yield made
    await made.close()
