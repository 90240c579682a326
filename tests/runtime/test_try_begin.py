"""``JournalStore.try_begin``: a new run claimed and opened in one write, on every backend.

It may only act where claim-then-open would have opened a new run: the turn is free (or its
lease ran out) and the session has no open run. Anywhere else it must change nothing, so the
journal's two-step path still sees the session as it was.

Claims also say whether the session's run was cancelled, so that a resume makes no separate
status read; a store whose claims do not say is asked apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from loomflow.errors import RunCancelledError
from loomflow.runtime import JournalRuntime
from loomflow.runtime._store import Claim, Scope

Factory = Callable[..., Awaitable[JournalRuntime]]
RECORD = ("triage", '{"model":"m"}', b'{"prompt":"hi"}')


async def _store(runtime_factory: Factory) -> Any:
    runtime = await runtime_factory()
    await runtime.open()
    return runtime._store


async def _open_row(store: Any, scope: Scope) -> Any:
    rows = [r for r in await store.open_runs(100) if r.session_id == scope.session_id]
    return rows[0] if rows else None


def _count(store: Any, *names: str) -> list[str]:
    """Note each call of the store methods ``names``, in order, in the list returned."""
    calls: list[str] = []
    for name in names:
        real = getattr(store, name)

        async def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return await _real(*args)

        setattr(store, name, counted)
    return calls


async def test_a_fresh_session_is_claimed_and_opened_with_its_record(
    runtime_factory: Factory,
) -> None:
    store = await _store(runtime_factory)
    scope = Scope("s-fresh", "u1")
    claim = await store.try_begin(scope, "owner-a", 30.0, RECORD)
    assert claim is not None
    assert claim.open
    assert claim.epoch == 0
    assert await store.holder(scope) == ("owner-a", claim.token)
    row = await _open_row(store, scope)
    assert (row.agent, row.config, bytes(row.record)) == RECORD
    assert await store.run_status(scope) is None


async def test_a_held_turn_is_left_to_its_holder(runtime_factory: Factory) -> None:
    store = await _store(runtime_factory)
    scope = Scope("s-held", "u1")
    first = await store.try_begin(scope, "owner-a", 30.0, RECORD)
    assert first is not None
    assert await store.try_begin(scope, "owner-b", 30.0, ("other", "{}", b"{}")) is None
    assert await store.holder(scope) == ("owner-a", first.token)
    row = await _open_row(store, scope)
    assert row.agent == "triage"  # the holder's record, not the refused caller's


async def test_a_run_left_open_is_not_reopened_over(runtime_factory: Factory) -> None:
    store = await _store(runtime_factory)
    scope = Scope("s-left", "u1")
    claim = await store.try_begin(scope, "owner-a", 30.0, RECORD)
    assert claim is not None
    assert await store.release(scope, claim.token, None)  # turn given back, run still open
    assert await store.try_begin(scope, "owner-b", 30.0, None) is None
    again = await store.try_acquire(scope, "owner-b", 30.0)
    assert again is not None
    assert again.open
    assert again.epoch == claim.epoch
    assert again.token == claim.token + 1  # nothing bumped in between
    row = await _open_row(store, scope)
    assert (row.agent, bytes(row.record)) == ("triage", RECORD[2])


async def test_a_closed_run_gives_way_to_a_new_one_with_a_clean_slate(
    runtime_factory: Factory,
) -> None:
    store = await _store(runtime_factory)
    scope = Scope("s-closed", "u1")
    first = await store.try_begin(scope, "owner-a", 30.0, RECORD)
    assert first is not None
    assert await store.release(scope, first.token, first.epoch + 1, "interrupted")
    assert await store.run_status(scope) == "interrupted"
    second = await store.try_begin(scope, "owner-b", 30.0, None)
    assert second is not None
    assert second.open
    assert second.epoch == first.epoch + 1
    assert second.token > first.token
    assert await store.run_status(scope) is None
    row = await _open_row(store, scope)
    assert (row.owner, row.agent, row.record, row.attempts) == ("owner-b", None, None, 0)


async def test_an_expired_claim_that_never_opened_a_run_is_taken(
    runtime_factory: Factory,
) -> None:
    store = await _store(runtime_factory)
    scope = Scope("s-expired", "u1")
    stale = await store.try_acquire(scope, "owner-a", 0.05)
    assert stale is not None
    assert not stale.open
    assert await store.try_begin(scope, "owner-b", 30.0, RECORD) is None  # lease still good
    await asyncio.sleep(0.2)
    claim = await store.try_begin(scope, "owner-b", 30.0, RECORD)
    assert claim is not None
    assert claim.open
    assert claim.token == stale.token + 1
    assert not await store.renew(scope, stale.token, 30.0)  # the old holder is fenced out


async def test_a_new_run_takes_one_store_call_to_open(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    await runtime.open()
    calls = _count(runtime._store, "try_begin", "try_acquire", "begin_run")
    async with runtime.session("s-count", "u1"):
        assert await runtime.step("a", lambda: 1) == 1
    async with runtime.session("s-count", "u1"):  # the next run of a closed session too
        assert await runtime.step("a", lambda: 2) == 2
    assert calls == ["try_begin", "try_begin"]


class _OlderStore:
    """A store written before ``try_begin`` existed: everything else delegated."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "try_begin":
            raise AttributeError(name)
        return getattr(self._inner, name)


async def test_a_store_without_it_claims_then_opens(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    await runtime.open()
    runtime._store = _OlderStore(runtime._store)
    async with runtime.session("s-old", "u1"):
        assert await runtime.step("a", lambda: 1) == 1
    async with runtime.session("s-old", "u1"):
        assert await runtime.step("a", lambda: 2) == 2
    assert [e.name for e in await runtime.entries("s-old", "u1")] == ["a", "a"]


# -- a resume reads whether the run was cancelled with its claim ------------------------------


class _Stop(Exception):
    pass


async def _cancelled_run(runtime: JournalRuntime, session: str) -> None:
    with pytest.raises(_Stop):
        async with runtime.session(session, "u1"):
            assert await runtime.step("a", lambda: 1) == 1
            raise _Stop  # leaves the run open
    assert await runtime.cancel(session, "u1")


async def test_a_resume_learns_of_a_cancel_from_its_claim(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    await runtime.open()
    await _cancelled_run(runtime, "s-cancelled")
    async with runtime.session("s-done", "u1"):
        await runtime.step("a", lambda: 1)
    reads = _count(runtime._store, "run_status")
    with pytest.raises(RunCancelledError):
        async with runtime.session("s-cancelled", "u1", resume=True):
            pass
    async with runtime.session("s-done", "u1", resume=True) as run:
        assert await runtime.step("a", lambda: 2) == 1  # replayed
        assert run.stats.hits == 1
    assert reads == []


class _ClaimsWithoutStatus:
    """A store whose claims do not say whether the run was cancelled (written before 0.21,
    so it cannot read a closed run without a claim either)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "peek_last_run":
            raise AttributeError(name)
        real = getattr(self._inner, name)
        if name not in ("try_acquire", "steal"):
            return real

        async def plain(*args: Any) -> Any:
            claim = await real(*args)
            return None if claim is None else Claim(claim.token, claim.epoch, claim.open)

        return plain


async def test_a_store_whose_claims_lack_it_is_asked_apart(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    await runtime.open()
    await _cancelled_run(runtime, "s-old-cancelled")
    runtime._store = _ClaimsWithoutStatus(runtime._store)
    reads = _count(runtime._store._inner, "run_status")
    with pytest.raises(RunCancelledError):
        async with runtime.session("s-old-cancelled", "u1", resume=True):
            pass
    assert reads == ["run_status"]
