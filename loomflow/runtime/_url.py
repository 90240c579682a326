"""Turn a store URL (from settings or the command line) into a runtime."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import ConfigurationError
from ..storage._url import sqlite_path
from ._journal import JournalRuntime

__all__ = ["runtime_from_url"]


def runtime_from_url(
    url: str, *, settings: Settings | None = None, **options: Any
) -> JournalRuntime:
    """Build the runtime a URL names.

    ``memory://``; ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (a bare file path
    works too); ``postgresql://…`` or ``postgres://…`` (needs the ``postgres`` extra).
    """
    if url.startswith("memory:"):
        from .inmemory import InMemoryRuntime

        return InMemoryRuntime(settings=settings, **options)
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresRuntime

        return PostgresRuntime(url, settings=settings, **options)
    path = sqlite_path(url)
    if path is None:
        raise ConfigurationError(
            f"unknown journal URL scheme in {url!r}: use memory://, sqlite:///path.db or "
            "postgresql://..."
        )
    from .sqlite import SqliteRuntime

    return SqliteRuntime(path, settings=settings, **options)
