"""Turn an audit store URL (from settings or the command line) into a store."""

from __future__ import annotations

from ..config import Settings
from ..errors import ConfigurationError
from ..storage import Database, PostgresDatabase, SqliteDatabase
from ..storage._url import sqlite_path
from ._store import AuditStore

__all__ = ["audit_store_beside", "audit_store_for", "audit_store_from_url"]


def audit_store_from_url(url: str, *, settings: Settings | None = None) -> AuditStore:
    """Build the (not yet opened) audit store a URL names.

    ``memory://``; ``jsonl:///relative.jsonl``, ``jsonl:////absolute.jsonl`` or any path ending
    in ``.jsonl``; ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (a bare path works
    too); ``postgresql://…`` or ``postgres://…`` (needs the ``postgres`` extra).
    """
    if url.startswith("memory:"):
        from .inmemory import InMemoryAuditStore

        return InMemoryAuditStore()
    if url.startswith("jsonl://") or (url.endswith(".jsonl") and "://" not in url):
        from .jsonl import JsonlAuditStore

        path = url.removeprefix("jsonl://")
        if url.startswith("jsonl://"):
            if not path.startswith("/") or path == "/":
                raise ConfigurationError(f"bad JSONL URL {url!r}: use jsonl:///relative/path.jsonl")
            path = path[1:]
        return JsonlAuditStore(path)
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresAuditStore

        return PostgresAuditStore(url)
    file = sqlite_path(url)
    if file is None:
        raise ConfigurationError(
            f"unknown audit URL scheme in {url!r}: use memory://, jsonl:///path.jsonl, "
            "sqlite:///path.db or postgresql://..."
        )
    from .sqlite import SqliteAuditStore

    return SqliteAuditStore(file, settings=settings)


def audit_store_beside(database: Database) -> AuditStore:
    """An audit store in a journal's own database (sharing its connection; not closed by it)."""
    if isinstance(database, PostgresDatabase):
        from .postgres import PostgresAuditStore

        return PostgresAuditStore(database)
    if isinstance(database, SqliteDatabase):
        from .sqlite import SqliteAuditStore

        return SqliteAuditStore(database)
    raise ConfigurationError(f"no audit store can live in a {type(database).__name__}")


def audit_store_for(settings: Settings, database: Database | None) -> AuditStore | None:
    """Where a deployment keeps its audit log: ``audit_url``'s store, else a store in
    ``database`` (a journal's, sharing its connection), else ``None``."""
    if settings.audit_url:
        return audit_store_from_url(settings.audit_url, settings=settings)
    if database is not None:
        return audit_store_beside(database)
    return None
