"""The production journal: PostgreSQL through an asyncpg pool.

Each step write is one autocommitted statement that also checks the run's fencing token under
a ``FOR SHARE`` lock of the session row, so the step is durable before ``step()`` returns and a
worker that lost its turn cannot write. Turn-taking uses lease rows, not advisory session
locks, because a pool hands connections (and their session locks) to other callers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import Settings
from ..storage import PostgresDatabase
from ._journal import JournalRuntime
from ._sql import SqlJournalStore

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresRuntime"]


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
        self._database = PostgresDatabase(
            dsn_or_pool,
            min_size=min_size,
            max_size=max_size,
            timeout_s=None if settings is None else settings.postgres_timeout_seconds,
        )
        super().__init__(SqlJournalStore(self._database), settings=settings, **options)

    @classmethod
    async def connect(cls, dsn: str, **kwargs: Any) -> PostgresRuntime:
        """Create the pool, migrate (unless ``auto_migrate=False``) and return the runtime."""
        runtime = cls(dsn, **kwargs)
        await runtime.open()
        return runtime

    @property
    def database(self) -> PostgresDatabase:
        """The pool wrapper, for stores that share it (checkpoints, memory, budget, audit)."""
        return self._database

    @property
    def pool(self) -> asyncpg.Pool:
        """The asyncpg pool in use (after the first connection)."""
        return self._database.pool

    def __repr__(self) -> str:
        return f"PostgresRuntime({self._database!r})"
