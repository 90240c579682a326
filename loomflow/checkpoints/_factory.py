"""Pick the checkpoint store that belongs beside a runtime, or the one a URL names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import Settings
from ..storage import database_from_url
from ..storage._component import store_beside
from ..storage._schemes import check_scheme
from ._protocol import CheckpointStore
from ._sql import SqlCheckpointStore
from .inmemory import InMemoryCheckpointStore

__all__ = ["checkpoint_store_for", "checkpoint_store_from_url"]


def checkpoint_store_for(runtime: Any) -> CheckpointStore:
    """The checkpoint store that shares ``runtime``'s storage.

    An ``InMemoryRuntime`` gets an in-memory store living as long as its journal; a
    ``SqliteRuntime`` or ``PostgresRuntime`` gets a SQL store on the runtime's own connection
    (or pool), migrated on first use unless the runtime was built with ``auto_migrate=False``.
    """
    sql: Callable[..., CheckpointStore] = SqlCheckpointStore
    memory: Callable[[], CheckpointStore] = InMemoryCheckpointStore
    return store_beside(runtime, what="checkpoint", sql_store=sql, memory_store=memory)


def checkpoint_store_from_url(url: str, *, settings: Settings | None = None) -> CheckpointStore:
    """A store for a URL: ``memory://``, ``sqlite:///path.db`` or ``postgresql://...``.

    The store owns the connection it opens; close it with ``await store.close()``.
    """
    if check_scheme("checkpoints", url) == "memory":
        return InMemoryCheckpointStore()
    return SqlCheckpointStore(
        database_from_url(url, settings=settings), owns_db=True, settings=settings
    )
