"""SQLite through aiosqlite: one connection, WAL, synchronous=FULL, busy_timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import sqlite3
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiosqlite

from .._files import create_private
from ..config import MAX_BUSY_TIMEOUT_MS, Settings, sqlite_path
from ..errors import (
    ConfigurationError,
    InvalidArgumentError,
    StorageError,
    StoreLockedError,
    StoreUnavailableError,
)
from ._database import Database, Rows, Transaction, schema_changed
from ._dialect import SQLITE

__all__ = ["SqliteDatabase"]

log = logging.getLogger("loomflow.storage")

# Byte ranges SQLite locks to write (see its os_unix.c): in WAL mode the write, checkpoint and
# recovery locks are bytes 120-122 of the -shm file; in rollback mode the pending and reserved
# bytes of the database file itself.
_SHM_WRITE_BYTES = (120, 122)
_DB_WRITE_BYTES = (0x40000000, 0x40000001)


def _write_lock_holder(path: Path) -> int | None:
    """The pid holding ``path``'s SQLite write lock, read from /proc/locks (Linux only)."""
    path = path.resolve()  # SQLite keeps the -shm beside a symlink's target
    wanted: dict[int, tuple[int, int]] = {}
    for file, byte_range in ((Path(f"{path}-shm"), _SHM_WRITE_BYTES), (path, _DB_WRITE_BYTES)):
        try:
            wanted[os.stat(file).st_ino] = byte_range
        except OSError:
            continue
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    for line in lines:
        # "1: POSIX  ADVISORY  WRITE 4242 08:01:1311 120 120"; "->" marks a waiter, not a holder
        fields = line.split()
        if len(fields) < 8 or fields[1] == "->" or fields[3] != "WRITE":
            continue
        try:
            pid, inode = int(fields[4]), int(fields[5].rsplit(":", 1)[1])
            start = int(fields[6])
            end = int(fields[7]) if fields[7] != "EOF" else 2**63
        except (ValueError, IndexError):
            continue
        span = wanted.get(inode)
        if span is not None and start <= span[1] and end >= span[0] and pid > 0:
            return pid
    return None


# Below this much free space a write error is taken for a full filesystem: SQLite needs room
# for whole pages, WAL frames and a 32 KiB -shm file, so a few KiB left is as good as none.
_LOW_SPACE = 1 << 20

_READ_ONLY_MOUNT = (
    "its filesystem is mounted read-only (the kernel does that after an I/O error: see "
    "dmesg); remount it read-write, or put the file on a writable volume"
)


_NOTHING_LOST = (
    "nothing committed is lost (a write that fails is rolled back), and a run that stopped "
    "resumes from its journal once there is room"
)


def _statvfs(path: Path) -> os.statvfs_result | None:
    """statvfs of the nearest directory of ``path`` that exists (the file may not yet)."""
    for where in (path, *path.absolute().parents):
        try:
            return os.statvfs(where)
        except OSError:
            continue
    return None


def _read_only_mount(path: Path) -> bool:
    st = _statvfs(path)
    return st is not None and bool(st.f_flag & os.ST_RDONLY)


def _free_bytes(path: Path) -> int | None:
    """Free bytes this process may write on the filesystem of ``path`` (root may use the
    blocks kept for it)."""
    st = _statvfs(path)
    if st is None:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def _is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _file_of(path: str) -> str:
    """The file a path given as text names: a ``sqlite:///`` URL is taken for its file (the
    form settings and the command line use), any other URL is refused. Taken as a path,
    ``sqlite:///journal.db`` made a directory named ``sqlite:``."""
    file = sqlite_path(path)  # raises on sqlite:journal.db, which lacks its //
    if file is None:  # another scheme
        raise ConfigurationError(
            f"{path.split('://', 1)[0]}:// URL given where a SQLite file path belongs: pass a "
            "path such as ./journal.db (or build the store from its URL, e.g. "
            "runtime_from_url)"
        )
    return file


def read_text(data: bytes) -> str:
    """A text column as read: UTF-8, with bytes that are not UTF-8 kept as lone surrogates.

    SQLite stores whatever bytes it is handed as text, so a row written by another tool or
    damaged on disk may hold text that is not UTF-8. Decoded strictly, such a row fails every
    query that reads it, and the failure looks like the database being down; read this way,
    it reaches the store's own checks, which report that one row as damaged.
    """
    return data.decode("utf-8", "surrogateescape")


class _Tx(Transaction):
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn

    async def execute(self, sql: str, *args: Any) -> None:
        await self._conn.execute(sql, args)

    async def fetch(self, sql: str, *args: Any) -> Rows:
        return list(await self._conn.execute_fetchall(sql, args))


class SqliteDatabase(Database):
    """One aiosqlite connection to a file (or ``":memory:"``).

    Every statement autocommits (``isolation_level=None``), so a journal write is one trip to
    aiosqlite's thread and one fsync. Explicit transactions take the write lock up front
    (``BEGIN IMMEDIATE``) and keep other coroutines of this process out until they end.
    """

    dialect = SQLITE
    # OverflowError: sqlite3 refuses to bind an int beyond 64 bits (a number from a crafted row)
    driver_errors = (sqlite3.Error, OSError, OverflowError)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        busy_timeout_ms: int = 5000,
        synchronous: str = "FULL",
    ) -> None:
        super().__init__()
        if synchronous.upper() not in ("FULL", "NORMAL", "EXTRA"):
            raise InvalidArgumentError(
                f"synchronous must be FULL, NORMAL or EXTRA, not {synchronous!r}"
            )
        self.path = Path(_file_of(path) if isinstance(path, str) else path)
        if not 0 <= int(busy_timeout_ms) <= MAX_BUSY_TIMEOUT_MS:
            # SQLite would take a larger one as 0: every contended write failing at once.
            raise InvalidArgumentError(
                f"busy_timeout_ms must be from 0 to {MAX_BUSY_TIMEOUT_MS}, not {busy_timeout_ms!r}"
            )
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.synchronous = synchronous.upper()
        self._conn: aiosqlite.Connection | None = None
        self._tx_lock = asyncio.Lock()
        self._open_lock = asyncio.Lock()
        # The (device, inode) of the file the connection opened, None for ":memory:"; and
        # why the connection may not be used any more, once that file left the path.
        self._opened: tuple[int, int] | None = None
        self._moved: str | None = None

    @classmethod
    def from_settings(
        cls,
        path: str | os.PathLike[str],
        settings: Settings | None = None,
        *,
        busy_timeout_ms: int | None = None,
        synchronous: str | None = None,
    ) -> SqliteDatabase:
        """The database at ``path`` with the ``LOOMFLOW_SQLITE_*`` settings, unless overridden.

        Every SQLite store (journal, checkpoints, memory, budget, audit) is built through here,
        so the busy timeout and ``synchronous`` mode are read in one place.
        """
        s = settings or Settings()
        return cls(
            path,
            busy_timeout_ms=s.sqlite_busy_timeout_ms
            if busy_timeout_ms is None
            else busy_timeout_ms,
            synchronous=s.sqlite_synchronous if synchronous is None else synchronous,
        )

    def __repr__(self) -> str:
        return f"SqliteDatabase({str(self.path)!r})"

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    @property
    def conn(self) -> aiosqlite.Connection:
        """The aiosqlite connection (after :meth:`open`)."""
        if self._conn is None:
            raise RuntimeError("the SQLite database is not open")
        return self._conn

    async def _connect(self) -> None:
        async with self._open_lock:
            if self._conn is not None:
                return
            if str(self.path) != ":memory:":
                # Owner-only: SQLite gives the -wal and -shm files the mode of this one.
                create_private(self.path)
            pending = aiosqlite.connect(self.path, isolation_level=None)
            # A program that forgets to close the database must still exit: aiosqlite's
            # worker thread would otherwise keep the interpreter alive forever. Stopping it
            # at exit loses nothing committed (WAL, synchronous=FULL), like a process kill.
            worker = getattr(pending, "_thread", None)
            if worker is not None and not worker.is_alive():
                worker.daemon = True
            try:
                conn = await pending
            except BaseException:
                # aiosqlite stops its worker thread without waiting for it; join it so that
                # the thread does not report to an event loop the caller may close next.
                worker = getattr(pending, "_thread", None)
                if worker is not None:
                    await asyncio.to_thread(worker.join, 5)
                raise
            try:
                conn.text_factory = read_text
                await conn.execute(f"PRAGMA busy_timeout = {self.busy_timeout_ms}")
                await self._enable_wal(conn)
                await conn.execute(f"PRAGMA synchronous = {self.synchronous}")
                # Deleted rows and erased payloads are overwritten with zeros, not left in
                # free pages for anyone with the file to read back after `users forget`
                # (Debian's SQLite does this by default; python.org's and macOS's do not).
                await conn.execute("PRAGMA secure_delete = ON")
            except BaseException:
                await conn.close()
                raise
            self._opened = self._identity()
            self._conn = conn

    def _identity(self) -> tuple[int, int] | None:
        """The (device, inode) of the file at the path now; None when there is none."""
        where = str(self.path)
        if where == ":memory:":
            return None
        try:
            st = os.stat(where)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _check_same_file(self) -> None:
        """Refuse every statement once the file opened is no longer the one at the path.

        A file replaced under a running process (a backup restored, the file moved or
        deleted) keeps the connection on the old inode, while SQLite finds the ``-wal`` file
        by name: commits went on, acknowledged as durable, as frames that the next process
        to open the path pairs with whatever file is there. One ``stat`` per statement
        (about 1 us, against a commit's fsync) stops that at the first statement after. The
        connection stays refused until it is closed: reconnecting on our own would read the
        new file through the old one's ``-wal``.
        """
        if self._moved is not None:
            raise StoreUnavailableError(self._moved)
        opened = self._opened
        if opened is None or self._identity() == opened:
            return
        self._moved = (
            f"the SQLite file {self.path} was replaced, moved or deleted after this process "
            "opened it, so nothing more is written or read through this connection. Stop "
            "every process that has the file open before you restore or move it (SQLite "
            "pairs the file with its -wal file by name), then close and open this runtime "
            "or store again, or restart the process"
        )
        log.error("%s", self._moved)
        raise StoreUnavailableError(self._moved)

    async def _enable_wal(self, conn: aiosqlite.Connection) -> None:
        # Switching a new file to WAL needs a lock that SQLite does not wait for through
        # busy_timeout, so processes opening the same new file at once retry here.
        deadline = time.monotonic() + max(self.busy_timeout_ms, 1000) / 1000
        delay = 0.005
        while True:
            rows = await conn.execute_fetchall("PRAGMA journal_mode")
            if str(next(iter(rows))[0]).lower() in ("wal", "memory"):
                return
            try:
                await conn.execute("PRAGMA journal_mode = WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _forget_connection(self) -> object | None:
        conn, self._conn = self._conn, None
        self._opened = self._moved = None
        # The parent's locks may have been held at fork time, or bound to its event loop.
        self._tx_lock = asyncio.Lock()
        self._open_lock = asyncio.Lock()
        return conn

    def _explain(self, exc: BaseException, what: str) -> StorageError | None:
        opening = self._explain_connect(exc, what) if what.endswith(" connect") else None
        if opening is not None:
            return opening
        if isinstance(exc, sqlite3.OperationalError) and str(exc).startswith(
            ("no such table: ", "no such column: ")
        ):
            return schema_changed(exc, what)
        if (read_only := self._explain_read_only(exc, what)) is not None:
            return read_only
        if (full := self._explain_no_space(exc, what)) is not None:
            return full
        # SQLITE_BUSY after busy_timeout: name who holds the lock rather than the statement
        # that happened to wait (a schema check, a lease claim) as if it were the problem.
        if not isinstance(exc, sqlite3.OperationalError) or "database is locked" not in str(exc):
            return None
        pid = _write_lock_holder(self.path)
        stopped = pid is not None and _is_stopped(pid)
        if pid is None:
            cause = "another process holds its write lock and kept it"
        elif pid == os.getpid():
            cause = "another connection of this process holds its write lock"
        elif stopped:
            cause = (
                f"pid {pid} holds its write lock and is stopped (SIGSTOP or a debugger); no "
                f"process can write until it is continued (kill -CONT {pid}) or ended"
            )
        else:
            cause = f"pid {pid} holds its write lock and kept it"
        return StoreLockedError(
            f"{what} failed: the database file {str(self.path)!r} is locked: {cause} "
            f"(waited {self.busy_timeout_ms} ms, the busy timeout)",
            path=str(self.path),
            pid=pid,
            stopped=stopped,
        )

    def _explain_read_only(self, exc: BaseException, what: str) -> StoreUnavailableError | None:
        """A file this user may not write: say which, and why (sqlite3 says only "attempt to
        write a readonly database", naming neither the file nor its directory)."""
        if not isinstance(exc, sqlite3.OperationalError):
            return None
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None or code & 0xFF != sqlite3.SQLITE_READONLY:
            return None
        path = str(self.path)
        if code == getattr(sqlite3, "SQLITE_READONLY_DIRECTORY", -1):
            why = (
                f"its directory {str(self.path.parent)!r} is not writable by this user, and "
                f"SQLite (in WAL mode) must create {self.path.name}-wal and "
                f"{self.path.name}-shm beside the file, even to read it"
            )
        elif _read_only_mount(self.path):
            why = _READ_ONLY_MOUNT
        else:
            why = "the file (or its filesystem) is read-only for this user"
        return StoreUnavailableError(f"{what} failed: {path!r}: {why} ({exc})")

    def _explain_no_space(self, exc: BaseException, what: str) -> StoreUnavailableError | None:
        """A filesystem that filled up, or was remounted read-only under a running process.

        sqlite3 says "database or disk is full", or, when the -shm file cannot be made,
        "disk I/O error": neither names the file, and the second reads like broken hardware.
        """
        if not isinstance(exc, sqlite3.OperationalError) or str(self.path) == ":memory:":
            return None
        code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
        if code not in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN):
            return None
        path = str(self.path)
        if _read_only_mount(self.path):
            return StoreUnavailableError(
                f"{what} failed: {path!r}: {_READ_ONLY_MOUNT} ({type(exc).__name__}: {exc})"
            )
        free = _free_bytes(self.path)
        if free is None or free >= _LOW_SPACE:
            # Not for want of space: a file size limit, or the driver's words are all there is
            return self._explain_size_limit(exc, what)
        return StoreUnavailableError(
            f"{what} failed: the filesystem holding {str(self.path.parent)!r} is full "
            f"({free} bytes free): free space there, or move the file to a larger volume; "
            f"{_NOTHING_LOST} ({type(exc).__name__}: {exc})"
        )

    def _explain_size_limit(self, exc: BaseException, what: str) -> StoreUnavailableError | None:
        """The file (or its -wal) grew to the process's file size limit (``ulimit -f``,
        systemd's ``LimitFSIZE=``): the write fails with EFBIG, which sqlite3 reports as
        "disk I/O error", on a disk with room to spare."""
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft == resource.RLIM_INFINITY:
            return None
        real = self.path.resolve()  # SQLite keeps the -wal beside a symlink's target
        for file in (real.with_name(real.name + "-wal"), real):
            with contextlib.suppress(OSError):
                if file.stat().st_size + _LOW_SPACE >= soft:
                    return StoreUnavailableError(
                        f"{what} failed: {str(file)!r} reached this process's file size "
                        f"limit ({soft} bytes: `ulimit -f`, or LimitFSIZE= in a systemd unit): "
                        f"raise or remove the limit; {_NOTHING_LOST} "
                        f"({type(exc).__name__}: {exc})"
                    )
        return None

    def _explain_connect(self, exc: BaseException, what: str) -> StoreUnavailableError | None:
        """A file that cannot be opened: say which, and the likely reason (sqlite3 names
        neither: "unable to open database file")."""
        path = str(self.path)
        if isinstance(exc, FileExistsError | NotADirectoryError):
            why = f"{str(self.path.parent)!r} is a file, not a directory"
        elif isinstance(exc, PermissionError):
            why = f"no permission to create its directory ({exc.strerror})"
        elif isinstance(exc, sqlite3.DatabaseError) and "not a database" in str(exc):
            why = "the file is not a SQLite database"
        elif isinstance(exc, sqlite3.OperationalError) and self.path.is_dir():
            why = "it is a directory, not a SQLite file (name the file inside it)"
        elif isinstance(exc, sqlite3.OperationalError) and "unable to open" in str(exc):
            why = self._why_unopenable()
        else:
            return None  # locked (see _explain), or nothing better to say than the error
        return StoreUnavailableError(
            f"{what} failed: {path!r}: {why} ({type(exc).__name__}: {exc})"
        )

    def _why_unopenable(self) -> str:
        """sqlite3 says "unable to open database file" both for a directory that takes no new
        file and for a file this user may not read: tell them apart, so that the hint names
        what to fix (a journal made by root and read by the app's user is the usual case)."""
        if _read_only_mount(self.path):
            return _READ_ONLY_MOUNT
        try:
            with open(self.path, "rb"):
                pass
        except PermissionError:
            if self.path.exists():  # not a directory this user may not search
                return "the file exists but this user may not read it (check its owner and mode)"
        except OSError:
            pass
        return "SQLite cannot open or create it: is its directory writable by this user?"

    def _is_duplicate_key(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError) and exc.sqlite_errorcode in (
            sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY,
            sqlite3.SQLITE_CONSTRAINT_UNIQUE,
        )

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        self._opened = self._moved = None
        if conn is not None:
            await conn.close()

    async def _fetch(self, sql: str, *args: Any) -> Rows:
        self._check_same_file()
        conn = self.conn
        if self._tx_lock.locked():  # a transaction is open on our connection: wait it out
            async with self._tx_lock:
                return await conn.execute_fetchall(sql, args)  # type: ignore[return-value]
        return await conn.execute_fetchall(sql, args)  # type: ignore[return-value]

    async def _count(self, sql: str, *args: Any) -> int:
        self._check_same_file()
        conn = self.conn
        if self._tx_lock.locked():
            async with self._tx_lock:
                return await _count_on(conn, sql, args)
        return await _count_on(conn, sql, args)

    @contextlib.asynccontextmanager
    async def _transaction(self, lock_key: int | None) -> AsyncIterator[Transaction]:
        async with self._tx_lock:
            self._check_same_file()
            conn = self.conn
            await _begin(conn)  # the write lock: other processes queue here
            try:
                yield _Tx(conn)
            except BaseException:
                # Queued behind the body's last statement: it runs even if this await is
                # cancelled, before any statement another caller queues.
                await conn.execute("ROLLBACK")
                raise
            await conn.execute("COMMIT")


async def _begin(conn: aiosqlite.Connection) -> None:
    """``BEGIN IMMEDIATE``, never left open by a cancelled caller.

    The statement runs on aiosqlite's thread whatever becomes of the coroutine awaiting it:
    a task cancelled while it waits for the write lock (a request timeout, a client that went
    away) would otherwise leave the connection inside a transaction, and every later write of
    the process would fail ("cannot start a transaction within a transaction") or hold the
    file's write lock for good. So a cancelled begin waits for the statement, rolls it back,
    and only then lets the cancellation through, still holding the process's transaction
    lock so that no other statement can slip in between.
    """
    begin = asyncio.ensure_future(conn.execute("BEGIN IMMEDIATE"))
    try:
        await asyncio.shield(begin)
        return
    except asyncio.CancelledError:
        undo = asyncio.ensure_future(_undo_begin(conn, begin))
    while not undo.done():  # the undo is bounded by busy_timeout: see it through
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(undo)
    if not undo.cancelled() and undo.exception() is not None:
        log.warning("rolling back a cancelled BEGIN failed: %s", undo.exception())
    raise asyncio.CancelledError


async def _undo_begin(conn: aiosqlite.Connection, begin: asyncio.Future[Any]) -> None:
    try:
        await begin
    except Exception:  # the BEGIN failed (locked past busy_timeout): nothing to undo
        return
    await conn.execute("ROLLBACK")


async def _count_on(conn: aiosqlite.Connection, sql: str, args: Sequence[Any]) -> int:
    """Run ``sql`` and read its row count in one trip to aiosqlite's thread.

    aiosqlite has no public call for this: ``execute`` then ``rowcount`` then ``close`` would
    be two trips (about 15 us each). ``_execute`` is how its own helpers (``execute_fetchall``,
    ``execute_insert``) run a function on the connection's thread.
    """

    def run(raw: sqlite3.Connection) -> int:
        cursor = raw.execute(sql, args)
        try:
            return cursor.rowcount
        finally:
            cursor.close()

    # aiosqlite leaves _execute untyped.
    return await conn._execute(run, conn._conn)  # type: ignore[no-untyped-call,no-any-return]
