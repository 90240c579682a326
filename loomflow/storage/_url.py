"""Store URLs: ``sqlite:///relative.db``, ``sqlite:////absolute.db``, ``postgresql://...``."""

from __future__ import annotations

from ..config import Settings, scheme_without_slashes
from ..errors import ConfigurationError
from ._database import Database

__all__ = ["database_from_url", "sqlite_path"]


def sqlite_path(url: str) -> str | None:
    """The file a SQLite URL (or bare path) names; ``None`` for other schemes."""
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://")
        if not path.startswith("/") or path == "/":
            raise ConfigurationError(f"bad SQLite URL {url!r}: use sqlite:///relative/path.db")
        return path[1:]  # sqlite:///x.db -> x.db ; sqlite:////abs/x.db -> /abs/x.db
    if "://" in url:
        return None
    if (problem := scheme_without_slashes(url)) is not None:
        raise ConfigurationError(problem)
    return url


def database_from_url(url: str, *, settings: Settings | None = None) -> Database:
    """A (not yet connected) database for a store URL."""
    if url.startswith(("postgresql://", "postgres://")):
        from ._postgres import PostgresDatabase

        return PostgresDatabase(url)
    path = sqlite_path(url)
    if path is None:
        raise ConfigurationError(
            f"unknown store URL scheme in {url!r}: use sqlite:///path.db or postgresql://..."
        )
    from ._sqlite import SqliteDatabase

    return SqliteDatabase.from_settings(path, settings)
