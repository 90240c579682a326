"""A process frozen inside a PostgreSQL transaction holds its locks for a bounded time.

The child takes the lock an audit append takes for one user, then stops itself with SIGSTOP
inside the transaction, as a paused VM or container would. Without a limit the server keeps
the transaction open, and every other process writing that user's audit trail (the runs of the
user, the worker that would take the frozen process's runs over) waits for as long as the
freeze lasts. With ``idle_in_transaction_session_timeout`` set on our connections the server
ends the frozen session and the others go on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
import uuid

import pytest

from loomflow.audit import AuditLog
from loomflow.errors import ConfigurationError
from loomflow.storage import PostgresDatabase
from loomflow.storage._postgres import IDLE_IN_TRANSACTION_TIMEOUT_S

pytestmark = pytest.mark.postgres

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from loomflow.audit._entry import user_key
    from loomflow.audit._sql import lock_key
    from loomflow.storage import PostgresDatabase

    async def main(dsn, user):
        db = PostgresDatabase(dsn, idle_in_transaction_timeout=1.0)
        try:
            async with db.transaction(lock_key=lock_key(user_key(user)), what="audit append") as tx:
                print("locked", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen here, the lock held
                await tx.fetch("SELECT 1")
            print("wrote after the freeze", flush=True)
        except Exception as exc:
            print("refused:", type(exc).__name__, flush=True)
        finally:
            await db.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


async def test_a_frozen_transaction_stops_blocking_the_others(pg_dsn: str) -> None:
    user = f"frozen-{uuid.uuid4().hex[:8]}"
    audit = AuditLog(pg_dsn)
    await audit.record(
        "probe.before", user_id=user, actor="test"
    )  # migrated before the child locks
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", CHILD, pg_dsn, user),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            assert await proc.stdout.readline() == b"locked\n"
        started = time.monotonic()
        async with asyncio.timeout(20):  # it used to wait for as long as the child was stopped
            await audit.record("probe.after", user_id=user, actor="test")
        assert time.monotonic() - started >= 0.5  # it did wait for the frozen lock first
        proc.send_signal(signal.SIGCONT)
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
        # The frozen process wrote nothing after its session was ended.
        assert out.decode().strip() == "refused: StoreUnavailableError", err.decode()[-2000:]
        entries = (await audit.query(user_id=user)).entries
        assert [e.action for e in entries] == ["probe.before", "probe.after"]
        assert (await audit.verify(user_id=user)).ok
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()
        await audit.close()


async def test_the_setting_reaches_the_pool_and_can_be_left_to_the_server(pg_dsn: str) -> None:
    db = PostgresDatabase(pg_dsn)
    quiet = PostgresDatabase(pg_dsn, idle_in_transaction_timeout=None)
    try:
        async with db.transaction(what="test") as tx:
            [(value,)] = await tx.fetch("SHOW idle_in_transaction_session_timeout")
        assert value == f"{int(IDLE_IN_TRANSACTION_TIMEOUT_S)}s" or value == "1min"
        async with quiet.transaction(what="test") as tx:
            [(value,)] = await tx.fetch("SHOW idle_in_transaction_session_timeout")
        assert value == "0"  # the server's default
    finally:
        await db.close()
        await quiet.close()
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigurationError, match="idle_in_transaction_timeout"):
            PostgresDatabase(pg_dsn, idle_in_transaction_timeout=bad)
