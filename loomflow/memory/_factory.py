"""Pick the memory that belongs beside a runtime, or the one a URL names."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import UserError
from ..storage import Database, database_from_url
from ._memory import Memory
from ._sql import SqlMemoryStore
from .inmemory import InMemoryMemoryStore

__all__ = ["memory_for", "memory_from_url"]

# The store is kept on the object that holds the storage (the SQL runtime's Database, or the
# in-memory journal), so runtimes over one journal share one store and it lives exactly as
# long as that storage.
_ATTRIBUTE = "_loomflow_memory_store"


def memory_for(runtime: Any, *, history_episodes: int | None = 20) -> Memory:
    """Memory stored beside ``runtime``'s journal, on the same connection (or pool).

    An ``InMemoryRuntime`` gets in-memory storage that lives as long as its journal; a
    ``SqliteRuntime`` or ``PostgresRuntime`` gets the memory tables in its database, created
    on first use unless the runtime was built with ``auto_migrate=False``.
    """
    database = getattr(runtime, "database", None)
    key = database if isinstance(database, Database) else getattr(runtime, "_store", None)
    if key is None:
        raise UserError(
            f"{type(runtime).__name__} keeps no journal to store memory beside; use "
            "InMemoryMemory, SqliteMemory or PostgresMemory"
        )
    store = getattr(key, _ATTRIBUTE, None)
    if store is None:
        if isinstance(database, Database):
            store = SqlMemoryStore(
                database,
                auto_migrate=getattr(runtime, "_auto_migrate", None),
                opener=runtime.open,
            )
        elif getattr(runtime, "backend", None) == "memory":
            store = InMemoryMemoryStore()
        else:
            raise UserError(f"no memory backend is known for {type(runtime).__name__}")
        setattr(key, _ATTRIBUTE, store)
    return Memory(store, history_episodes=history_episodes)


def memory_from_url(
    url: str, *, history_episodes: int | None = 20, settings: Settings | None = None
) -> Memory:
    """Memory for a URL: ``memory://``, ``sqlite:///path.db`` or ``postgresql://...``.

    The memory owns the connection it opens; close it with ``await memory.close()``.
    """
    if url.startswith("memory:"):
        return Memory(InMemoryMemoryStore(), history_episodes=history_episodes)
    db = database_from_url(url, settings=settings)
    store = SqlMemoryStore(db, owns_db=True, settings=settings)
    return Memory(store, history_episodes=history_episodes)
