"""Whether two runtime objects write to the same journal.

A sub-agent may be built with a runtime object of its own (two ``Agent.from_settings`` agents
each open one) on the journal its parent already uses. Its run must then key under the
parent's run instead of waiting for the (session, user) turn the parent holds. Object
identity is not enough to tell, so each backend names where its rows live:

- in memory: the store object itself;
- SQLite: the file's device and inode (so ``./j.db``, an absolute path and a symlink agree);
  ``":memory:"`` is private to its connection;
- PostgreSQL: the cluster's system identifier, the database's oid and the oid of the
  ``loom_entries`` table the connection's ``search_path`` resolves to.
"""

from __future__ import annotations

import os
from typing import Protocol

from ..errors import StoreUnavailableError
from ..storage import PostgresDatabase, SqliteDatabase

__all__ = ["journal_identity"]


class _Journal(Protocol):
    """What tells where a runtime journals (a ``JournalRuntime``, which imports this module)."""

    @property
    def _store(self) -> object: ...


_PG_IDENTITY = """
SELECT (SELECT system_identifier::text FROM pg_control_system()),
    (SELECT oid::bigint FROM pg_database WHERE datname = current_database()),
    to_regclass('loom_entries')::oid::bigint
"""
# Some managed services revoke pg_control_system(); the postmaster's start time and port then
# tell servers apart (two servers started in the same microsecond on one port cannot both be
# reachable from here).
_PG_FALLBACK = """
SELECT pg_postmaster_start_time()::text || '@' || coalesce(inet_server_port(), 0)::text,
    (SELECT oid::bigint FROM pg_database WHERE datname = current_database()),
    to_regclass('loom_entries')::oid::bigint
"""


async def journal_identity(runtime: _Journal) -> tuple[object, ...]:
    """A value equal for two runtimes exactly when they journal to the same place."""
    database = getattr(runtime, "database", None)
    if isinstance(database, SqliteDatabase):
        return _sqlite_identity(database)
    if isinstance(database, PostgresDatabase):
        try:
            rows = await database.fetch(_PG_IDENTITY, what="journal identity")
        except StoreUnavailableError:
            rows = await database.fetch(_PG_FALLBACK, what="journal identity")
        server, db_oid, table_oid = rows[0]
        return ("postgres", str(server), int(db_oid), table_oid)
    return ("store", id(runtime._store))


def _sqlite_identity(database: SqliteDatabase) -> tuple[object, ...]:
    # One stat of a local file: cheap enough to run on the event loop, once per pair.
    if str(database.path) == ":memory:":
        return ("sqlite", "memory", id(database))
    try:
        stat = os.stat(database.path)
    except OSError:  # not created yet: nobody can be journaling there
        return ("sqlite", "path", os.path.realpath(database.path))
    return ("sqlite", "file", stat.st_dev, stat.st_ino)
