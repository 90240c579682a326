"""Pick the memory that belongs beside a runtime, or the one a URL names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import Settings
from ..redaction import Redactor
from ..storage import database_from_url
from ..storage._component import store_beside
from ..storage._schemes import check_scheme
from ._memory import DEFAULT_HISTORY_BYTES, Memory, redactor_of
from ._protocol import MemoryStore
from ._sql import SqlMemoryStore
from .inmemory import InMemoryMemoryStore

__all__ = ["memory_for", "memory_from_url", "memory_store_from_url"]


def memory_for(
    runtime: Any,
    *,
    history_episodes: int | None = 20,
    history_bytes: int | None = DEFAULT_HISTORY_BYTES,
    redactor: Redactor | None = None,
) -> Memory:
    """Memory stored beside ``runtime``'s journal, on the same connection (or pool).

    An ``InMemoryRuntime`` gets in-memory storage that lives as long as its journal; a
    ``SqliteRuntime`` or ``PostgresRuntime`` gets the memory tables in its database, created
    on first use unless the runtime was built with ``auto_migrate=False``.
    """
    sql: Callable[..., MemoryStore] = SqlMemoryStore
    in_memory: Callable[[], MemoryStore] = InMemoryMemoryStore
    store = store_beside(runtime, what="memory", sql_store=sql, memory_store=in_memory)
    return Memory(
        store, history_episodes=history_episodes, history_bytes=history_bytes, redactor=redactor
    )


def memory_from_url(
    url: str,
    *,
    history_episodes: int | None = 20,
    history_bytes: int | None = DEFAULT_HISTORY_BYTES,
    redactor: Redactor | None = None,
    settings: Settings | None = None,
) -> Memory:
    """Memory for a URL: ``memory://``, ``sqlite:///path.db`` or ``postgresql://...``.

    The memory owns the connection it opens; close it with ``await memory.close()``.
    """
    return Memory(
        memory_store_from_url(url, settings=settings),
        history_episodes=history_episodes,
        history_bytes=history_bytes,
        # As SqliteMemory(settings=) does: the settings given describe the redaction too.
        redactor=redactor if redactor is not None else redactor_of(settings),
    )


def memory_store_from_url(url: str, *, settings: Settings | None = None) -> MemoryStore:
    """The storage behind :func:`memory_from_url` (the store, without the ``Memory`` API)."""
    if check_scheme("memory", url) == "memory":
        return InMemoryMemoryStore()
    return SqlMemoryStore(
        database_from_url(url, settings=settings), owns_db=True, settings=settings
    )
