"""The lifecycle every SQL store shares: open (maybe through its owner), migrate once, close."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

from ..config import Settings
from ._database import Database
from ._migrations import Migration, apply_migrations, require_schema

__all__ = ["ComponentStore", "store_beside"]

T = TypeVar("T")


class ComponentStore:
    """Base of a store that keeps one component's tables in a :class:`Database`.

    Subclasses set ``component`` and ``migrations`` and run their SQL through :meth:`_fetch`.

    Args:
        db: The database (often a runtime's, shared).
        owns_db: Close ``db`` when the store is closed.
        auto_migrate: Create or upgrade the tables on first use (default: the
            ``LOOMFLOW_AUTO_MIGRATE`` setting).
        settings: Where defaults come from.
        opener: How to open a shared ``db`` through its owner (e.g. ``runtime.open``), so
            that the owner's ``close()`` also closes it.
    """

    component: ClassVar[str]
    migrations: ClassVar[Sequence[Migration]]

    def __init__(
        self,
        db: Database,
        *,
        owns_db: bool = False,
        auto_migrate: bool | None = None,
        settings: Settings | None = None,
        opener: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.db = db
        self.backend = db.backend
        self._owns_db = owns_db
        self._opener = opener
        self.auto_migrate = (
            (settings or Settings()).auto_migrate if auto_migrate is None else auto_migrate
        )
        self._migrated = False
        self._ready_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.db!r})"

    async def open(self) -> None:
        if not (self._migrated and self.db.is_open):
            async with self._ready_lock:
                await self._open_once()

    async def _open_once(self) -> None:
        if not self.db.is_open:
            # A shared connection is opened by its owner (the runtime), which then also
            # closes it; opening it behind the owner's back would leak it past its close().
            await (self._opener() if self._opener is not None else self.db.open())
        if not self._migrated:
            if self.auto_migrate:
                await apply_migrations(self.db, self.component, self.migrations)
            else:
                # Checked once, so a store nobody migrated says "run loomflow migrate" rather
                # than failing later on a missing table.
                await require_schema(self.db, self.component, self.migrations)
            self._migrated = True

    async def close(self) -> None:
        if self._owns_db:
            await self.db.close()

    async def migrate(self) -> int:
        await self.db.open()
        return await apply_migrations(self.db, self.component, self.migrations)

    async def _fetch(self, what: str, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        await self.open()
        return await self.db.fetch(sql, *args, what=f"{self.component} {what}")


def store_beside(
    runtime: Any,
    *,
    what: str,
    sql_store: Callable[..., T],
    memory_store: Callable[[], T],
) -> T:
    """The ``what`` store that lives beside ``runtime``'s journal, created once per journal.

    A SQL runtime gets ``sql_store(database, auto_migrate=..., opener=runtime.open)`` on its own
    connection; an in-memory journal gets ``memory_store()``. The store is kept on the object
    that holds the storage (the Database, or the in-memory journal), so runtimes over one
    journal share one store and it lives exactly as long as that storage.
    """
    from ..errors import UserError  # here, not at the top: errors imports nothing of ours

    database = getattr(runtime, "database", None)
    key = database if isinstance(database, Database) else getattr(runtime, "_store", None)
    if key is None:
        raise UserError(
            f"{type(runtime).__name__} keeps no journal to store {what} beside; use "
            "InMemoryRuntime, SqliteRuntime or PostgresRuntime, or build the store explicitly"
        )
    attribute = f"_loomflow_{what.replace(' ', '_')}_store"
    store: T | None = getattr(key, attribute, None)
    if store is None:
        if isinstance(database, Database):
            store = sql_store(
                database, auto_migrate=getattr(runtime, "_auto_migrate", None), opener=runtime.open
            )
        elif getattr(runtime, "backend", None) == "memory":
            store = memory_store()
        else:
            raise UserError(f"no {what} store is known for {type(runtime).__name__}")
        setattr(key, attribute, store)
    return store
