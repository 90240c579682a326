"""The audit log in a SQLite file (or in the journal's own SQLite database)."""

from __future__ import annotations

import os

from ..config import Settings
from ..storage import SqliteDatabase
from ._sql import SqlAuditStore

__all__ = ["SqliteAuditStore"]


class SqliteAuditStore(SqlAuditStore):
    """Audit entries in SQLite (WAL, ``synchronous=FULL``); several processes may append.

    Pass a path for a file of its own, or a runtime's ``database`` to share its connection::

        store = SqliteAuditStore("./audit.db")
        store = SqliteAuditStore(runtime.database)

    UPDATE and DELETE on the entries are refused by triggers. They guard against mistakes, not
    against someone who can rewrite the file; ``verify()`` finds such edits.
    """

    def __init__(
        self,
        path_or_database: str | os.PathLike[str] | SqliteDatabase,
        *,
        busy_timeout_ms: int | None = None,
        synchronous: str | None = None,
        auto_migrate: bool = True,
        settings: Settings | None = None,
    ) -> None:
        if isinstance(path_or_database, SqliteDatabase):
            super().__init__(path_or_database, owns_db=False, auto_migrate=auto_migrate)
            return
        db = SqliteDatabase.from_settings(
            path_or_database, settings, busy_timeout_ms=busy_timeout_ms, synchronous=synchronous
        )
        super().__init__(db, owns_db=True, auto_migrate=auto_migrate)
