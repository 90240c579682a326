"""Pick the memory that belongs beside a runtime, or the one a URL names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import Settings
from ..storage._component import store_beside
from ._memory import Memory
from ._protocol import MemoryStore
from ._sql import SqlMemoryStore
from .inmemory import InMemoryMemoryStore

__all__ = ["memory_for", "memory_from_url"]


def memory_for(runtime: Any, *, history_episodes: int | None = 20) -> Memory:
    """Memory stored beside ``runtime``'s journal, on the same connection (or pool).

    An ``InMemoryRuntime`` gets in-memory storage that lives as long as its journal; a
    ``SqliteRuntime`` or ``PostgresRuntime`` gets the memory tables in its database, created
    on first use unless the runtime was built with ``auto_migrate=False``.
    """
    sql: Callable[..., MemoryStore] = SqlMemoryStore
    in_memory: Callable[[], MemoryStore] = InMemoryMemoryStore
    store = store_beside(runtime, what="memory", sql_store=sql, memory_store=in_memory)
    return Memory(store, history_episodes=history_episodes)


def memory_from_url(
    url: str, *, history_episodes: int | None = 20, settings: Settings | None = None
) -> Memory:
    """Memory for a URL: ``memory://``, ``sqlite:///path.db`` or ``postgresql://...``.

    The memory owns the connection it opens; close it with ``await memory.close()``.
    """
    from ..stores import store_from_url

    store: MemoryStore = store_from_url("memory", url, settings=settings)
    return Memory(store, history_episodes=history_episodes)
