"""PostgreSQL through an asyncpg pool (created from a DSN, or adopted)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError, UserError
from ._database import Database, Rows, Transaction
from ._dialect import POSTGRES

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresDatabase"]


def _asyncpg() -> Any:
    try:
        import asyncpg
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "PostgreSQL support needs asyncpg: pip install 'loomflow[postgres]'"
        ) from exc
    return asyncpg


async def _no_reset(conn: asyncpg.Connection) -> None:
    return None


class _Tx(Transaction):
    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str, *args: Any) -> None:
        await self._conn.execute(sql, *args)

    async def fetch(self, sql: str, *args: Any) -> Rows:
        return list(await self._conn.fetch(sql, *args))


class PostgresDatabase(Database):
    """An asyncpg pool. From a DSN the pool is ours (and closed by :meth:`close`); an adopted
    pool stays the caller's."""

    dialect = POSTGRES

    def __init__(
        self, dsn_or_pool: str | asyncpg.Pool, *, min_size: int = 1, max_size: int = 10
    ) -> None:
        super().__init__()
        driver = _asyncpg()
        self.driver_errors = (driver.PostgresError, driver.InterfaceError, OSError)
        self._dsn = dsn_or_pool if isinstance(dsn_or_pool, str) else None
        self._pool: asyncpg.Pool | None = None if isinstance(dsn_or_pool, str) else dsn_or_pool
        self._owns_pool = isinstance(dsn_or_pool, str)
        self._min_size = min_size
        self._max_size = max_size

    def __repr__(self) -> str:
        return f"PostgresDatabase(<{'dsn' if self._owns_pool else 'pool'}>)"

    @property
    def is_open(self) -> bool:
        return self._pool is not None

    @property
    def pool(self) -> asyncpg.Pool:
        """The asyncpg pool (after :meth:`open`)."""
        if self._pool is None:
            raise RuntimeError("the PostgreSQL database is not connected")
        return self._pool

    async def _connect(self) -> None:
        # Our statements are single autocommitted ones that leave no session state, so the
        # pool's reset query (RESET ALL; UNLISTEN *; ...) on every release would be a wasted
        # round trip: measured 454 us -> 350 us per pooled INSERT on loopback.
        try:
            self._pool = await _asyncpg().create_pool(
                self._dsn, min_size=self._min_size, max_size=self._max_size, reset=_no_reset
            )
        except ValueError as exc:  # asyncpg's DSN parser: a malformed port, option, ...
            raise ConfigurationError(f"bad PostgreSQL DSN: {exc}") from None

    def _forget_connection(self) -> object | None:
        if not self._owns_pool and self._pool is not None:
            raise UserError(
                "this asyncpg pool was created before the process forked and cannot be used "
                "in the child; give the runtime or store a DSN (it then connects anew in each "
                "process) or create the pool after the fork"
            )
        pool, self._pool = self._pool, None
        return pool

    async def _disconnect(self) -> None:
        if self._owns_pool and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    async def _fetch(self, sql: str, *args: Any) -> Rows:
        return await self.pool.fetch(sql, *args)  # type: ignore[no-any-return]

    async def _count(self, sql: str, *args: Any) -> int:
        status: str = await self.pool.execute(sql, *args)  # e.g. "INSERT 0 1", "UPDATE 2"
        return int(status.rsplit(" ", 1)[-1])

    @contextlib.asynccontextmanager
    async def _transaction(self, lock_key: int | None) -> AsyncIterator[Transaction]:
        async with self.pool.acquire() as conn, conn.transaction():
            if lock_key is not None:
                # Transaction-scoped, so the pool cannot hand the lock to another caller.
                await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key)
            yield _Tx(conn)
