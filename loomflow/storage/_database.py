"""The connection seam: one small interface over aiosqlite and asyncpg."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ..errors import StoreUnavailableError
from ._dialect import Dialect

__all__ = ["Database", "Transaction", "translate_errors"]

Rows = Sequence[Sequence[Any]]


@contextlib.contextmanager
def translate_errors(driver_errors: tuple[type[BaseException], ...], what: str) -> Iterator[None]:
    """The one place where driver exceptions become loomflow errors (chained with ``from``)."""
    try:
        yield
    except driver_errors as exc:
        raise StoreUnavailableError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


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
        """Connect (idempotent)."""
        if not self.is_open:
            with translate_errors(self.driver_errors, f"{self.backend} connect"):
                await self._connect()

    async def close(self) -> None:
        """Close the connection or pool this object created (an adopted pool stays open)."""
        if self.is_open:
            await self._disconnect()

    async def fetch(self, sql: str, *args: Any, what: str = "query") -> Rows:
        """Run one statement (``$n`` placeholders, ``{now}``/``{lock}`` hooks) and fetch rows."""
        await self.open()
        with translate_errors(self.driver_errors, f"{self.backend} {what}"):
            return await self._fetch(self.dialect.sql(sql), *args)

    async def execute(self, sql: str, *args: Any, what: str = "statement") -> None:
        await self.fetch(sql, *args, what=what)

    @abc.abstractmethod
    async def _fetch(self, sql: str, *args: Any) -> Rows:
        """Run SQL already in the dialect's form; committed on return."""

    @contextlib.asynccontextmanager
    async def transaction(
        self, *, lock_key: int | None = None, what: str = "transaction"
    ) -> AsyncIterator[Transaction]:
        """A transaction; with ``lock_key``, serialised with every other holder of that key."""
        await self.open()
        with translate_errors(self.driver_errors, f"{self.backend} {what}"):
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
