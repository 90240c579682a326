"""A snapshot is written under the run's fencing token, as a journal step is.

The lease check before a snapshot is free while the lease is fresh, so it cannot see what
happens between it and the write: a cancel from another worker (it bumps the token at once),
or a takeover of a worker that was stopped just after its check. The write itself now
carries the token, and a run fenced out stores nothing and raises the journal's error.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
from ulid import ULID

from loomflow.checkpoints import Checkpoint, checkpoint_store_for
from loomflow.errors import OwnershipLostError, RunCancelledError
from loomflow.messages import Message, Usage
from loomflow.runtime import JournalRuntime

pytestmark = pytest.mark.timeout(60)


def _snapshot(turn: int) -> Checkpoint:
    return Checkpoint(
        id=str(ULID()),
        session_id="s",
        user_id="u",
        run_id="r",
        epoch=0,
        turn=turn,
        final=False,
        prompt="p",
        output="",
        messages=[Message.user("p")],
        prompt_index=0,
        usage=Usage(),
        cost_usd=0.0,
    )


async def test_a_snapshot_after_a_cancel_from_another_worker_is_refused(
    sql_runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    mine, other = await sql_runtime_factory(), await sql_runtime_factory()
    store = checkpoint_store_for(mine)
    with pytest.raises(RunCancelledError):
        async with mine.session("s", user_id="u"):
            await mine.step("work", lambda: 1)  # the run holds the turn, its lease is fresh
            assert await other.cancel("s", user_id="u")
            # The lease check passes (fresh, so the store is not asked): the write is fenced.
            await mine.put_checkpoint(store, _snapshot(1), retention=None, name="checkpoint_1")
    assert await store.list_checkpoints("s", user_id="u") == []


async def test_a_worker_that_lost_its_run_writes_no_snapshot_with_its_old_token(
    sql_runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    mine = await sql_runtime_factory(lease_seconds=0.5)
    store = checkpoint_store_for(mine)

    async def take_over() -> None:  # another owner, on its own loop and connection
        runtime = await sql_runtime_factory(turn_timeout=10)
        try:
            async with runtime.session("s", user_id="u", resume=True):
                await runtime.step("work", lambda: 1)
                await runtime.put_checkpoint(
                    checkpoint_store_for(runtime), _snapshot(2), retention=None, name="c2"
                )
        finally:
            await runtime.close()

    with pytest.raises(OwnershipLostError):
        async with mine.session("s", user_id="u"):
            await mine.step("work", lambda: 1)
            run = mine.current_run
            assert run is not None
            # This worker stops just after its lease check (the whole loop, heartbeat and
            # all), past its lease; another owner takes the run over and snapshots it.
            time.sleep(0.8)  # noqa: ASYNC251 - the point: the loop stops, heartbeat too
            thread = threading.Thread(target=asyncio.run, args=(take_over(),))
            thread.start()
            thread.join()
            with pytest.raises(OwnershipLostError, match="now belongs to a newer run"):
                await store.put(_snapshot(1), token=run.token)  # type: ignore[call-arg]
            raise OwnershipLostError("left")
    assert [c.turn for c in await store.list_checkpoints("s", user_id="u")] == [2]
