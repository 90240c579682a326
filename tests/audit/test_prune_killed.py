"""``loomflow journal prune --user`` killed (a real SIGKILL) between two of its batches.

The prune deletes in batches, each committed on its own, and notes the deletion in the user's
audit trail. Before, the note came only after the last batch: a prune killed part-way had
deleted rows that its re-run no longer found, so the re-run noted only the rest, and a prune
killed after its last batch was on no record at all. Now an ``audit.deletion.start`` note
(how many rows it found) is written before the first row goes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import asyncpg
import pytest

from loomflow.config import Settings
from loomflow.runtime import PostgresRuntime
from loomflow.stores import Stores

pytestmark = [pytest.mark.crash, pytest.mark.postgres, pytest.mark.timeout(60)]

STEPS = 5


async def _finished_run(dsn: str, user: str) -> None:
    runtime = await PostgresRuntime.connect(dsn)
    try:
        async with runtime.session("s-1", user):
            for i in range(STEPS):
                await runtime.step(f"step-{i}", _value, i)
    finally:
        await runtime.close()


def _value(i: int) -> dict[str, Any]:
    return {"i": i}


async def _waiting_backends(conn: asyncpg.Connection) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
    )


def _env(dsn: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return {**clean, "LOOMFLOW_RUNTIME_URL": dsn}


async def test_a_prune_killed_between_batches_is_on_the_users_record(pg_dsn: str) -> None:
    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        await stores.migrate()
    await _finished_run(pg_dsn, "ana")
    await _finished_run(pg_dsn, "bob")
    holder = await asyncpg.connect(pg_dsn)
    watcher = await asyncpg.connect(pg_dsn)
    proc: asyncio.subprocess.Process | None = None
    try:
        # The row the prune's keyset batches reach last, locked: batches of one row delete
        # every other entry of ana's, each committed, and the prune then waits on this one.
        tx = holder.transaction()
        await tx.start()
        await holder.fetch(
            "SELECT 1 FROM loom_entries e JOIN loom_sessions s ON s.scope = e.scope "
            "WHERE s.user_id = 'ana' ORDER BY e.scope DESC, e.epoch DESC, e.path DESC, "
            "e.name DESC, e.fingerprint DESC LIMIT 1 FOR UPDATE OF e"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loomflow.cli",
            "journal",
            "prune",
            "--user",
            "ana",
            "--batch-size",
            "1",
            "--no-progress",
            env=_env(pg_dsn),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(30):
            while not await _waiting_backends(watcher):
                if proc.returncode is not None:
                    break
                await asyncio.sleep(0.02)
        assert proc.returncode is None, await proc.communicate()
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        # The server has not noticed its client is gone: the waiting DELETE would go on once
        # the lock is free. End it, as the server does when it notices, so the count is fixed.
        await watcher.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        async with asyncio.timeout(30):
            while await _waiting_backends(watcher):  # noqa: ASYNC110 - a row, not an event
                await asyncio.sleep(0.02)
        await tx.rollback()
        left = await watcher.fetchval(
            "SELECT count(*) FROM loom_entries e JOIN loom_sessions s ON s.scope = e.scope "
            "WHERE s.user_id = 'ana'"
        )
        assert left == 1  # the kill came between batches: the others are gone
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await holder.close()
        await watcher.close()

    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        # Re-runnable: the re-run deletes what is left and notes it.
        assert await stores.prune_journal(user_id="ana", actor="cli:ops") == 1
        trail = [
            (e.action, e.payload)
            async for e in stores.audit.entries(user_id="ana")
            if e.action.startswith("audit.deletion")
        ]
        assert (await stores.audit.verify()).ok
        bob = (await stores.export_user("bob"))["journal"]["entries"]
    # The killed prune is on record with all it found; the re-run with its start and end.
    assert trail == [
        ("audit.deletion.start", {"store": "journal", "found": STEPS, "include_open": False}),
        ("audit.deletion.start", {"store": "journal", "found": 1, "include_open": False}),
        ("audit.deletion", {"store": "journal", "deleted": 1, "include_open": False}),
    ]
    assert len(bob) == STEPS  # another user's entries are not touched
