"""Store URLs: ``sqlite:///relative.db``, ``sqlite:////absolute.db``, ``postgresql://...``."""

from __future__ import annotations

from ..config import Settings, lower_scheme, sqlite_path
from ..errors import ConfigurationError
from ._database import Database

__all__ = ["database_from_url", "sqlite_path"]


def database_from_url(url: str, *, settings: Settings | None = None) -> Database:
    """A (not yet connected) database for a store URL."""
    url = lower_scheme(url)
    if url.startswith(("postgresql://", "postgres://")):
        from ._postgres import PostgresDatabase

        return PostgresDatabase(
            url, timeout_s=None if settings is None else settings.postgres_timeout_seconds
        )
    path = sqlite_path(url)
    if path is None:
        raise ConfigurationError(
            f"unknown store URL scheme in {url!r}: use sqlite:///path.db or postgresql://..."
        )
    from ._sqlite import SqliteDatabase

    return SqliteDatabase.from_settings(path, settings)
