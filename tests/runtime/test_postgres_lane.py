"""The PostgreSQL lane: single statements on a connection of our own while it is free.

The pool serves whatever the lane cannot (a statement while another is on it, transactions),
and a lane that breaks or is abandoned mid-statement is replaced without losing a statement.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from loomflow.errors import StoreUnavailableError
from loomflow.runtime import PostgresRuntime
from loomflow.storage import PostgresDatabase

pytestmark = pytest.mark.postgres


@pytest.fixture
async def db(pg_dsn: str) -> AsyncIterator[PostgresDatabase]:
    database = PostgresDatabase(pg_dsn)
    try:
        yield database
    finally:
        await database.close()


async def _lane_up(db: PostgresDatabase) -> Any:
    """Wait until the lane is connected (it connects in the background on first use)."""
    for _ in range(500):
        await db.fetch("SELECT 1")
        if db._lane is not None:
            return db._lane
        await asyncio.sleep(0.01)
    raise AssertionError("the lane never connected")


class _CountingPool:
    """The database's pool, noting each connection taken from it (one per statement that
    did not get the lane)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.seen: list[str] = []

    def acquire(self, **options: Any) -> Any:
        self.seen.append("acquire")
        return self.pool.acquire(**options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def _count_pool_statements(db: PostgresDatabase) -> list[str]:
    counting = _CountingPool(db.pool)
    db._pool = counting  # type: ignore[assignment]
    return counting.seen


async def test_sequential_statements_skip_the_pool(db: PostgresDatabase) -> None:
    await _lane_up(db)
    through_pool = _count_pool_statements(db)
    await db.execute("CREATE TABLE t (n int)")
    for n in range(20):
        assert await db.count("INSERT INTO t VALUES ($1)", n) == 1
    assert (await db.fetch("SELECT count(*) FROM t"))[0][0] == 20
    assert through_pool == []


async def test_concurrent_statements_overflow_to_the_pool(db: PostgresDatabase) -> None:
    await _lane_up(db)
    through_pool = _count_pool_statements(db)
    rows = await asyncio.gather(*(db.fetch("SELECT $1::int, pg_sleep(0.05)", n) for n in range(4)))
    assert [r[0][0] for r in rows] == [0, 1, 2, 3]
    assert len(through_pool) == 3  # one statement had the lane, the others the pool


async def test_a_server_error_keeps_the_lane(db: PostgresDatabase) -> None:
    lane = await _lane_up(db)
    with pytest.raises(StoreUnavailableError, match="division by zero"):
        await db.fetch("SELECT 1 / (SELECT 0)")
    assert db._lane is lane
    assert (await db.fetch("SELECT 2"))[0][0] == 2


async def test_a_lane_killed_by_the_server_is_replaced(db: PostgresDatabase, pg_dsn: str) -> None:
    lane = await _lane_up(db)
    pid = (await db.fetch("SELECT pg_backend_pid()"))[0][0]
    assert pid == lane.get_server_pid()
    other = PostgresDatabase(pg_dsn)
    try:
        await other.fetch("SELECT pg_terminate_backend($1)", pid)
    finally:
        await other.close()
    for _ in range(100):  # the loop learns of the closed socket
        if lane.is_closed():
            break
        await asyncio.sleep(0.01)
    # Served by the pool while the lane is down; nothing fails.
    assert (await db.fetch("SELECT 3"))[0][0] == 3
    db._lane_retry_at = 0.0  # do not wait out the retry pause
    replaced = await _lane_up(db)
    assert replaced is not lane
    assert replaced.get_server_pid() != pid


async def test_a_statement_cancelled_on_the_lane_leaves_later_ones_working(
    db: PostgresDatabase,
) -> None:
    lane = await _lane_up(db)
    slow = asyncio.ensure_future(db.fetch("SELECT pg_sleep(5)"))
    await asyncio.sleep(0.2)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    assert db._lane is not lane  # abandoned mid-statement: not reused
    assert (await db.fetch("SELECT 4"))[0][0] == 4


async def test_an_adopted_pool_gets_no_lane(pg_dsn: str) -> None:
    import asyncpg

    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    runtime = PostgresRuntime(pool)
    try:
        async with runtime.session("s", "u"):
            for n in range(5):
                assert await runtime.step(f"a{n}", lambda n=n: n) == n
        await asyncio.sleep(0.05)
        assert runtime.database._lane is None
        assert runtime.database._lane_task is None
    finally:
        await runtime.close()
        await pool.close()


async def test_closing_closes_the_lane(pg_dsn: str) -> None:
    db = PostgresDatabase(pg_dsn)
    lane = await _lane_up(db)
    await db.close()
    assert lane.is_closed()
    assert db._lane is None


async def test_a_statement_ending_on_a_dropped_lane_leaves_its_successor_busy(
    db: PostgresDatabase, pg_dsn: str
) -> None:
    import asyncpg

    lane = await _lane_up(db)
    assert db._take_lane() is lane  # a statement is on it
    db._drop_lane(lane)  # another statement found it broken
    successor = await asyncpg.connect(pg_dsn)
    db._lane = successor
    assert db._take_lane() is successor  # the next statement has the new lane
    db._free_lane(lane)  # the first statement ends (its finally)
    assert db._take_lane() is None  # the new lane is still taken: no second statement on it
    db._free_lane(successor)
    assert db._take_lane() is successor
    db._free_lane(successor)
