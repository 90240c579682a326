"""A PostgreSQL server that refuses our work says why, and what to do about it.

Each case is set up on a real server the way operators meet it: a replica promoted the other
way (default_transaction_read_only), a statement_timeout on the database, a database that is
not there, a role out of connection slots. The error stays a StoreUnavailableError (a
MigrationError when migrating), and its message names the cause and the fix, not only the
driver's words.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import urllib.parse
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from loomflow.errors import StoreUnavailableError
from loomflow.runtime import PostgresRuntime
from loomflow.storage import PostgresDatabase

pytestmark = pytest.mark.postgres

PG_ADMIN_DSN = os.environ.get(
    "LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
)


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _name_of(dsn: str) -> str:
    return dsn.rpartition("/")[2]


async def _one_step(dsn: str) -> None:
    runtime = await PostgresRuntime.connect(dsn)
    try:
        async with runtime.session("s", "u"):

            async def body() -> int:
                return 1

            await runtime.step("a", body)
    finally:
        await runtime.close()


async def test_a_read_only_server_names_the_primary_as_the_fix(pg_dsn: str) -> None:
    await _one_step(pg_dsn)  # migrated and written while the server took writes
    await _admin(f'ALTER DATABASE "{_name_of(pg_dsn)}" SET default_transaction_read_only = on')
    with pytest.raises(StoreUnavailableError) as caught:
        await _one_step(pg_dsn)
    message = str(caught.value)
    assert "read-only" in message
    assert "target_session_attrs=read-write" in message
    assert isinstance(caught.value.__cause__, asyncpg.ReadOnlySQLTransactionError)


@contextlib.asynccontextmanager
async def _locked(dsn: str, table: str) -> AsyncIterator[None]:
    """Another session holding ``table`` in an open transaction while the block runs."""
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("SET statement_timeout = 0")
        async with holder.transaction():
            await holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            yield
    finally:
        await holder.close()


@pytest.mark.parametrize(
    ("setting", "named"),
    [("statement_timeout", ("statement_timeout", "ALTER ROLE")), ("lock_timeout", ("pg_locks",))],
)
async def test_the_servers_own_timeouts_are_named(
    pg_dsn: str, setting: str, named: tuple[str, ...]
) -> None:
    await _one_step(pg_dsn)
    await _admin(f"ALTER DATABASE \"{_name_of(pg_dsn)}\" SET {setting} = '300ms'")
    # Another session holds our table, so the server ends our statement's wait at 300 ms,
    # well before LOOMFLOW_POSTGRES_TIMEOUT_SECONDS would.
    async with _locked(pg_dsn, "loom_sessions"):
        with pytest.raises(StoreUnavailableError) as caught:
            await asyncio.wait_for(_one_step(pg_dsn), 30)
    message = str(caught.value)
    assert setting in message, message
    for words in named:
        assert words in message, message


async def test_a_database_that_is_not_there_is_named() -> None:
    name = f"loom_test_missing_{uuid.uuid4().hex[:8]}"
    dsn = f"{PG_ADMIN_DSN.rpartition('/')[0]}/{name}"
    with pytest.raises(StoreUnavailableError) as caught:
        await _one_step(dsn)
    message = str(caught.value)
    assert name in message
    assert "CREATE DATABASE" in message


async def test_a_role_out_of_connection_slots_is_named(pg_dsn: str) -> None:
    role = f"loom_test_role_{uuid.uuid4().hex[:8]}"
    await _admin(f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT 0')
    try:
        server = urllib.parse.urlsplit(pg_dsn)
        dsn = server._replace(netloc=f"{role}@{server.netloc.rpartition('@')[2]}").geturl()
        with pytest.raises(StoreUnavailableError) as caught:
            await _one_step(dsn)
    finally:
        await _admin(f'DROP ROLE "{role}"')
    message = str(caught.value)
    assert "no connection left" in message
    assert "max_connections" in message


async def test_a_lock_held_past_our_timeout_is_named(pg_dsn: str) -> None:
    db = PostgresDatabase(pg_dsn, timeout_s=0.5)
    try:
        await db.execute("CREATE TABLE held (x int)")
        async with _locked(pg_dsn, "held"):
            with pytest.raises(StoreUnavailableError) as caught:
                await db.fetch("SELECT x FROM held")
    finally:
        await db.close()
    assert "within 0.5s" in str(caught.value)
    assert "holds a lock" in str(caught.value)


class _Proxy:
    """A TCP relay to the server that can pass on, as the server would, the message a backend
    sends when it is ended (FATAL 57P01), and hold the connection open a moment before the
    close: asyncpg's connection then knows neither that it is closed nor that it is idle.
    Connections made after that are relayed as before."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._clients: list[asyncio.StreamWriter] = []
        self._ended: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._relay(reader, writer)
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._clients.append(writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while (data := await src.read(65536)) and writer not in self._ended:
                    dst.write(data)
                    await dst.drain()
                if writer not in self._ended:  # a close on one side is passed on
                    dst.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            up_writer.close()

    async def end_sessions(self) -> None:
        """What pg_terminate_backend sends each client, the close itself still to come."""
        fields = b"SFATAL\0VFATAL\0C57P01\0Mterminating connection due to administrator command\0\0"
        for writer in self._clients:
            self._ended.add(writer)
            writer.write(b"E" + (len(fields) + 4).to_bytes(4, "big") + fields)
        self._clients = []
        await asyncio.sleep(0.2)  # the message is read; the close has not come

    async def close(self) -> None:
        for writer in (*self._ended, *self._clients):
            writer.close()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def _relayed(pg_dsn: str) -> AsyncIterator[tuple[_Proxy, PostgresDatabase]]:
    server = urllib.parse.urlsplit(pg_dsn)
    proxy = _Proxy(server.hostname or "127.0.0.1", server.port or 5432)
    port = await proxy.start()
    login = server.netloc.rpartition("@")[0]
    db = PostgresDatabase(server._replace(netloc=f"{login}@127.0.0.1:{port}").geturl())
    try:
        assert await db.fetch("SELECT 1") == [(1,)]
        await asyncio.sleep(0.3)  # the lane is up beside the pool's connection
        assert await db.fetch("SELECT 1") == [(1,)]
        yield proxy, db
    finally:
        await db.close()
        await proxy.close()


async def test_a_statement_on_connections_the_server_ended_is_sent_on_a_new_one(
    pg_dsn: str,
) -> None:
    # The server ended them while they were idle (idle_session_timeout, a restart); nothing
    # of the statement was sent on them, so it is not lost and not sent twice.
    async with _relayed(pg_dsn) as (proxy, db):
        await proxy.end_sessions()
        assert await db.fetch("SELECT 2") == [(2,)]
        await proxy.end_sessions()
        await db.execute("CREATE TABLE once (x int)")  # sent twice, it would fail
        assert await db.fetch("SELECT count(*) FROM once") == [(0,)]


async def test_a_transaction_on_a_connection_the_server_ended_is_a_store_error(
    pg_dsn: str,
) -> None:
    async with _relayed(pg_dsn) as (proxy, db):
        await proxy.end_sessions()
        with pytest.raises(StoreUnavailableError) as caught:
            async with db.transaction(what="audit append") as tx:
                await tx.fetch("SELECT 1")
        assert await db.fetch("SELECT 2") == [(2,)]  # connected anew
    assert "the server ended this session" in str(caught.value)


async def test_a_transaction_whose_session_was_ended_names_why_not_its_rollback(
    pg_dsn: str,
) -> None:
    db = PostgresDatabase(pg_dsn, timeout_s=5)
    try:
        with pytest.raises(StoreUnavailableError) as caught:
            async with db.transaction(what="audit append") as tx:
                pid = (await tx.fetch("SELECT pg_backend_pid()"))[0][0]
                await _admin(f"SELECT pg_terminate_backend({pid})")
                await tx.fetch("SELECT pg_sleep(0.5)")
        assert await db.fetch("SELECT 1") == [(1,)]  # connected anew
    finally:
        await db.close()
    message = str(caught.value)
    # The rollback that could not be sent is not the news: the statement's failure is.
    assert "__aexit__" not in message, message
    assert "the connection closed during the transaction" in message, message
    assert "nothing of it was committed" in message, message
