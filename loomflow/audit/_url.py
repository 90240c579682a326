"""Turn an audit store URL (from settings or the command line) into a store."""

from __future__ import annotations

from ..config import Settings
from ..errors import ConfigurationError
from ..storage import Database, PostgresDatabase, SqliteDatabase
from ..storage._schemes import check_scheme, file_path
from ._store import AuditStore

__all__ = ["audit_store_beside", "audit_store_for", "audit_store_from_url"]


def audit_store_from_url(url: str, *, settings: Settings | None = None) -> AuditStore:
    """Build the (not yet opened) audit store a URL names.

    ``memory://``; ``jsonl:///relative.jsonl``, ``jsonl:////absolute.jsonl`` or any path ending
    in ``.jsonl``; ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (a bare path works
    too); ``postgresql://…`` or ``postgres://…`` (needs the ``postgres`` extra).
    """
    scheme = check_scheme("audit", url)
    if scheme == "memory":
        from .inmemory import InMemoryAuditStore

        return InMemoryAuditStore()
    if scheme == "jsonl":
        from .jsonl import JsonlAuditStore

        return JsonlAuditStore(file_path(url, scheme))
    if scheme == "sqlite":
        from .sqlite import SqliteAuditStore

        return SqliteAuditStore(file_path(url, scheme), settings=settings)
    from .postgres import PostgresAuditStore

    return PostgresAuditStore(url)


def audit_store_beside(database: Database) -> AuditStore:
    """An audit store in a journal's own database (sharing its connection; not closed by it)."""
    if isinstance(database, PostgresDatabase):
        from .postgres import PostgresAuditStore

        return PostgresAuditStore(database)
    if isinstance(database, SqliteDatabase):
        from .sqlite import SqliteAuditStore

        return SqliteAuditStore(database)
    raise ConfigurationError(f"no audit store can live in a {type(database).__name__}")


def audit_store_for(
    settings: Settings, database: Database | None, *, url: str | None = None
) -> AuditStore | None:
    """Where a deployment keeps its audit log: ``url`` (else ``audit_url``)'s store, else a
    store in ``database`` (a journal's, sharing its connection), else ``None``."""
    url = url or settings.audit_url
    if url:
        return audit_store_from_url(url, settings=settings)
    if database is not None:
        return audit_store_beside(database)
    return None
