"""The connection seam: one small interface over aiosqlite and asyncpg."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import gc
import os
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from ..errors import MigrationError, StorageError, StoreUnavailableError, UserError
from ._dialect import Dialect

__all__ = ["Database", "Transaction", "translate_errors", "unbounded"]

Rows = Sequence[Sequence[Any]]

# Set inside unbounded(): statements of a migration or a prune may legitimately run long.
_UNBOUNDED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "loomflow_unbounded", default=False
)


@contextlib.contextmanager
def unbounded() -> Iterator[None]:
    """Statements run inside this block are exempt from the per-statement timeout
    (``LOOMFLOW_POSTGRES_TIMEOUT_SECONDS``): schema migrations and bulk deletes over big
    tables may rightly take longer than any statement of a run."""
    token = _UNBOUNDED.set(True)
    try:
        yield
    finally:
        _UNBOUNDED.reset(token)


def is_unbounded() -> bool:
    """Whether the current statement runs inside :func:`unbounded`."""
    return _UNBOUNDED.get()


# Connections a forked child inherited from its parent: held here so that they are never
# garbage-collected (finalising one would close the parent's socket or SQLite handle).
_INHERITED: list[object] = []


@contextlib.contextmanager
def translate_errors(
    driver_errors: tuple[type[BaseException], ...],
    what: str,
    explain: Callable[[BaseException, str], StorageError | None] | None = None,
) -> Iterator[None]:
    """The one place where driver exceptions become loomflow errors (chained with ``from``).

    ``explain``, if given, may turn a driver error into a more telling one (``None``: no).
    """
    try:
        yield
    except driver_errors as exc:
        raise store_error(exc, what, explain) from exc


def store_error(
    exc: BaseException,
    what: str,
    explain: Callable[[BaseException, str], StorageError | None] | None = None,
) -> StorageError:
    """The loomflow error for the driver error ``exc`` (raise it ``from exc``)."""
    error = explain(exc, what) if explain is not None else None
    if error is None:
        error = StoreUnavailableError(f"{what} failed: {type(exc).__name__}: {exc}")
    return error


def schema_changed(exc: BaseException, what: str) -> MigrationError:
    """The error for a statement that names a table or column the database no longer has.

    The version table said the schema was current, so it was changed behind loomflow's back
    (dropped by hand, restored in part): no retry brings it back, unlike an outage.
    """
    return MigrationError(
        f"{what} failed: {type(exc).__name__}: {exc}: the database was changed outside "
        "loomflow (a table or column dropped by hand, or restored in part); `loomflow "
        "migrate` names what is missing; restore it from a backup"
    )


class Transaction(abc.ABC):
    """Statements inside one database transaction (already in the dialect's SQL)."""

    @abc.abstractmethod
    async def execute(self, sql: str, *args: Any) -> None: ...

    @abc.abstractmethod
    async def fetch(self, sql: str, *args: Any) -> Rows: ...


class Database(abc.ABC):
    """A SQLite connection or a PostgreSQL pool, opened lazily and shareable by stores.

    ``fetch`` runs one statement in its own transaction (committed when it returns; use
    ``RETURNING`` to learn what a write did). ``transaction()`` groups statements.
    ``locked_transaction(key)`` also serialises the block across processes (PostgreSQL
    advisory transaction lock; SQLite's write lock), for migrations and counters.
    """

    dialect: Dialect
    driver_errors: tuple[type[BaseException], ...]

    def __init__(self) -> None:
        self._users = 0
        self._pid = os.getpid()  # the process whose connection this is
        # The event loop the connection belongs to, for a backend whose connections are bound
        # to one (an asyncpg pool); None for one that serves any loop (SQLite's thread).
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def backend(self) -> str:
        """``"sqlite"`` or ``"postgres"``: a bounded label for metrics."""
        return self.dialect.name

    @abc.abstractmethod
    async def _connect(self) -> None: ...

    @abc.abstractmethod
    async def _disconnect(self) -> None: ...

    @property
    @abc.abstractmethod
    def is_open(self) -> bool: ...

    async def open(self) -> None:
        """Connect (idempotent). In a process forked after connecting, connect anew."""
        if self._pid != os.getpid():
            self._after_fork()
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            self._after_loop_change()
        if not self.is_open:
            with translate_errors(self.driver_errors, f"{self.backend} connect", self._explain):
                await self._connect()

    async def close(self) -> None:
        """Close the connection or pool this object created (an adopted pool stays open)."""
        if self._pid != os.getpid():
            self._after_fork()  # the parent's connection is the parent's to close
        if self._loop is not None and self._loop is not asyncio.get_running_loop():
            self._after_loop_change()  # nothing of the old loop's can be closed from this one
        if self.is_open:
            await self._disconnect()

    def _after_fork(self) -> None:
        """Drop what the parent process connected; it must be neither used nor closed here.

        A forked child shares the parent's sockets and file descriptors but not its threads or
        event loop: talking on them would garble the parent's conversation with the database,
        and closing them would end it. The objects are kept referenced (never finalised) and
        the child opens connections of its own on next use.
        """
        inherited = self._forget_connection()
        self._pid = os.getpid()
        if inherited is not None:
            _INHERITED.append(inherited)

    def _after_loop_change(self) -> None:
        """Drop a connection made on an event loop that no longer runs, so a new one is made
        on the running loop.

        A script that calls ``asyncio.run()`` once per task with one runtime made at import
        meets this on its second task: the pool of the first loop cannot be used (its loop is
        closed) nor closed from here. Its connections end when their transports are collected.

        Raises:
            UserError: the old loop still runs (in another thread): the connection is in use
                there, and a runtime or store serves one event loop at a time.
        """
        old = self._loop
        if old is not None and old.is_running():
            raise UserError(
                f"this {self.backend} runtime or store is connected on an event loop that is "
                "running in another thread; it serves one event loop at a time: build one "
                "runtime (or store) per thread"
            )
        with warnings.catch_warnings():
            # The pool was never closed (it cannot be now): its connections are ended by
            # collecting them here, which is not worth a ResourceWarning each.
            warnings.simplefilter("ignore", ResourceWarning)
            dropped = self._forget_connection()
            del dropped
            gc.collect()  # asyncpg's connections sit in reference cycles
        self._loop = None

    def _explain(self, exc: BaseException, what: str) -> StorageError | None:
        """A backend's more telling error for ``exc``, or ``None`` for the generic one."""
        return None

    @abc.abstractmethod
    def _forget_connection(self) -> object | None:
        """Detach the connection (or pool) without closing it, and return it."""

    # fetch and count run on every journal write and read: they translate driver errors
    # inline rather than through translate_errors (a generator per statement).

    async def fetch(self, sql: str, *args: Any, what: str = "query") -> Rows:
        """Run one statement (``$n`` placeholders, ``{now}``/``{lock}`` hooks) and fetch rows."""
        if not self.is_open or self._pid != os.getpid() or self._other_loop():
            await self.open()
        try:
            return await self._fetch(self.dialect.sql(sql), *args)
        except self.driver_errors as exc:
            raise store_error(exc, f"{self.backend} {what}", self._explain) from exc

    def _other_loop(self) -> bool:
        """Whether the connection belongs to another event loop than the running one."""
        return self._loop is not None and self._loop is not asyncio.get_running_loop()

    async def execute(self, sql: str, *args: Any, what: str = "statement") -> None:
        await self.fetch(sql, *args, what=what)

    async def count(self, sql: str, *args: Any, what: str = "statement") -> int:
        """Run one writing statement (committed on return) and return how many rows it
        changed: a conditional write learns whether it happened without ``RETURNING``,
        which costs SQLite a quarter more than the write itself."""
        if not self.is_open or self._pid != os.getpid() or self._other_loop():
            await self.open()
        try:
            return await self._count(self.dialect.sql(sql), *args)
        except self.driver_errors as exc:
            raise store_error(exc, f"{self.backend} {what}", self._explain) from exc

    async def insert_new(self, sql: str, *args: Any, what: str = "statement") -> int | None:
        """Run one ``INSERT`` (committed on return) and return how many rows it added, or
        ``None`` when a row with the same unique key is already there (nothing is added).

        For a write that almost never meets its own key: an ``ON CONFLICT`` clause costs
        PostgreSQL a speculative insertion on every call, this only the rare retry.
        """
        try:
            return await self.count(sql, *args, what=what)
        except StoreUnavailableError as error:
            if self.is_duplicate_key(error):
                return None
            raise

    def is_duplicate_key(self, error: StoreUnavailableError) -> bool:
        """Whether ``error``, raised by a write of this database, says a unique key was
        already taken (a caller's mistake, not an outage to retry)."""
        return error.__cause__ is not None and self._is_duplicate_key(error.__cause__)

    @abc.abstractmethod
    def _is_duplicate_key(self, exc: BaseException) -> bool:
        """Whether the driver error ``exc`` says a unique key was already taken."""

    @abc.abstractmethod
    async def _fetch(self, sql: str, *args: Any) -> Rows:
        """Run SQL already in the dialect's form; committed on return."""

    @abc.abstractmethod
    async def _count(self, sql: str, *args: Any) -> int:
        """Run SQL already in the dialect's form; committed on return; rows changed."""

    @contextlib.asynccontextmanager
    async def transaction(
        self, *, lock_key: int | None = None, what: str = "transaction"
    ) -> AsyncIterator[Transaction]:
        """A transaction; with ``lock_key``, serialised with every other holder of that key."""
        await self.open()
        with translate_errors(self.driver_errors, f"{self.backend} {what}", self._explain):
            async with self._transaction(lock_key) as tx:
                yield _Translated(tx, self.dialect)

    @abc.abstractmethod
    def _transaction(
        self, lock_key: int | None
    ) -> contextlib.AbstractAsyncContextManager[Transaction]: ...


class _Translated(Transaction):
    """Applies the dialect to statements run inside a transaction."""

    def __init__(self, tx: Transaction, dialect: Dialect) -> None:
        self._tx = tx
        self._dialect = dialect

    async def execute(self, sql: str, *args: Any) -> None:
        await self._tx.execute(self._dialect.sql(sql), *args)

    async def fetch(self, sql: str, *args: Any) -> Rows:
        return await self._tx.fetch(self._dialect.sql(sql), *args)
