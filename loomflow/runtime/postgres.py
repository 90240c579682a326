"""The production journal: PostgreSQL through an asyncpg pool.

Each step write is one autocommitted statement that also checks the run's fencing token under
a ``FOR SHARE`` lock of the session row, so the step is durable before ``step()`` returns and a
worker that lost its turn cannot write. Turn-taking uses lease rows, not advisory session
locks, because a pool hands connections (and their session locks) to other callers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ..config import Settings
from ._journal import JournalRuntime
from ._sql import Dialect, SqlJournalStore, _Tx

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresRuntime"]

POSTGRES = Dialect(
    name="postgres",
    now="extract(epoch from clock_timestamp())::float8",
    lock=" FOR SHARE",
    types={"blob": "BYTEA", "double": "DOUBLE PRECISION", "bigint": "BIGINT"},
    numbered=r"$\1",
)
# Arbitrary constant naming the migration lock ("loomflow" in ASCII, truncated to int64).
_MIGRATION_LOCK = 0x6C6F6F6D666C6F77


def _asyncpg() -> Any:
    try:
        import asyncpg
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "PostgresRuntime needs asyncpg: pip install 'loomflow[postgres]'"
        ) from exc
    return asyncpg


async def _no_reset(conn: asyncpg.Connection) -> None:
    return None


class _PgTx(_Tx):
    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str, *args: Any) -> None:
        await self._conn.execute(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        return list(await self._conn.fetch(sql, *args))


class PostgresStore(SqlJournalStore):
    backend = "postgres"
    dialect = POSTGRES

    def __init__(
        self, dsn: str | None, pool: asyncpg.Pool | None, *, min_size: int, max_size: int
    ) -> None:
        asyncpg = _asyncpg()
        self.driver_errors = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError)
        self._dsn = dsn
        self._pool = pool
        self._owns_pool = pool is None
        self._min_size = min_size
        self._max_size = max_size
        super().__init__()

    async def _connect(self) -> None:
        if self._pool is None:
            # Our statements are single autocommitted ones that leave no session state, so
            # the pool's reset query (RESET ALL; UNLISTEN *; ...) on every release is a wasted
            # round trip: measured 454 us -> 350 us per pooled INSERT on loopback.
            self._pool = await _asyncpg().create_pool(
                self._dsn, min_size=self._min_size, max_size=self._max_size, reset=_no_reset
            )

    async def close(self) -> None:
        if self._pool is not None and self._owns_pool:
            pool, self._pool = self._pool, None
            await pool.close()

    @property
    def pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError("the PostgreSQL journal is not connected")
        return self._pool

    async def _fetch(self, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        return await self.pool.fetch(sql, *args)  # type: ignore[no-any-return]

    @contextlib.asynccontextmanager
    async def _migration_tx(self) -> AsyncIterator[_Tx]:
        async with self.pool.acquire() as conn, conn.transaction():
            # Transaction-scoped, so the pool cannot leak it to another caller.
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            yield _PgTx(conn)


class PostgresRuntime(JournalRuntime):
    """A journal in PostgreSQL, shared by any number of worker processes.

    Build it from a DSN (``await PostgresRuntime.connect(dsn)``, or ``PostgresRuntime(dsn)``
    which connects on first use) or from an asyncpg pool you already have
    (``PostgresRuntime(pool)``; the pool stays yours to close).
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        *,
        min_size: int = 1,
        max_size: int = 10,
        settings: Settings | None = None,
        **options: Any,
    ) -> None:
        if isinstance(dsn_or_pool, str):
            store = PostgresStore(dsn_or_pool, None, min_size=min_size, max_size=max_size)
        else:
            store = PostgresStore(None, dsn_or_pool, min_size=min_size, max_size=max_size)
        self._pg_store = store
        super().__init__(store, settings=settings, **options)

    @classmethod
    async def connect(cls, dsn: str, **kwargs: Any) -> PostgresRuntime:
        """Create the pool, migrate (unless ``auto_migrate=False``) and return the runtime."""
        runtime = cls(dsn, **kwargs)
        await runtime._ensure_open()
        return runtime

    @property
    def pool(self) -> asyncpg.Pool:
        """The asyncpg pool in use (after the first connection)."""
        return self._pg_store.pool

    def __repr__(self) -> str:
        source = "pool" if self._pg_store._dsn is None else "dsn"
        return f"PostgresRuntime(<{source}>)"
