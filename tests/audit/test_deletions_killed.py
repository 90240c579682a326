"""``loomflow journal prune --user`` and ``checkpoints forget --user`` killed (a real SIGKILL)
after rows of theirs are gone.

Both note a deletion in the user's audit trail. Before, the note came only after the rows
were deleted: a command killed part-way (between a prune's batches, or between the DELETE and
the note) had deleted rows that its re-run no longer found, so that deletion was on no record,
or the re-run noted only the rest. Now an ``audit.deletion.start`` note (how many rows it
found) is written before the first row goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from loomflow import Agent, ToolCall, Tuning
from loomflow.audit._entry import user_key
from loomflow.audit._sql import lock_key
from loomflow.config import Settings
from loomflow.models import ScriptedModel
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


async def _snapshots(dsn: str, user: str) -> None:
    """A real agent run that leaves two snapshots (``Tuning(checkpoint=True)``)."""
    model = ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={})], "done"])

    async def lookup() -> str:
        """Look it up."""
        return "found"

    async with Agent.from_settings(
        "Support.",
        model=model,
        tools=[lookup],
        settings=Settings(runtime_url=dsn),
        tuning=Tuning(checkpoint=True),
        memory=False,
    ) as agent:
        assert (await agent.run("look", session_id="s-2", user_id=user)).output == "done"


async def _waiting_backends(conn: asyncpg.Connection) -> int:
    return int(
        await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
    )


async def _kill_when_waiting(proc: asyncio.subprocess.Process, watcher: asyncpg.Connection) -> None:
    """SIGKILL ``proc`` once its database session waits on a lock, and end that session (the
    server would, once it noticed its client gone), so nothing more of it lands."""
    async with asyncio.timeout(30):
        while not await _waiting_backends(watcher):
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.02)
    assert proc.returncode is None, await proc.communicate()
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    await watcher.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    async with asyncio.timeout(30):
        while await _waiting_backends(watcher):  # noqa: ASYNC110 - a row, not an event
            await asyncio.sleep(0.02)


async def _cli(dsn: str, *args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loomflow.cli",
        *args,
        env=_env(dsn),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _children.append(proc)
    return proc


@contextlib.asynccontextmanager
async def _lock_holder(dsn: str) -> AsyncIterator[tuple[asyncpg.Connection, asyncpg.Connection]]:
    """A connection to hold a lock with and one to watch the waiters from; any child process
    started meanwhile (in ``_children``) is killed on the way out."""
    holder = await asyncpg.connect(dsn)
    watcher = await asyncpg.connect(dsn)
    try:
        yield holder, watcher
    finally:
        for proc in _children:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        _children.clear()
        await holder.close()
        await watcher.close()


_children: list[asyncio.subprocess.Process] = []


def _env(dsn: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return {**clean, "LOOMFLOW_RUNTIME_URL": dsn}


async def test_a_prune_killed_between_batches_is_on_the_users_record(pg_dsn: str) -> None:
    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        await stores.migrate()
    await _finished_run(pg_dsn, "ana")
    await _finished_run(pg_dsn, "bob")
    async with _lock_holder(pg_dsn) as (holder, watcher):
        # The row the prune's keyset batches reach last, locked: batches of one row delete
        # every other entry of ana's, each committed, and the prune then waits on this one.
        tx = holder.transaction()
        await tx.start()
        await holder.fetch(
            "SELECT 1 FROM loom_entries e JOIN loom_sessions s ON s.scope = e.scope "
            "WHERE s.user_id = 'ana' ORDER BY e.scope DESC, e.epoch DESC, e.path DESC, "
            "e.name DESC, e.fingerprint DESC LIMIT 1 FOR UPDATE OF e"
        )
        proc = await _cli(
            pg_dsn, "journal", "prune", "--user", "ana", "--batch-size", "1", "--no-progress"
        )
        await _kill_when_waiting(proc, watcher)
        await tx.rollback()
        left = await watcher.fetchval(
            "SELECT count(*) FROM loom_entries e JOIN loom_sessions s ON s.scope = e.scope "
            "WHERE s.user_id = 'ana'"
        )
        assert left == 1  # the kill came between batches: the others are gone

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


async def test_a_checkpoint_forget_killed_before_its_note_is_on_the_users_record(
    pg_dsn: str,
) -> None:
    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        await stores.migrate()
    await _snapshots(pg_dsn, "ana")
    async with _lock_holder(pg_dsn) as (holder, watcher):
        # Ana's audit chain locked, as a long append of hers would hold it: the forget waits
        # at its first audit write, and is killed there.
        await holder.execute("SELECT pg_advisory_lock($1)", lock_key(user_key("ana")))
        proc = await _cli(pg_dsn, "checkpoints", "forget", "--user", "ana", "--yes")
        await _kill_when_waiting(proc, watcher)
        await holder.execute("SELECT pg_advisory_unlock_all()")
        left = await watcher.fetchval("SELECT count(*) FROM loom_checkpoints")

    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        # Re-runnable: a re-run deletes whatever is left.
        assert await stores.forget_checkpoints("ana", actor="cli:ops") == left
        notes = [
            (e.action, e.payload["store"])
            async for e in stores.audit.entries(user_id="ana")
            if e.action.startswith("audit.deletion")
        ]
        assert (await stores.audit.verify()).ok
    # Whenever the kill came, the snapshots that went are on the user's record: the killed
    # forget stopped before deleting them (its start note waited), and the re-run noted both.
    assert left == 2
    assert notes == [("audit.deletion.start", "checkpoints"), ("audit.deletion", "checkpoints")]
