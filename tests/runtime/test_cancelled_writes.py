"""A caller cancelled mid-write (a request timeout, a client gone) leaves no transaction open.

aiosqlite runs each statement on its own thread, to the end, whatever becomes of the task that
awaited it. A task cancelled while its ``BEGIN IMMEDIATE`` waited for the write lock used to
leave the connection inside that transaction: every later write of the process then failed
(the journal's "database is locked", the audit's "cannot start a transaction within a
transaction") until it restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent, ToolCall, tool
from loomflow.audit import AuditLog
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.storage import SqliteDatabase


async def _insert(db: SqliteDatabase, value: int) -> None:
    async with db.transaction(what="test insert") as tx:
        await tx.execute("INSERT INTO t (v) VALUES ($1)", value)


def _write_lock_is_free(path: Path) -> bool:
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        other.close()


@pytest.mark.parametrize("lock_outlives_wait", [False, True], ids=["granted", "timed-out"])
async def test_a_begin_cancelled_while_it_waits_for_the_lock_is_rolled_back(
    tmp_path: Path, lock_outlives_wait: bool
) -> None:
    path = tmp_path / "t.db"
    db = SqliteDatabase(path, busy_timeout_ms=400)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        await db.execute("CREATE TABLE t (v INTEGER NOT NULL)")
        holder.execute("BEGIN IMMEDIATE")  # another process's writer, say
        waiting = asyncio.create_task(_insert(db, 1))
        await asyncio.sleep(0.1)  # its BEGIN now waits on aiosqlite's thread
        waiting.cancel()
        await asyncio.sleep(0.05)
        if not lock_outlives_wait:
            holder.execute("ROLLBACK")  # the BEGIN is granted after its caller has gone
        with pytest.raises(asyncio.CancelledError):
            await waiting
        if lock_outlives_wait:
            holder.execute("ROLLBACK")
        # Nothing of the cancelled write landed, nothing of it is held, the next write works.
        assert db.conn.in_transaction is False
        assert _write_lock_is_free(path)
        await _insert(db, 2)
        assert [tuple(r) for r in await db.fetch("SELECT v FROM t")] == [(2,)]
    finally:
        holder.close()
        await db.close()


async def test_a_cancelled_begin_is_undone_even_if_cancelled_again(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    db = SqliteDatabase(path, busy_timeout_ms=2000)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        await db.execute("CREATE TABLE t (v INTEGER NOT NULL)")
        holder.execute("BEGIN IMMEDIATE")
        waiting = asyncio.create_task(_insert(db, 1))
        await asyncio.sleep(0.1)
        for _ in range(3):  # an impatient caller: each cancel lands while the undo waits
            waiting.cancel()
            await asyncio.sleep(0.05)
        assert not waiting.done()  # still seeing its undo through, holding the process's lock
        holder.execute("ROLLBACK")
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert db.conn.in_transaction is False
        assert _write_lock_is_free(path)
        await _insert(db, 2)
    finally:
        holder.close()
        await db.close()


@tool
async def echo(i: int) -> str:
    """Echo a number."""
    await asyncio.sleep(0)
    return str(i)


def _steps(messages: list[Message], tools: list[ToolSpec]) -> Any:
    done = sum(1 for m in messages if m.role == "tool")
    return [ToolCall(id=f"c{done}", name="echo", arguments={"i": done})] if done < 6 else "done"


async def _cancel_many_then_run(runtime: JournalRuntime, audit: AuditLog) -> None:
    agent = Agent("cancelled", model=FunctionModel(_steps), tools=[echo], runtime=runtime,
                  audit=audit, memory=False)  # fmt: skip
    # Cancel at many points of a run (the loop's turns between the journal's, the audit's
    # and the budget's writes); each cancelled run leaves the stores fit for the next.
    for k in range(40):
        task = asyncio.create_task(agent.run("go", session_id=f"cut-{k}", user_id="u"))
        for _ in range(k):
            await asyncio.sleep(0)
        await asyncio.sleep(0.0005 * (k % 5))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        result = await asyncio.wait_for(
            agent.run("go", session_id=f"whole-{k}", user_id="u"), timeout=30
        )
        assert result.output == "done"
    # Every cancelled run resumes to its end, and the audit trail is whole.
    for k in range(40):
        resumed = await agent.resume("go", session_id=f"cut-{k}", user_id="u")
        assert resumed.output == "done"
    report = await audit.verify()
    assert report.ok, report.problems


async def test_cancelled_runs_leave_sqlite_journal_and_audit_writable(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    audit = AuditLog(f"sqlite:///{tmp_path / 'journal.db'}")
    try:
        await _cancel_many_then_run(runtime, audit)
    finally:
        await audit.close()
        await runtime.close()


@pytest.mark.postgres
async def test_cancelled_runs_leave_postgres_journal_and_audit_writable(pg_dsn: str) -> None:
    runtime = await PostgresRuntime.connect(pg_dsn)
    audit = AuditLog(pg_dsn)
    try:
        await _cancel_many_then_run(runtime, audit)
    finally:
        await audit.close()
        await runtime.close()
