"""The journal conformance suite, run against every backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from loomflow.runtime import InMemoryRuntime, JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.testing.conformance import JournalConformance, RuntimeFactory


class TestInMemory(JournalConformance):
    @pytest.fixture
    async def make_runtime(self) -> RuntimeFactory:
        first = InMemoryRuntime()

        async def factory(**options: Any) -> JournalRuntime:
            # A second runtime over the same store stands for a second worker.
            return JournalRuntime(first._store, **options)

        return factory


class TestSqlite(JournalConformance):
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
class TestPostgres(JournalConformance):
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
