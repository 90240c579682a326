"""What the journal deletes for compliance: a prune keeps the users it is told to keep (those
under legal hold), and an erasure takes every row of the user whatever time the row says.
On every backend (the time-travel case on the database backends, whose rows carry a time).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow.errors import InvalidIdError
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]


class Body:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def __call__(self, value: Any) -> dict[str, Any]:
        self.calls.append(value)
        return {"value": value, "n": len(self.calls)}


async def test_a_prune_keeps_the_users_it_is_told_to(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    for user in ("alice", "bob", None):
        async with runtime.session("s", user):
            await runtime.step("a", Body(), 1)
            await runtime.step("b", Body(), 2, idempotency_key=f"k-{user}")
    await asyncio.sleep(0.005)  # SQLite's clock ticks in ms: the cut-off is after every row
    everything = dt.timedelta(0)
    # One entry and one idempotency result per user.
    assert await runtime.prune(older_than=everything, dry_run=True) == 6
    kept = ["alice", None]
    assert await runtime.prune(older_than=everything, keep_users=kept, dry_run=True) == 2
    assert await runtime.prune(older_than=everything, keep_users=kept) == 2
    assert len(await runtime.entries("s", "alice")) == 1
    assert len(await runtime.entries("s", None)) == 1
    assert await runtime.entries("s", "bob") == []
    async with runtime.session("t", "alice") as run:  # alice's idempotency result is kept
        assert await runtime.step("x", Body(), 9, idempotency_key="k-alice") == {
            "value": 2,
            "n": 1,
        }
    assert run.stats.hits == 1
    with pytest.raises(InvalidIdError):
        await runtime.prune(older_than=everything, keep_users=[""])


async def test_an_erasure_takes_rows_written_in_the_future(
    runtime_factory: Factory, request: pytest.FixtureRequest
) -> None:
    """A host whose clock was stepped back writes rows "in the future"; text in the time
    column (a hand-edited row) has no age at all. A forget must take them all the same."""
    runtime = await runtime_factory()
    for user in ("alice", "bob"):
        async with runtime.session("s", user):
            await runtime.step("a", Body(), 1)
            await runtime.step("b", Body(), 2, idempotency_key=f"k-{user}")
    backend = request.node.callspec.params["runtime_factory"]
    if backend == "sqlite":
        with sqlite3.connect(runtime.database.path) as db:  # type: ignore[attr-defined]
            db.execute("UPDATE loom_entries SET created_at = created_at + 3600")
            db.execute("UPDATE loom_idempotency SET created_at = 'soon'")
    elif backend == "postgres":
        await runtime.database.execute(  # type: ignore[attr-defined]
            "UPDATE loom_entries SET created_at = created_at + 3600"
        )
        await runtime.database.execute(  # type: ignore[attr-defined]
            "UPDATE loom_idempotency SET created_at = created_at + 3600"
        )
    else:
        store: Any = runtime._store
        for runs in store.entries.values():
            for run in runs.values():
                for key, (entry, created) in list(run.items()):
                    run[key] = (entry, created + 3600)
        for key, (entry, created) in list(store.idempotent.items()):
            store.idempotent[key] = (entry, created + 3600)
    assert await runtime.forget_user("alice") == 3  # the entry, the idempotency result, the row
    assert await runtime.entries("s", "alice") == []
    assert await runtime.sessions(user_id="alice") == []
    assert len(await runtime.entries("s", "bob")) == 1
    async with runtime.session("t", "alice"):  # nothing of alice's replays
        assert await runtime.step("x", Body(), 9, idempotency_key="k-alice") == {
            "value": 9,
            "n": 1,
        }
