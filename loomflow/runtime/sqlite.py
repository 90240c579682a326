"""The embedded default: a journal in one SQLite file, through aiosqlite.

WAL mode with ``synchronous=FULL`` makes every committed step survive power loss; each write
is a single autocommitted statement, so one step costs one trip to aiosqlite's thread and one
fsync. Several processes may share the file: SQLite serialises writers (``busy_timeout``) and
the session rows fence out a process that lost its turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from ..config import Settings
from ._journal import JournalRuntime
from ._sql import Dialect, SqlJournalStore, _Tx

__all__ = ["SqliteRuntime"]

SQLITE = Dialect(
    name="sqlite",
    # Unix seconds with millisecond precision from SQLite's own clock.
    now="((julianday('now') - 2440587.5) * 86400.0)",
    lock="",  # writers are serialised by the database lock itself
    types={"blob": "BLOB", "double": "REAL", "bigint": "INTEGER"},
    numbered=r"?\1",
)


class _SqliteTx(_Tx):
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str, *args: Any) -> None:
        await self._conn.execute(sql, args)

    async def fetch(self, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        return list(await self._conn.execute_fetchall(sql, args))


class SqliteStore(SqlJournalStore):
    backend = "sqlite"
    dialect = SQLITE
    driver_errors = (sqlite3.Error, OSError)

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_ms: int, synchronous: str):
        self.path = Path(path)
        self._busy_timeout_ms = int(busy_timeout_ms)
        if synchronous.upper() not in ("FULL", "NORMAL", "EXTRA"):
            raise ValueError(f"synchronous must be FULL, NORMAL or EXTRA, not {synchronous!r}")
        self._synchronous = synchronous.upper()
        self._conn: aiosqlite.Connection | None = None
        super().__init__()

    async def _connect(self) -> None:
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: each statement commits on its own; transactions are explicit.
        pending = aiosqlite.connect(self.path, isolation_level=None)
        try:
            conn = await pending
        except BaseException:
            # aiosqlite stops its worker thread without waiting for it; join it so that the
            # thread does not report to an event loop that the caller may close next.
            worker = getattr(pending, "_thread", None)
            if worker is not None:
                await asyncio.to_thread(worker.join, 5)
            raise
        try:
            await conn.execute(f"PRAGMA busy_timeout = {self._busy_timeout_ms}")
            await self._enable_wal(conn)
            await conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def _enable_wal(self, conn: aiosqlite.Connection) -> None:
        # Switching a new file to WAL needs a lock that SQLite does not wait for through
        # busy_timeout, so processes opening the same new file at once retry here.
        deadline = time.monotonic() + max(self._busy_timeout_ms, 1000) / 1000
        delay = 0.005
        while True:
            rows = await conn.execute_fetchall("PRAGMA journal_mode")
            if str(next(iter(rows))[0]).lower() == "wal":
                return
            try:
                await conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.close()

    @property
    def conn(self) -> aiosqlite.Connection:
        if self._conn is None:
            raise RuntimeError("the SQLite journal is not open")
        return self._conn

    async def _fetch(self, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        return await self.conn.execute_fetchall(sql, args)  # type: ignore[return-value]

    @contextlib.asynccontextmanager
    async def _migration_tx(self) -> AsyncIterator[_Tx]:
        conn = self.conn
        await conn.execute("BEGIN IMMEDIATE")  # takes the write lock: migrators queue here
        try:
            yield _SqliteTx(conn)
        except BaseException:
            await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")


class SqliteRuntime(JournalRuntime):
    """A journal in a SQLite file (created on first use, schema migrated automatically).

    Example:
        >>> runtime = SqliteRuntime("./journal.db")
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout_ms: int | None = None,
        synchronous: str | None = None,
        settings: Settings | None = None,
        **options: Any,
    ) -> None:
        """Open (lazily) the journal at ``path``.

        ``options`` are those of :class:`~loomflow.runtime.JournalRuntime`: ``serializer``,
        ``strict_replay``, ``max_payload_bytes``, ``turn_timeout``, ``lease_seconds``,
        ``auto_migrate``.
        """
        s = settings or Settings()
        self.path = Path(path)
        store = SqliteStore(
            path,
            busy_timeout_ms=s.sqlite_busy_timeout_ms
            if busy_timeout_ms is None
            else busy_timeout_ms,
            synchronous=s.sqlite_synchronous if synchronous is None else synchronous,
        )
        super().__init__(store, settings=s, **options)

    def __repr__(self) -> str:
        return f"SqliteRuntime({str(self.path)!r})"
