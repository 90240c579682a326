"""The memory conformance suite, on memory, SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loomflow.runtime import InMemoryRuntime, JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.testing.memory_conformance import MemoryConformance, RuntimeFactory


class TestInMemory(MemoryConformance):
    @pytest.fixture
    async def make_runtime(self) -> RuntimeFactory:
        first = InMemoryRuntime()

        async def factory(**options: Any) -> JournalRuntime:
            # A second runtime over the same journal stands for a second worker.
            return JournalRuntime(first._store, **options)

        return factory


class TestSqlite(MemoryConformance):
    @pytest.fixture
    async def make_runtime(self, sqlite_path: Path) -> AsyncIterator[RuntimeFactory]:
        opened: list[JournalRuntime] = []

        async def factory(**options: Any) -> JournalRuntime:
            runtime = SqliteRuntime(sqlite_path, **options)
            opened.append(runtime)
            return runtime

        yield factory
        for runtime in opened:
            await runtime.close()


@pytest.mark.postgres
class TestPostgres(MemoryConformance):
    @pytest.fixture
    async def make_runtime(self, pg_dsn: str) -> AsyncIterator[RuntimeFactory]:
        opened: list[JournalRuntime] = []

        async def factory(**options: Any) -> JournalRuntime:
            runtime = await PostgresRuntime.connect(pg_dsn, **options)
            opened.append(runtime)
            return runtime

        yield factory
        for runtime in opened:
            await runtime.close()
