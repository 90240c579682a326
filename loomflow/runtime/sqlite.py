"""The embedded default: a journal in one SQLite file, through aiosqlite.

WAL mode with ``synchronous=FULL`` makes every committed step survive power loss; each write
is a single autocommitted statement, so one step costs one trip to aiosqlite's thread and one
fsync. Several processes may share the file: SQLite serialises writers (``busy_timeout``) and
the session rows fence out a process that lost its turn.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import Settings
from ..storage import SqliteDatabase
from ._journal import JournalRuntime
from ._sql import SqlJournalStore

__all__ = ["SqliteRuntime"]


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
        self._database = SqliteDatabase.from_settings(
            path, s, busy_timeout_ms=busy_timeout_ms, synchronous=synchronous
        )
        self.path = self._database.path  # a sqlite:/// URL taken for its file
        super().__init__(SqlJournalStore(self._database), settings=s, **options)

    @property
    def database(self) -> SqliteDatabase:
        """The connection, for stores that share it (checkpoints, memory, budget, audit)."""
        return self._database

    def __repr__(self) -> str:
        return f"SqliteRuntime({str(self.path)!r})"
