"""PostgreSQL through an asyncpg pool (created from a DSN, or adopted)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..config import Settings, _masked_url
from ..errors import ConfigurationError, StorageError, StoreUnavailableError, UserError
from ._database import Database, Rows, Transaction, is_unbounded, schema_changed
from ._dialect import POSTGRES

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresDatabase"]

log = logging.getLogger("loomflow.storage")

_LANE_RETRY_S = 1.0  # after the lane broke or could not connect, the pool serves meanwhile
_LANE_CONNECT_TIMEOUT_S = 10.0
_CLOSE_TIMEOUT_S = 10.0  # how long close() waits for connections in use
# The bound of a statement inside unbounded() (asyncpg takes no "never" once the pool has a
# default): a week is beyond any migration this side of a restore.
_UNBOUNDED_S = 7 * 86400.0
IDLE_IN_TRANSACTION_TIMEOUT_S = 60.0
"""How long the server lets one of our transactions wait for its next statement.

A process frozen inside a transaction (SIGSTOP, a paused VM or container, a stall of the whole
host) keeps that transaction's locks: a user's audit chain (an advisory lock), budget buckets,
a checkpoint row. Every other process that needs them waits, the workers that would take the
frozen process's runs over included, for as long as the freeze lasts. Our transactions send
their statements back to back (milliseconds apart), so a transaction idle this long belongs to
a process that stopped: the server ends its session, which frees the locks; the frozen process
finds its connection closed when it wakes.
"""


# What a server's refusal means for a deployment, and the fix, by SQLSTATE.
_SERVER_REFUSALS = {
    "25006": (  # read_only_sql_transaction
        "this server takes no writes: it is a read-only standby (a replica, or a primary "
        "demoted by a failover) or default_transaction_read_only is on for the database or "
        "role; point the DSN at the primary (with several hosts in the DSN, "
        "target_session_attrs=read-write picks the one that takes writes)"
    ),
    "57014": (  # query_canceled: asyncpg's own timeout raises TimeoutError, not this
        "the server cancelled the statement: its statement_timeout (set on the role or "
        "database: SHOW statement_timeout) or an operator's pg_cancel_backend; keep the "
        "server's limit above LOOMFLOW_POSTGRES_TIMEOUT_SECONDS and above the longest "
        "migration or prune, or lift it for the role that migrates (ALTER ROLE ... SET "
        "statement_timeout = 0); a statement waiting on a lock another session holds is "
        "cancelled this way too (see pg_locks)"
    ),
    "55P03": (  # lock_not_available: loomflow itself never asks for NOWAIT
        "another session held a lock this statement waited for past the server's "
        "lock_timeout (set on the role or database: SHOW lock_timeout); find the holder in "
        "pg_locks and pg_stat_activity"
    ),
    "3D000": (  # invalid_catalog_name
        "create the database (CREATE DATABASE, or createdb) or correct its name in the DSN"
    ),
    "53300": (  # too_many_connections
        "the server has no connection left for this role or database (max_connections, or a "
        "CONNECTION LIMIT on the role or database); each loomflow process holds up to its "
        "pool size plus one connection: end idle sessions (pg_stat_activity), raise the "
        "limit, or put a pooler such as PgBouncer in front"
    ),
    "57P03": (  # cannot_connect_now
        "the server is starting up, shutting down or recovering: try again once it accepts "
        "connections"
    ),
    "57P01": (  # admin_shutdown: pg_terminate_backend, a fast shutdown
        "the server ended this session (pg_terminate_backend, a restart or a failover); "
        "nothing committed is lost, the next statement connects anew, and an interrupted run "
        "resumes from its journal"
    ),
}


def _asyncpg() -> Any:
    try:
        import asyncpg
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "PostgreSQL support needs asyncpg: pip install 'loomflow[postgres]'"
        ) from exc
    return asyncpg


async def _no_reset(conn: asyncpg.Connection) -> None:
    return None


class _Tx(Transaction):
    def __init__(self, conn: asyncpg.Connection, timeout: float | None) -> None:
        self._conn = conn
        self._timeout = timeout

    async def execute(self, sql: str, *args: Any) -> None:
        await self._conn.execute(sql, *args, timeout=self._timeout)

    async def fetch(self, sql: str, *args: Any) -> Rows:
        return list(await self._conn.fetch(sql, *args, timeout=self._timeout))


class PostgresDatabase(Database):
    """An asyncpg pool. From a DSN the pool is ours (and closed by :meth:`close`); an adopted
    pool stays the caller's.

    A pool made from a DSN sets ``idle_in_transaction_session_timeout`` on its connections
    (``idle_in_transaction_timeout``, :data:`IDLE_IN_TRANSACTION_TIMEOUT_S` by default;
    ``None`` leaves the server's), so that a process frozen inside a transaction holds its
    locks for that long at most. An adopted pool's connections are its owner's to configure.
    """

    dialect = POSTGRES

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool,
        *,
        min_size: int = 1,
        max_size: int = 10,
        timeout_s: float | None = None,
        idle_in_transaction_timeout: float | None = IDLE_IN_TRANSACTION_TIMEOUT_S,
    ) -> None:
        """``timeout_s`` bounds every statement (and taking a pooled connection): past it the
        statement fails with :class:`StoreUnavailableError`, so a server that stopped
        answering (paused, or cut off without a reset) fails a run rather than hanging it.
        ``None`` reads ``LOOMFLOW_POSTGRES_TIMEOUT_SECONDS``; ``0`` waits forever.
        ``idle_in_transaction_timeout`` is the server's side of a freeze: see
        :data:`IDLE_IN_TRANSACTION_TIMEOUT_S` (``None`` leaves the server's setting)."""
        super().__init__()
        if timeout_s is None:
            timeout_s = Settings().postgres_timeout_seconds
        if not (isinstance(timeout_s, int | float) and 0 <= timeout_s < float("inf")):
            raise ConfigurationError(
                f"the PostgreSQL statement timeout must be a finite number of seconds >= 0 "
                f"(0: no limit), not {timeout_s!r}"
            )
        self.timeout_s: float | None = float(timeout_s) or None
        if idle_in_transaction_timeout is not None and not idle_in_transaction_timeout >= 0.001:
            raise ConfigurationError(
                "idle_in_transaction_timeout must be at least 0.001 s (or None to leave the "
                f"server's setting), not {idle_in_transaction_timeout!r}"
            )
        self._idle_timeout_ms = (
            None if idle_in_transaction_timeout is None else int(idle_in_transaction_timeout * 1000)
        )
        driver = _asyncpg()
        # InternalClientError: a connection whose server ended it (its last message read, the
        # close not yet) is in a state asyncpg cannot use; it is an outage like the others.
        self.driver_errors = (
            driver.PostgresError,
            driver.InterfaceError,
            driver.InternalClientError,
            OSError,
        )
        self._confused: type[BaseException] = driver.InternalClientError
        self._rollback_error: type[BaseException] = driver.InterfaceError
        self._server_errors: tuple[type[BaseException], ...] = (driver.PostgresError,)
        self._duplicate_key: type[BaseException] = driver.UniqueViolationError
        self._dsn = dsn_or_pool if isinstance(dsn_or_pool, str) else None
        self._pool: asyncpg.Pool | None = None if isinstance(dsn_or_pool, str) else dsn_or_pool
        self._owns_pool = isinstance(dsn_or_pool, str)
        self._min_size = min_size
        self._max_size = max_size
        # The lane: one connection of our own, outside the pool, for single statements. Taking
        # a pooled connection costs a statement tens of microseconds (about a tenth of a
        # loopback INSERT); the lane serves the statement whenever no other statement is on it,
        # and the pool serves the rest (concurrent statements, transactions). Only a pool we
        # created gets one: an adopted pool's size is its owner's to decide.
        self._lane: asyncpg.Connection | None = None
        self._lane_busy = False
        self._lane_task: asyncio.Task[None] | None = None
        self._lane_retry_at = 0.0

    def __repr__(self) -> str:
        return f"PostgresDatabase(<{'dsn' if self._owns_pool else 'pool'}>)"

    @property
    def is_open(self) -> bool:
        return self._pool is not None

    @property
    def shown_dsn(self) -> str | None:
        """The DSN this database was made from, its password masked (for messages); ``None``
        for an adopted pool."""
        return None if self._dsn is None else _masked_url(self._dsn)

    @property
    def pool(self) -> asyncpg.Pool:
        """The asyncpg pool (after :meth:`open`)."""
        if self._pool is None:
            raise RuntimeError("the PostgreSQL database is not connected")
        return self._pool

    async def _connect(self) -> None:
        # Our statements are single autocommitted ones that leave no session state, so the
        # pool's reset query (RESET ALL; UNLISTEN *; ...) on every release would be a wasted
        # round trip: measured 454 us -> 350 us per pooled INSERT on loopback.
        try:
            self._pool = await _asyncpg().create_pool(
                self._dsn,
                min_size=self._min_size,
                max_size=self._max_size,
                reset=_no_reset,
                # The default of statements we do not time ourselves (BEGIN, COMMIT).
                command_timeout=self.timeout_s,
                # Connecting is bounded by the same limit: a host that accepts the connection
                # and never answers would otherwise hold the open for asyncpg's own 60 s,
                # while the error said it had waited the (shorter) setting.
                **({} if self.timeout_s is None else {"timeout": self.timeout_s}),
                init=self._init_connection,
            )
        except ValueError as exc:  # asyncpg's DSN parser: a malformed port, option, ...
            raise ConfigurationError(f"bad PostgreSQL DSN: {exc}") from None
        self._loop = asyncio.get_running_loop()  # the pool and its connections belong to it

    async def _init_connection(self, conn: asyncpg.Connection) -> None:
        """Each new pooled connection (they run our transactions): see
        :data:`IDLE_IN_TRANSACTION_TIMEOUT_S`. A SET after connecting rather than a startup
        parameter, which connection poolers such as PgBouncer refuse."""
        if self._idle_timeout_ms is not None:
            await conn.execute(f"SET idle_in_transaction_session_timeout = {self._idle_timeout_ms}")

    def _forget_connection(self) -> object | None:
        if not self._owns_pool and self._pool is not None:
            raise UserError(
                "this asyncpg pool was created before the process forked and cannot be used "
                "in the child; give the runtime or store a DSN (it then connects anew in each "
                "process) or create the pool after the fork"
            )
        inherited = (self._pool, self._lane, self._lane_task)
        self._pool, self._lane, self._lane_task, self._lane_busy = None, None, None, False
        self._loop = None
        return inherited if any(part is not None for part in inherited) else None

    async def _disconnect(self) -> None:
        task, self._lane_task = self._lane_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        lane, self._lane = self._lane, None
        if lane is not None:
            with contextlib.suppress(Exception):
                await lane.close(timeout=5)
        if self._owns_pool and self._pool is not None:
            pool, self._pool, self._loop = self._pool, None, None
            # close() waits for every connection in use to come back: a statement waiting on a
            # server that stopped answering never does, and neither would the close.
            try:
                await asyncio.wait_for(pool.close(), _CLOSE_TIMEOUT_S)
            except TimeoutError:
                pool.terminate()
                log.warning(
                    "the PostgreSQL pool did not close within %gs (a statement still waits on "
                    "the server); its connections were dropped",
                    _CLOSE_TIMEOUT_S,
                )

    def _is_duplicate_key(self, exc: BaseException) -> bool:
        return isinstance(exc, self._duplicate_key)

    def _explain(self, exc: BaseException, what: str) -> StorageError | None:
        if getattr(exc, "sqlstate", None) in ("42703", "42P01"):  # undefined column, table
            return schema_changed(exc, what)
        if isinstance(exc, TimeoutError) and self.timeout_s is not None:
            return StoreUnavailableError(
                f"{what} failed: PostgreSQL did not answer within {self.timeout_s:g}s "
                "(LOOMFLOW_POSTGRES_TIMEOUT_SECONDS): the server may be paused, overloaded "
                "or cut off, or another session holds a lock on loomflow's tables (see "
                "pg_locks and pg_stat_activity)"
            )
        if (option := _unknown_dsn_option(exc, self._dsn)) is not None:
            # asyncpg sends a query option it does not read itself to the server as a
            # setting, so a libpq-only one fails as an unknown parameter, naming no URL.
            hint = ""
            if option == "connect_timeout":
                hint = "; connecting is bounded by LOOMFLOW_POSTGRES_TIMEOUT_SECONDS instead"
            return StoreUnavailableError(
                f"{what} failed: the server knows no setting {option!r}, which the URL's "
                f"?{option}= option asked for (options other than the SSL and connection ones "
                f"are sent to the server as settings): remove it from the URL{hint}"
            )
        inner = exc.__context__
        if (
            isinstance(exc, self._rollback_error)
            and "__aexit__" in str(exc)
            and isinstance(inner, self.driver_errors)
        ):
            # asyncpg's rollback of a transaction whose connection closed under it ("cannot
            # call Transaction.__aexit__()"), hiding the statement's error, which may only
            # say "connection has been released back to the pool": say what happened.
            return StoreUnavailableError(
                f"{what} failed: the connection closed during the transaction (the server "
                "ended the session: pg_terminate_backend, a restart or a failover; or the "
                "network dropped it); the server rolled the transaction back, so nothing of "
                "it was committed, and the next statement connects anew "
                f"({type(inner).__name__}: {inner})"
            )
        why = _SERVER_REFUSALS.get(getattr(exc, "sqlstate", None) or "")
        if isinstance(exc, self._confused):
            why = "the driver lost track of the connection, as when " + _SERVER_REFUSALS["57P01"]
        if why is not None:
            # The server's words name the symptom ("cannot execute INSERT in a read-only
            # transaction"); an operator needs the cause, and which setting to change.
            return StoreUnavailableError(f"{what} failed: {type(exc).__name__}: {exc}: {why}")
        if isinstance(exc, socket.gaierror) and self._dsn is not None:
            # The resolver's own words ("Name or service not known") name no host at all.
            return StoreUnavailableError(
                f"{what} failed: the host of {_masked_url(self._dsn)!r} cannot be resolved "
                f"({exc.strerror or exc}): check the host name, or DNS on this machine"
            )
        if self._dsn is not None and (missing := _missing_dsn_file(exc, self._dsn)):
            return StoreUnavailableError(
                f"{what} failed: the URL's ?{missing[0]}= option names {missing[1]!r}, which "
                "does not exist: correct the path, or remove the option"
            )
        refused = isinstance(exc, ConnectionRefusedError)
        if self._dsn is not None and (refused or _no_socket_file(exc)):
            # A stopped server, or a wrong port or socket directory: the OS's words name an
            # address or no file at all, and never the URL to correct.
            return StoreUnavailableError(
                f"{what} failed: no PostgreSQL server accepts connections at "
                f"{_masked_url(self._dsn)!r} ({type(exc).__name__}: {exc}): is the server "
                "running, and listening on the host and port (or the socket directory) the "
                "URL names?"
            )
        return None

    def _statement_timeout(self) -> float | None:
        return _UNBOUNDED_S if self.timeout_s is not None and is_unbounded() else self.timeout_s

    async def _fetch(self, sql: str, *args: Any) -> Rows:
        return await self._single("fetch", sql, args)  # type: ignore[no-any-return]

    async def _count(self, sql: str, *args: Any) -> int:
        status: str = await self._single("execute", sql, args)  # e.g. "INSERT 0 1", "UPDATE 2"
        return int(status.rsplit(" ", 1)[-1])

    async def _single(self, method: str, sql: str, args: tuple[Any, ...]) -> Any:
        """One statement through ``method`` (``fetch`` or ``execute``, which a connection and
        the pool both have): on the lane if it is free, else on the pool.

        A connection the server ended while it was idle (idle_session_timeout, a restart,
        pg_terminate_backend), whose FATAL message asyncpg has read but not yet the close,
        refuses the statement before sending anything ("cannot switch to state"): the
        statement is sent again on another connection. Each such connection is dropped as it
        refuses, so the pool and the lane run out of them within that many tries.
        """
        for _ in range(self._max_size + 1):
            try:
                return await self._single_once(method, sql, args)
            except self._confused as exc:
                if "cannot switch to state" not in str(exc):
                    raise
                refused = exc
        raise refused

    async def _single_once(self, method: str, sql: str, args: tuple[Any, ...]) -> Any:
        timeout = self._statement_timeout()
        lane = self._take_lane()
        if lane is None:
            # Taking a connection is bounded too: when the server hangs, the pool's own are
            # stuck or reconnecting, and the wait for one would be as long as the hang.
            async with self.pool.acquire(timeout=timeout) as conn:
                return await getattr(conn, method)(sql, *args, timeout=timeout)
        try:
            return await getattr(lane, method)(sql, *args, timeout=timeout)
        except BaseException as exc:
            self._after_lane_error(lane, exc)
            raise
        finally:
            self._free_lane(lane)

    # -- the lane ----------------------------------------------------------------------------

    def _take_lane(self) -> asyncpg.Connection | None:
        """The lane, marked busy, if it is connected and free; else ``None`` (use the pool)."""
        lane = self._lane
        if lane is not None and lane.is_closed():  # the server or the network ended it
            self._drop_lane(lane)
            lane = None
        if lane is None:
            self._start_lane()
            return None
        if self._lane_busy:
            return None
        self._lane_busy = True
        return lane

    def _after_lane_error(self, lane: asyncpg.Connection, exc: BaseException) -> None:
        # An error the server answered with leaves the connection usable. Anything else (the
        # connection broke, or the caller was cancelled mid-statement, which leaves asyncpg
        # waiting on the server) makes the lane unfit: the pool serves until a new one is up.
        if isinstance(exc, self._server_errors) and not lane.is_closed():
            return
        self._drop_lane(lane)

    def _free_lane(self, lane: asyncpg.Connection) -> None:
        if self._lane is lane:  # a lane dropped meanwhile is not its successor's to free
            self._lane_busy = False

    def _drop_lane(self, lane: asyncpg.Connection) -> None:
        if self._lane is lane:
            self._lane, self._lane_busy = None, False
            self._lane_retry_at = time.monotonic() + _LANE_RETRY_S
        lane.terminate()

    def _start_lane(self) -> None:
        """Connect the lane in the background (statements meanwhile use the pool)."""
        if (
            not self._owns_pool
            or self._pool is None
            or self._lane_task is not None
            or time.monotonic() < self._lane_retry_at
        ):
            return
        self._lane_task = asyncio.get_running_loop().create_task(
            self._connect_lane(), name="loomflow-pg-lane"
        )

    async def _connect_lane(self) -> None:
        try:
            lane = await _asyncpg().connect(
                self._dsn, timeout=_LANE_CONNECT_TIMEOUT_S, command_timeout=self.timeout_s
            )
        except Exception as exc:  # the pool keeps serving; a later statement tries again
            log.debug("PostgreSQL lane connection failed: %r", exc)
            self._lane_retry_at = time.monotonic() + _LANE_RETRY_S
            return
        finally:
            self._lane_task = None
        if self._pool is None or self._lane is not None:  # closed (or forked) meanwhile
            lane.terminate()
            return
        self._lane = lane

    @contextlib.asynccontextmanager
    async def _transaction(self, lock_key: int | None) -> AsyncIterator[Transaction]:
        timeout = self._statement_timeout()
        async with self.pool.acquire(timeout=timeout) as conn, conn.transaction():
            if lock_key is not None:
                # Transaction-scoped, so the pool cannot hand the lock to another caller.
                await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key, timeout=timeout)
            yield _Tx(conn, timeout)


def _no_socket_file(exc: BaseException) -> bool:
    """A Unix-socket connect that found no socket. asyncpg's FileNotFoundError names no file
    either way, so the connect is told apart by where it was raised: a missing
    ``sslrootcert`` fails the same way while the DSN is read, before any connect."""
    if not isinstance(exc, FileNotFoundError):
        return False
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "create_unix_connection":
            return True
        tb = tb.tb_next
    return False


def _missing_dsn_file(exc: BaseException, dsn: str) -> tuple[str, str] | None:
    """The file option of ``dsn`` (``sslrootcert=``, ...) naming a file that is not there, if
    that is why ``exc``, a FileNotFoundError that names no file, was raised."""
    if not isinstance(exc, FileNotFoundError) or exc.filename is not None:
        return None
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query)
    for option in ("sslrootcert", "sslcert", "sslkey", "sslcrl"):
        for path in query.get(option, []):
            if not os.path.exists(os.path.expanduser(path)):
                return option, path
    return None


def _unknown_dsn_option(exc: BaseException, dsn: str | None) -> str | None:
    """The query option of ``dsn`` that the server refused as an unknown setting, if that is
    what ``exc`` is (SQLSTATE 42704 naming a parameter the DSN's query holds)."""
    if dsn is None or getattr(exc, "sqlstate", None) != "42704":
        return None
    found = re.search(r'unrecognized configuration parameter "([^"]+)"', str(exc))
    if found is None:
        return None
    query = urllib.parse.urlsplit(dsn).query
    return found[1] if found[1] in urllib.parse.parse_qs(query) else None
