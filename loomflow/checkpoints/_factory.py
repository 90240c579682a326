"""Pick the checkpoint store that belongs beside a runtime, or the one a URL names."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..errors import UserError
from ..storage import Database, database_from_url
from ._protocol import CheckpointStore
from ._sql import SqlCheckpointStore
from .inmemory import InMemoryCheckpointStore

__all__ = ["checkpoint_store_for", "checkpoint_store_from_url"]

# The store is kept on the object that holds the storage (the SQL runtime's Database, or the
# in-memory journal), so runtimes over one journal share one store and it lives exactly as
# long as that storage.
_ATTRIBUTE = "_loomflow_checkpoint_store"


def checkpoint_store_for(runtime: Any) -> CheckpointStore:
    """The checkpoint store that shares ``runtime``'s storage.

    An ``InMemoryRuntime`` gets an in-memory store living as long as its journal; a
    ``SqliteRuntime`` or ``PostgresRuntime`` gets a SQL store on the runtime's own connection
    (or pool), migrated on first use unless the runtime was built with ``auto_migrate=False``.
    """
    database = getattr(runtime, "database", None)
    # The journal store object, not the runtime: runtimes built over one in-memory journal
    # (workers in tests) must see one set of checkpoints.
    key = database if isinstance(database, Database) else getattr(runtime, "_store", None)
    if key is None:
        raise UserError(
            f"{type(runtime).__name__} keeps no journal, so it has no checkpoint store; "
            "use InMemoryRuntime, SqliteRuntime or PostgresRuntime"
        )
    store = getattr(key, _ATTRIBUTE, None)
    if store is None:
        if isinstance(database, Database):
            store = SqlCheckpointStore(
                database,
                auto_migrate=getattr(runtime, "_auto_migrate", None),
                opener=runtime.open,
            )
        elif getattr(runtime, "backend", None) == "memory":
            store = InMemoryCheckpointStore()
        else:
            raise UserError(
                f"no checkpoint store is known for {type(runtime).__name__}; build one "
                "explicitly (SqliteCheckpointStore, PostgresCheckpointStore, ...)"
            )
        setattr(key, _ATTRIBUTE, store)
    return store


def checkpoint_store_from_url(url: str, *, settings: Settings | None = None) -> CheckpointStore:
    """A store for a URL: ``memory://``, ``sqlite:///path.db`` or ``postgresql://...``.

    The store owns the connection it opens; close it with ``await store.close()``.
    """
    if url.startswith("memory:"):
        return InMemoryCheckpointStore()
    return SqlCheckpointStore(
        database_from_url(url, settings=settings), owns_db=True, settings=settings
    )
