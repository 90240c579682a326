"""The lifecycle every SQL store shares: open lazily (maybe through its owner), migrate once
(or check the schema and say to run ``loomflow migrate``), use, close.

The journal, checkpoints, memory, budget and audit stores all hold one :class:`SqlLifecycle`
rather than each keeping its own copy of the open/migrate/close dance.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

from ..config import Settings
from ._database import Database
from ._migrations import Migration, apply_migrations, check_schema, require_schema

__all__ = ["ComponentStore", "SqlLifecycle", "store_beside"]

T = TypeVar("T")


class SqlLifecycle:
    """One SQL store's connection and schema: lazy open -> migrate or check -> use -> close.

    Args:
        db: The database the store's tables live in.
        component: The name its migrations are recorded under.
        migrations: The store's append-only migration list.
        owns_db: Close ``db`` with the store (and when a first open fails half-way).
        auto_migrate: On first use, migrate; otherwise only check the version, so a store
            nobody migrated says "run `loomflow migrate`" instead of failing on a missing table.
        opener: How to open a shared ``db`` through its owner (e.g. ``runtime.open``), so
            that the owner's ``close()`` also closes it.
        on_open: Run after connecting and before the schema step (the journal reports a
            0.20 journal there, so the report comes even when the schema check refuses).
        on_ready: Run once the schema step succeeded, on each (re)open by :meth:`ensure_open`.
    """

    def __init__(
        self,
        db: Database,
        component: str,
        migrations: Sequence[Migration],
        *,
        owns_db: bool,
        auto_migrate: bool,
        opener: Callable[[], Awaitable[object]] | None = None,
        on_open: Callable[[Database], Awaitable[object]] | None = None,
        on_ready: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.db = db
        self.component = component
        self.migrations = migrations
        self.owns_db = owns_db
        self.auto_migrate = auto_migrate
        self._opener = opener
        self._on_open = on_open
        self._on_ready = on_ready
        self._migrated = False
        self._lock: asyncio.Lock | None = None  # made on first use, inside the running loop

    @property
    def ready(self) -> bool:
        """Whether the store is connected and its schema migrated (or checked)."""
        return self._migrated and self.db.is_open

    async def ensure_open(self) -> None:
        """Connect and migrate (or check) once; cheap when already done."""
        if self.ready:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self.ready:  # another caller may have opened it while this one waited
                await self.open_now(migrate=self.auto_migrate)
                if self._on_ready is not None:
                    await self._on_ready()

    async def open_now(self, *, migrate: bool) -> None:
        """Connect, then migrate (``migrate``) or check the schema version."""
        if not self.db.is_open:
            # A shared connection is opened by its owner (the runtime), which then also
            # closes it; opening it behind the owner's back would leak it past its close().
            await (self._opener() if self._opener is not None else self.db.open())
        try:
            if self._on_open is not None:
                await self._on_open(self.db)
            if not self._migrated:
                if migrate:
                    await apply_migrations(self.db, self.component, self.migrations)
                else:
                    await require_schema(self.db, self.component, self.migrations)
                self._migrated = True
        except BaseException:
            if self.owns_db:
                await self.db.close()  # a half-opened store must not leak its connection
            raise

    async def migrate(self) -> int:
        """Apply pending migrations; returns the schema version now in place."""
        await self.db.open()
        version = await apply_migrations(self.db, self.component, self.migrations)
        # A deploy step, so it looks further than the version rows a first use reads: a table
        # dropped by hand must be reported here, not by every run as a failed statement.
        await check_schema(self.db, self.component, self.migrations)
        self._migrated = True
        return version

    async def close(self) -> None:
        """Close the database if the store owns it; the next use opens and checks again."""
        self._migrated = False
        if self.owns_db:
            await self.db.close()


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
        self.auto_migrate = (
            (settings or Settings()).auto_migrate if auto_migrate is None else auto_migrate
        )
        self._life = SqlLifecycle(
            db,
            self.component,
            self.migrations,
            owns_db=owns_db,
            auto_migrate=self.auto_migrate,
            opener=opener,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.db!r})"

    async def open(self) -> None:
        await self._life.ensure_open()

    async def close(self) -> None:
        await self._life.close()

    async def migrate(self) -> int:
        return await self._life.migrate()

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
