"""Turn a store URL (from settings or the command line) into a runtime."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..storage._schemes import check_scheme, file_path
from ._journal import JournalRuntime

__all__ = ["runtime_from_url"]


def runtime_from_url(
    url: str, *, settings: Settings | None = None, **options: Any
) -> JournalRuntime:
    """Build the runtime a URL names.

    ``memory://``; ``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (a bare file path
    works too); ``postgresql://…`` or ``postgres://…`` (needs the ``postgres`` extra). The
    schemes are those of :data:`loomflow.stores.SCHEMES`.
    """
    scheme = check_scheme("journal", url)
    # Imported here, so that a deployment on one backend never loads the others' drivers.
    if scheme == "memory":
        from .inmemory import InMemoryRuntime

        return InMemoryRuntime(settings=settings, **options)
    if scheme == "sqlite":
        from .sqlite import SqliteRuntime

        return SqliteRuntime(file_path(url, scheme), settings=settings, **options)
    from .postgres import PostgresRuntime

    return PostgresRuntime(url, settings=settings, **options)
