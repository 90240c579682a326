"""The audit log in PostgreSQL, append-only in the database itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..storage import PostgresDatabase
from ._sql import SqlAuditStore

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresAuditStore"]


class PostgresAuditStore(SqlAuditStore):
    """Audit entries in PostgreSQL, shared by every worker process.

    UPDATE and DELETE of an entry are refused by a row trigger and TRUNCATE by a statement
    trigger; heads may only move forward. Build it from a DSN, an asyncpg pool (which stays
    yours), or a runtime's ``database`` to share its pool.
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool | PostgresDatabase,
        *,
        min_size: int = 1,
        max_size: int = 10,
        auto_migrate: bool = True,
    ) -> None:
        if isinstance(dsn_or_pool, PostgresDatabase):
            super().__init__(dsn_or_pool, owns_db=False, auto_migrate=auto_migrate)
            return
        db = PostgresDatabase(dsn_or_pool, min_size=min_size, max_size=max_size)
        super().__init__(db, owns_db=True, auto_migrate=auto_migrate)
