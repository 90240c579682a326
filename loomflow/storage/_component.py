"""The lifecycle every SQL store shares: open (maybe through its owner), migrate once, close."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

from ..config import Settings
from ._database import Database
from ._migrations import Migration, apply_migrations

__all__ = ["ComponentStore"]


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
