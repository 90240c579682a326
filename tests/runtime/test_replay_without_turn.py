"""A resume of a closed run replays without taking the (session, user) turn.

It reads the lease row and the run's entries in one query; a replay that only hits writes
nothing at all. The turn is taken when the first step has to run: then, if another run held
the turn since the read, the entries are read again (what that run journaled replays), and if
a new run began on the session, or the run was cancelled, the step is refused before its body
runs. On every backend.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from loomflow.errors import (
    OwnershipLostError,
    ReplayDivergenceError,
    RunCancelledError,
    SessionBusyError,
)
from loomflow.runtime import JournalRuntime

Factory = Callable[..., Awaitable[JournalRuntime]]

CLAIMS = ("try_acquire", "try_begin", "steal", "renew", "release")
WRITES = ("write_entry", "begin_run", "put_idempotent")


class Body:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    async def __call__(self, value: Any) -> dict[str, Any]:
        self.calls.append(value)
        return {"value": value, "n": len(self.calls)}


def _count(store: Any, *names: str) -> list[str]:
    """Note each call of the store methods ``names``, in order, in the list returned."""
    calls: list[str] = []
    for name in names:
        real = getattr(store, name)

        async def counted(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return await _real(*args, **kw)

        setattr(store, name, counted)
    return calls


async def _elsewhere(work: Coroutine[Any, Any, Any]) -> Any:
    """Await ``work`` as another worker would: outside the run open in this task (a session
    opened inside a run is a sub-run of it)."""
    return await asyncio.create_task(work, context=contextvars.Context())


async def _finished(runtime: JournalRuntime, body: Body, *values: int, outcome: Any = None) -> None:
    async with runtime.session("s", "u") as run:
        for value in values:
            await runtime.step(f"step_{value}", body, value)
        run.outcome = outcome


async def test_a_replay_that_only_hits_writes_nothing(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    body = Body()
    await _finished(runtime, body, 1, 2)
    [before] = await runtime.sessions(session_id="s")
    calls = _count(runtime._store, *CLAIMS, *WRITES, "load_run", "peek_last_run")
    async with runtime.session("s", "u", resume=True) as run:
        assert await runtime.step("step_1", body, 1) == {"value": 1, "n": 1}
        assert await runtime.step("step_2", body, 2) == {"value": 2, "n": 2}
    assert calls == ["peek_last_run"]  # one read, no claim, no release, no write
    assert (run.epoch, run.stats.hits, run.stats.misses) == (0, 2, 0)
    assert body.calls == [1, 2]
    [after] = await runtime.sessions(session_id="s")
    assert after == before  # the lease row is as the finished run left it
    async with runtime.session("s", "u") as nxt:  # and the next run is the second one
        pass
    assert nxt.epoch == 1


async def test_a_step_that_must_run_takes_the_turn_first(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    body = Body()
    await _finished(runtime, body, 1)
    calls = _count(runtime._store, "try_acquire", "write_entry", "release")
    async with runtime.session("s", "u", resume=True) as run:
        assert calls == []
        await runtime.step("step_1", body, 1)
        assert calls == []
        assert await runtime.step("step_3", body, 3) == {"value": 3, "n": 2}
        assert calls == ["try_acquire", "write_entry"]
    assert calls == ["try_acquire", "write_entry", "release"]
    assert (run.stats.hits, run.stats.misses) == (1, 1)
    [info] = await runtime.sessions(session_id="s")
    assert (info.state, info.epoch, info.owner) == ("finished", 1, None)
    assert [e.name for e in await runtime.entries("s", "u")] == ["step_1", "step_3"]
    async with runtime.session("s", "u", resume=True) as again:  # what it journaled replays
        await runtime.step("step_1", body, 1)
        await runtime.step("step_3", body, 3)
    assert again.stats.hits == 2
    assert body.calls == [1, 3]


async def test_what_a_run_journaled_meanwhile_replays(runtime_factory: Factory) -> None:
    mine, other = await runtime_factory(), await runtime_factory()
    body = Body()
    await _finished(mine, body, 1)
    async with mine.session("s", "u", resume=True) as run:
        await mine.step("step_1", body, 1)

        # Another worker resumes the same run, taking the turn, and journals step_2 first.
        async def journal_step_2() -> None:
            async with other.session("s", "u", resume=True, take_turn=True):
                assert await other.step("step_2", body, 2) == {"value": 2, "n": 2}

        await _elsewhere(journal_step_2())
        # This replay read the journal before that: step_2 was a miss when it looked, but
        # taking the turn shows the turn changed hands, so the entries are read again.
        assert await mine.step("step_2", body, 2) == {"value": 2, "n": 2}
        assert await mine.step("step_3", body, 3) == {"value": 3, "n": 3}
    assert body.calls == [1, 2, 3]  # step_2 ran once
    assert (run.stats.hits, run.stats.misses) == (2, 1)
    assert sorted(e.name for e in await mine.entries("s", "u")) == ["step_1", "step_2", "step_3"]


async def test_a_new_run_begun_meanwhile_refuses_the_step(runtime_factory: Factory) -> None:
    mine, other = await runtime_factory(), await runtime_factory()
    body = Body()
    await _finished(mine, body, 1)
    with pytest.raises(SessionBusyError, match="a new run began"):
        async with mine.session("s", "u", resume=True):
            await mine.step("step_1", body, 1)
            await _elsewhere(_finished(other, body, 1, outcome="interrupted"))  # the next run
            await mine.step("step_2", body, 2)  # would write into a run that is not the last
    assert body.calls == [1, 1]  # step_2 never ran
    [info] = await mine.sessions(session_id="s")
    assert (info.state, info.epoch, info.owner) == ("interrupted", 2, None)  # left as it was
    assert [e.name for e in await mine.entries("s", "u")] == ["step_1", "step_1"]
    async with mine.session("s", "u") as nxt:  # the turn was given back at once
        pass
    assert nxt.epoch == 2


async def test_a_cancel_meanwhile_refuses_the_step(runtime_factory: Factory) -> None:
    mine, other = await runtime_factory(), await runtime_factory()
    body = Body()
    await _finished(mine, body, 1, outcome="interrupted")  # stopped, e.g. for an approval
    with pytest.raises(RunCancelledError):
        async with mine.session("s", "u", resume=True):
            await mine.step("step_1", body, 1)
            assert await _elsewhere(other.cancel("s", "u"))
            await mine.step("step_2", body, 2)
    assert body.calls == [1]
    [info] = await mine.sessions(session_id="s")
    assert (info.state, info.owner) == ("cancelled", None)


async def test_a_resume_waits_while_another_run_holds_the_turn(runtime_factory: Factory) -> None:
    mine, other = await runtime_factory(turn_timeout=0.3), await runtime_factory()
    body = Body()
    await _finished(mine, body, 1)
    holding, done = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with other.session("s", "u", resume=True, take_turn=True):
            holding.set()
            await done.wait()

    holder = asyncio.create_task(hold())  # started outside any run
    await holding.wait()
    try:
        with pytest.raises(SessionBusyError):
            async with mine.session("s", "u", resume=True):
                pass
    finally:
        done.set()
        await holder
    async with mine.session("s", "u", resume=True) as run:
        await mine.step("step_1", body, 1)
    assert run.stats.hits == 1


async def test_parallel_steps_take_the_turn_once(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    body = Body()
    await _finished(runtime, body, 1)
    calls = _count(runtime._store, "try_acquire", "release")
    async with runtime.session("s", "u", resume=True) as run:
        results = await asyncio.gather(
            runtime.step("step_2", body, 2), runtime.step("step_3", body, 3)
        )
    assert sorted(r["value"] for r in results) == [2, 3]
    assert calls == ["try_acquire", "release"]
    assert run.stats.misses == 2
    assert sorted(e.name for e in await runtime.entries("s", "u")) == ["step_1", "step_2", "step_3"]


async def test_take_turn_claims_before_the_block(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    await _finished(runtime, Body(), 1)
    calls = _count(runtime._store, "try_acquire", "peek_last_run", "release")
    async with runtime.session("s", "u", resume=True, take_turn=True):
        assert calls == ["try_acquire"]
        [info] = await runtime.sessions(session_id="s")
        assert info.state == "running"
    assert calls == ["try_acquire", "release"]


async def test_an_open_run_is_resumed_holding_the_turn(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    body = Body()
    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session("s", "u"):
            await runtime.step("step_1", body, 1)
            raise RuntimeError("crash")
    calls = _count(runtime._store, "try_acquire", "load_run")
    async with runtime.session("s", "u", resume=True) as run:
        assert calls == ["try_acquire", "load_run"]
        await runtime.step("step_1", body, 1)
    assert (run.stats.hits, body.calls) == (1, [1])


async def test_a_new_run_reads_no_entries(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    body = Body()
    calls = _count(runtime._store, "load_run")
    async with runtime.session("s", "u") as first:  # a session never seen
        await runtime.step("step_1", body, 1)
    async with runtime.session("s", "u") as second:  # the next run of a closed session
        await runtime.step("step_1", body, 1)
    assert calls == []
    assert (first.resumed, second.resumed, body.calls) == (False, False, [1, 1])


# -- edges a review found ----------------------------------------------------------------------


async def test_a_step_still_running_after_the_block_cannot_take_the_turn(
    runtime_factory: Factory,
) -> None:
    """A parallel step the block did not wait for (gather does not cancel siblings) must not
    take the turn after the block: nobody would be left to give it back."""
    runtime = await runtime_factory(strict_replay=True)
    await _finished(runtime, Body(), 1, 2)
    late: list[asyncio.Task[Any]] = []
    with pytest.raises(ReplayDivergenceError):
        async with runtime.session("s", "u", resume=True) as run:
            await runtime.step("step_1", Body(), 1)
            late.append(asyncio.create_task(runtime.step("step_3", Body(), 3)))
            await runtime.step("step_2", Body(), 99)  # diverges: strict, so the block raises
    with pytest.raises(OwnershipLostError, match="block has ended"):
        await late[0]
    assert not run.claimed
    assert run.heartbeat is None
    [info] = await runtime.sessions(session_id="s")
    assert info.owner is None  # the turn is free: another worker gets it at once
    async with (await runtime_factory()).session("s", "u", resume=True, take_turn=True):
        pass


async def test_an_idempotent_step_runs_once_when_two_resumes_race(
    runtime_factory: Factory,
) -> None:
    first, second = await runtime_factory(), await runtime_factory()
    await _finished(first, Body(), 1)
    charges: list[int] = []
    both_read = asyncio.Barrier(2)

    async def charge() -> str:
        charges.append(1)
        await asyncio.sleep(0.2)
        return "charged"

    async def resume(runtime: JournalRuntime) -> Any:
        async with runtime.session("s", "u", resume=True):
            await both_read.wait()  # both have read the closed run before either steps
            await runtime.step("step_1", Body(), 1)
            return await runtime.step("charge", charge, idempotency_key="order-42")

    results = await asyncio.gather(_elsewhere(resume(first)), _elsewhere(resume(second)))
    assert results == ["charged", "charged"]
    assert charges == [1]


async def test_a_replay_that_completes_a_stopped_run_records_its_end(
    runtime_factory: Factory,
) -> None:
    """A resume that ran the rest of a stopped run and then failed late leaves it stopped;
    the next resume, all hits, must record that the run completed."""
    runtime = await runtime_factory()
    await _finished(runtime, Body(), 1, outcome="interrupted")
    with pytest.raises(OSError, match="late"):
        async with runtime.session("s", "u", resume=True):
            await runtime.step("step_1", Body(), 1)
            await runtime.step("step_2", Body(), 2)
            raise OSError("a late failure, after the last step")
    async with runtime.session("s", "u", resume=True) as run:
        await runtime.step("step_1", Body(), 1)
        await runtime.step("step_2", Body(), 2)
    assert run.stats.misses == 0
    [info] = await runtime.sessions(session_id="s")
    assert (info.state, info.owner) == ("finished", None)
    assert await runtime.cancel("s", "u") is False  # a finished run is not cancellable
    # An interrupted run replayed to the same interruption writes nothing.
    await _finished(runtime, Body(), 5, outcome="interrupted")
    calls = _count(runtime._store, "try_acquire", "release")
    async with runtime.session("s", "u", resume=True) as again:
        await runtime.step("step_5", Body(), 5)
        again.outcome = "interrupted"
    assert calls == []


async def test_a_cancel_in_this_process_stops_a_replay(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    await _finished(runtime, Body(), 1, outcome="interrupted")
    with pytest.raises(RunCancelledError):
        async with runtime.session("s", "u", resume=True):
            await runtime.step("step_1", Body(), 1)
            assert await runtime.cancel("s", "u") is True
    [info] = await runtime.sessions(session_id="s")
    assert info.state == "cancelled"
