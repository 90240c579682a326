"""Shared fixtures: a fresh SQLite file and a fresh PostgreSQL database per test.

PostgreSQL comes from ``LOOMFLOW_TEST_PG_DSN`` (default: the local server as ``postgres``).
When it cannot be reached the PostgreSQL tests fail under ``CI=true`` and skip elsewhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ulid import ULID

from loomflow.runtime import JournalRuntime, SessionInfo

PG_ADMIN_DSN = os.environ.get(
    "LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)


def _dsn_for(database: str) -> str:
    base, _, _ = PG_ADMIN_DSN.rpartition("/")
    return f"{base}/{database}"


def _admin(sql: str) -> None:
    """Run one admin statement; in a thread of its own, so async fixtures may call it too."""
    import asyncpg

    async def execute() -> None:
        conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, execute()).result()


def _create_database() -> str:
    name = f"loom_test_{str(ULID()).lower()}"
    try:
        _admin(f'CREATE DATABASE "{name}"')
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
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "journal.db"


@contextlib.asynccontextmanager
async def _runtimes(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[JournalRuntime]]]:
    """A factory of runtimes over one shared ``backend`` journal (a worker each)."""
    from loomflow.runtime import InMemoryRuntime, PostgresRuntime, SqliteRuntime

    opened: list[JournalRuntime] = []
    shared_memory = InMemoryRuntime()
    dsn = request.getfixturevalue("pg_dsn") if backend == "postgres" else ""

    async def factory(**options: Any) -> JournalRuntime:
        runtime: JournalRuntime
        if backend == "memory":
            runtime = JournalRuntime(shared_memory._store, **options)
        elif backend == "sqlite":
            runtime = SqliteRuntime(tmp_path / "journal.db", **options)
        else:
            runtime = await PostgresRuntime.connect(dsn, **options)
        opened.append(runtime)
        return runtime

    try:
        yield factory
    finally:
        for runtime in opened:
            await runtime.close()


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def runtime_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[JournalRuntime]]]:
    """Per backend: a factory of runtimes over one shared journal (a worker each)."""
    async with _runtimes(request.param, request, tmp_path) as factory:
        yield factory


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def sql_runtime_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[JournalRuntime]]]:
    """As ``runtime_factory``, on the SQL journals only: each runtime has its own connection
    (or pool), so a thread with a loop of its own can act as another worker."""
    async with _runtimes(request.param, request, tmp_path) as factory:
        yield factory


async def _until_given_back(runtime: JournalRuntime, session_id: str = "s") -> SessionInfo:
    """Until asyncio's finalizer has closed a stream the test dropped unclosed and its run
    gave its turn back (at most 5 s): a full collection per wait took seconds late in a long
    test run, so only the first few waits collect."""
    for attempt in range(500):
        if attempt < 3:
            gc.collect()
        await asyncio.sleep(0.01)
        [info] = await runtime.sessions(session_id=session_id)
        if info.state != "running":
            return info
    raise AssertionError(f"the dropped stream's run on {session_id!r} kept its turn")


@pytest.fixture
def until_given_back() -> Callable[..., Awaitable[SessionInfo]]:
    """Wait for a dropped stream's run to give its session back; returns the session."""
    return _until_given_back


@pytest.fixture(autouse=True)
def _no_leaked_database_threads() -> Iterator[None]:
    """Fail a test that leaves an aiosqlite connection open.

    An unclosed connection keeps a non-daemon worker thread alive, and the interpreter then
    waits for it forever at exit: a leak would hang the whole test run instead of failing.
    """
    before = {t.ident for t in threading.enumerate()}
    yield
    deadline = time.monotonic() + 2.0
    while True:
        leaked = [
            t
            for t in threading.enumerate()
            if t.ident not in before
            and t.is_alive()
            and not t.daemon
            and "_connection_worker_thread" in t.name
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if leaked:
        pytest.fail(f"{len(leaked)} aiosqlite connection(s) left open by this test")
