"""One conformance suite for every journal backend.

Subclass :class:`JournalConformance` in a test module and provide a ``make_runtime`` fixture:
an async factory whose every call returns a new runtime over the *same* storage (as a second
worker process would see it). Every test here then runs against that backend::

    class TestMyBackend(JournalConformance):
        @pytest.fixture
        async def make_runtime(self):
            runtimes = []
            async def factory(**options):
                rt = MyRuntime(DSN, **options)
                runtimes.append(rt)
                return rt
            yield factory
            for rt in runtimes:
                await rt.close()

Its tests and fixtures are ``async def`` without a marker: run them with pytest-asyncio in
auto mode (``asyncio_mode = "auto"`` under ``[tool.pytest.ini_options]``, or
``-o asyncio_mode=auto``), as this repository does. In pytest-asyncio's default strict mode
each test errors with "requested an async fixture ... with no plugin or hook that handled it".
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from .. import errors
from ..runtime import RunRecord, _journal, codec, decode_record
from ..runtime._journal import JournalRuntime, PickledEntryWarning
from ..runtime._store import Scope, StoredEntry, path_key

__all__ = ["JournalConformance", "RuntimeFactory"]

RuntimeFactory = Callable[..., Awaitable[JournalRuntime]]


class Counter:
    """A step body that counts its executions and echoes its inputs."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def __call__(self, *args: Any) -> dict[str, Any]:
        self.calls.append(args)
        return {"args": list(args), "n": len(self.calls)}


async def _raise_in_run(
    runtime: JournalRuntime, session: str, user: str | None, body: Callable[[], Awaitable[Any]]
) -> None:
    """Run ``body`` inside a run that then fails, leaving the run open."""
    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session(session, user):
            await body()
            raise RuntimeError("crash")


class JournalConformance:
    """Behaviour every journal backend must show (see the module docstring)."""

    @pytest.fixture
    async def runtime(self, make_runtime: RuntimeFactory) -> JournalRuntime:
        return await make_runtime()

    # -- hit, miss, inputs ---------------------------------------------------------------

    async def test_miss_then_hit_within_an_open_run(self, runtime: JournalRuntime) -> None:
        body = Counter()

        async def two_steps() -> None:
            assert await runtime.step("a", body, 1) == {"args": [1], "n": 1}
            assert await runtime.step("b", body, 2) == {"args": [2], "n": 2}

        await _raise_in_run(runtime, "s", "u", two_steps)
        async with runtime.session("s", "u") as run:
            assert await runtime.step("a", body, 1) == {"args": [1], "n": 1}
            assert await runtime.step("b", body, 2) == {"args": [2], "n": 2}
            assert await runtime.step("c", body, 3) == {"args": [3], "n": 3}
        assert len(body.calls) == 3
        assert (run.stats.hits, run.stats.misses) == (2, 1)
        assert run.stats.hit_steps == ["a", "b"]
        assert run.stats.fresh_steps == ["c"]

    async def test_changed_inputs_run_fresh_and_count_a_divergence(
        self, runtime: JournalRuntime
    ) -> None:
        body = Counter()
        await _raise_in_run(runtime, "s", "u", lambda: runtime.step("a", body, "old prompt"))
        async with runtime.session("s", "u") as run:
            result = await runtime.step("a", body, "new prompt")
        assert result == {"args": ["new prompt"], "n": 2}
        assert run.stats.divergences == 1
        assert run.stats.misses == 1

    async def test_strict_replay_raises_on_divergence(self, runtime: JournalRuntime) -> None:
        body = Counter()
        await _raise_in_run(runtime, "s", "u", lambda: runtime.step("a", body, 1))
        with pytest.raises(errors.ReplayDivergenceError, match="'a'"):
            async with runtime.session("s", "u", strict_replay=True):
                await runtime.step("a", body, 2)
        assert len(body.calls) == 1

    async def test_strict_mode_from_the_runtime_option(self, make_runtime: RuntimeFactory) -> None:
        runtime = await make_runtime(strict_replay=True)
        body = Counter()
        await _raise_in_run(runtime, "s", "u", lambda: runtime.step("a", body, 1))
        with pytest.raises(errors.ReplayDivergenceError):
            async with runtime.session("s", "u"):
                await runtime.step("a", body, 2)

    async def test_kwargs_and_rich_values_fingerprint_stably(self, runtime: JournalRuntime) -> None:
        body_calls = 0

        async def body(*, items: set[int], when: Any) -> tuple[int, ...]:
            nonlocal body_calls
            body_calls += 1
            return tuple(sorted(items))

        import datetime as dt

        when = dt.datetime(2026, 5, 8, 12, 0, tzinfo=dt.UTC)
        await _raise_in_run(
            runtime, "s", "u", lambda: runtime.step("a", body, items={3, 1, 2}, when=when)
        )
        async with runtime.session("s", "u"):
            replayed = await runtime.step("a", body, items={2, 3, 1}, when=when)
        assert replayed == (1, 2, 3)
        assert body_calls == 1

    # -- epochs ------------------------------------------------------------------------------

    async def test_finished_run_never_replays_into_the_next(self, runtime: JournalRuntime) -> None:
        body = Counter()
        async with runtime.session("s", "u") as first:
            await runtime.step("charge", body, 7)
        async with runtime.session("s", "u") as second:
            await runtime.step("charge", body, 7)
        assert len(body.calls) == 2
        assert second.epoch == first.epoch + 1
        assert second.stats.divergences == 0

    async def test_raised_run_stays_open_and_replays(self, runtime: JournalRuntime) -> None:
        body = Counter()
        await _raise_in_run(runtime, "s", "u", lambda: runtime.step("charge", body, 7))
        async with runtime.session("s", "u") as run:
            await runtime.step("charge", body, 7)
        assert len(body.calls) == 1
        assert run.epoch == 0
        assert run.resumed
        async with runtime.session("s", "u") as later:
            assert later.epoch == 1

    async def test_cancelled_run_stays_open(self, runtime: JournalRuntime) -> None:
        body = Counter()
        entered = asyncio.Event()

        async def run_forever() -> None:
            async with runtime.session("s", "u"):
                await runtime.step("a", body, 1)
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(run_forever())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with runtime.session("s", "u") as run:
            await runtime.step("a", body, 1)
        assert len(body.calls) == 1
        assert run.epoch == 0

    async def test_resume_continues_the_last_finished_run(self, runtime: JournalRuntime) -> None:
        body = Counter()
        async with runtime.session("s", "u"):
            await runtime.step("a", body, 1)
            await runtime.step("b", body, 2)
        async with runtime.session("s", "u", resume=True) as resumed:
            await runtime.step("a", body, 1)
            await runtime.step("b", body, 2)
        assert len(body.calls) == 2
        assert resumed.epoch == 0
        assert resumed.stats.hits == 2
        # Resuming did not open a new epoch: the next run is the second one.
        async with runtime.session("s", "u") as nxt:
            await runtime.step("a", body, 1)
        assert nxt.epoch == 1
        assert len(body.calls) == 3

    async def test_resume_continues_an_open_run(self, runtime: JournalRuntime) -> None:
        body = Counter()
        async with runtime.session("s", "u"):
            await runtime.step("a", body, 1)
        await _raise_in_run(runtime, "s", "u", lambda: runtime.step("a", body, 1))
        async with runtime.session("s", "u", resume=True) as run:
            await runtime.step("a", body, 1)
        assert run.epoch == 1
        assert len(body.calls) == 2

    async def test_resume_of_an_unknown_session_runs_fresh(self, runtime: JournalRuntime) -> None:
        body = Counter()
        async with runtime.session("never-seen", "u", resume=True) as run:
            await runtime.step("a", body, 1)
        assert run.epoch == 0
        assert len(body.calls) == 1

    async def test_a_new_session_is_opened_by_one_worker_only(
        self, make_runtime: RuntimeFactory
    ) -> None:
        # A fork's session (new_session=True): of workers opening one new session id at
        # once, one opens it and the others are refused, checked and claimed in one write.
        first, second = await make_runtime(), await make_runtime()
        counter = Counter()

        async def fork(runtime: JournalRuntime) -> str:
            async with runtime.session("fork-1", "u", new_session=True):
                await runtime.step("work", counter, 1)
            return "forked"

        outcomes = await asyncio.gather(fork(first), fork(second), return_exceptions=True)
        assert sorted(map(str, outcomes)).count("forked") == 1, outcomes
        [refused] = [o for o in outcomes if isinstance(o, BaseException)]
        assert isinstance(refused, errors.SessionExistsError), refused
        assert "already has runs" in str(refused)
        assert counter.calls == [(1,)]
        # Also once the first has finished; another user's session of that id is new.
        with pytest.raises(errors.SessionExistsError):
            await fork(second)
        async with second.session("fork-1", "v", new_session=True):
            pass
        [info] = await first.sessions(session_id="fork-1", user_id="u")
        assert info.epoch == 1  # one run

    async def test_epochs_survive_a_new_runtime(self, make_runtime: RuntimeFactory) -> None:
        first, second = await make_runtime(), await make_runtime()
        body = Counter()
        async with first.session("s", "u"):
            await first.step("a", body, 1)
        await _raise_in_run(first, "s", "u", lambda: first.step("a", body, 1))
        async with second.session("s", "u") as run:
            await second.step("a", body, 1)
        assert run.epoch == 1
        assert len(body.calls) == 2

    # -- scoping -----------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("user_a", "user_b"),
        [
            ("alice", "bob"),
            ("alice", None),
            (None, "None"),
            (" ", None),
            ('a","b', "a"),
            ('["s","u"]', "u"),
            ("a:b", "a"),
            ("a\\u0000b", "a"),
        ],
    )
    async def test_another_user_on_the_same_session_replays_nothing(
        self, runtime: JournalRuntime, user_a: str | None, user_b: str | None
    ) -> None:
        body = Counter()
        await _raise_in_run(runtime, "shared", user_a, lambda: runtime.step("charge", body, 7))
        async with runtime.session("shared", user_b) as run:
            await runtime.step("charge", body, 7)
        assert len(body.calls) == 2
        assert run.stats.hits == 0
        assert run.epoch == 0

    async def test_session_ids_chosen_to_collide_stay_apart(self, runtime: JournalRuntime) -> None:
        body = Counter()
        await _raise_in_run(runtime, 'x","y', "z", lambda: runtime.step("a", body))
        async with runtime.session("x", 'y","z') as run:
            await runtime.step("a", body)
        assert run.stats.hits == 0
        assert len(body.calls) == 2

    async def test_subruns_key_steps_under_the_enclosing_run(self, runtime: JournalRuntime) -> None:
        body = Counter()

        async def worker_twice() -> None:
            with runtime.subrun("worker") as path:
                assert path == ("worker#0",)
                await runtime.step("tool_call_0_0", body, "x")
            with runtime.subrun("worker") as path:
                assert path == ("worker#1",)
                await runtime.step("tool_call_0_0", body, "x")

        await _raise_in_run(runtime, "s", "u", worker_twice)
        assert len(body.calls) == 2
        async with runtime.session("s", "u") as run:
            await worker_twice()
        assert len(body.calls) == 2
        assert run.stats.hits == 2

    async def test_nested_session_is_a_subrun(self, runtime: JournalRuntime) -> None:
        body = Counter()

        async def outer() -> None:
            async with runtime.session("inner-session", "u") as inner:
                await runtime.step("a", body, 1)
                assert inner is runtime.current_run

        await _raise_in_run(runtime, "s", "u", outer)
        async with runtime.session("s", "u") as run:
            await outer()
        assert len(body.calls) == 1
        assert run.stats.hits == 1

    async def test_ids_and_names_no_backend_can_store_are_typed_errors(
        self, runtime: JournalRuntime
    ) -> None:
        with pytest.raises(errors.UserError, match="user_id"):
            async with runtime.session("s", "a\x00b"):
                pass
        with pytest.raises(errors.UserError, match="session_id"):
            async with runtime.session(42, "u"):  # type: ignore[arg-type]
                pass
        async with runtime.session("s", "u"):
            with pytest.raises(errors.UserError, match="step name"):
                await runtime.step("", Counter())
            with pytest.raises(errors.UserError, match="idempotency_key"):
                await runtime.step("a", Counter(), idempotency_key="k\x00")

    async def test_step_outside_a_run_is_a_typed_error(self, runtime: JournalRuntime) -> None:
        with pytest.raises(errors.NoActiveRunError, match="session"):
            await runtime.step("a", Counter(), 1)
        with pytest.raises(errors.NoActiveRunError), runtime.subrun("w"):
            pass

    # -- idempotency keys ----------------------------------------------------------------

    async def test_idempotency_keys_dedupe_across_names_and_sessions(
        self, runtime: JournalRuntime
    ) -> None:
        body = Counter()
        async with runtime.session("s1", "u"):
            first = await runtime.step("charge", body, 7, idempotency_key="order-1")
        async with runtime.session("s2", "u"):
            again = await runtime.step(
                "refund-named-differently", body, 99, idempotency_key="order-1"
            )
        assert again == first
        assert len(body.calls) == 1

    async def test_idempotency_keys_are_scoped_per_user(self, runtime: JournalRuntime) -> None:
        body = Counter()
        async with runtime.session("s", "alice"):
            await runtime.step("charge", body, 7, idempotency_key="order-1")
        async with runtime.session("s", "bob"):
            await runtime.step("charge", body, 7, idempotency_key="order-1")
        async with runtime.session("s", None):
            await runtime.step("charge", body, 7, idempotency_key="order-1")
        assert len(body.calls) == 3

    async def test_idempotency_results_are_listed_per_user_and_forgotten(
        self, runtime: JournalRuntime
    ) -> None:
        body = Counter()
        async with runtime.session("s1", "alice"):
            await runtime.step("charge", body, 7, idempotency_key="order-1")
        async with runtime.session("s2", "alice"):
            await runtime.step("refund", body, 8, idempotency_key="order-2")
        async with runtime.session("s3", "bob"):
            await runtime.step("charge", body, 9, idempotency_key="order-1")
        async with runtime.session("s4", None):
            await runtime.step("charge", body, 10, idempotency_key="anon-1")
        alice = await runtime.idempotency_results("alice")
        assert alice is not None  # every backend here lists them
        assert [(i.user_id, i.key, i.session_id, i.name, i.kind) for i in alice] == [
            ("alice", "order-1", "s1", "charge", "step"),
            ("alice", "order-2", "s2", "refund", "step"),
        ]
        assert all(i.size > 0 and i.created_at > 0 for i in alice)
        anonymous = await runtime.idempotency_results(None)
        assert [(i.user_id, i.key, i.session_id) for i in anonymous or []] == [
            (None, "anon-1", "s4")
        ]
        await runtime.forget_user("alice")
        assert await runtime.idempotency_results("alice") == []
        assert [i.key for i in await runtime.idempotency_results("bob") or []] == ["order-1"]

    # -- streams -----------------------------------------------------------------------------

    async def test_streams_replay_their_chunks_in_order(self, runtime: JournalRuntime) -> None:
        produced = 0

        async def chunks(n: int) -> AsyncIterator[str]:
            nonlocal produced
            for i in range(n):
                produced += 1
                yield f"chunk-{i}"

        async def consume() -> list[str]:
            return [c async for c in runtime.stream_step("model_call_0", chunks, 5)]

        await _raise_in_run(runtime, "s", "u", consume)
        async with runtime.session("s", "u") as run:
            replayed = await consume()
        assert replayed == [f"chunk-{i}" for i in range(5)]
        assert produced == 5
        assert run.stats.hits == 1

    async def test_abandoned_or_failed_stream_is_not_recorded(
        self, runtime: JournalRuntime
    ) -> None:
        produced = 0

        async def chunks(fail: bool) -> AsyncIterator[int]:
            nonlocal produced
            for i in range(3):
                produced += 1
                yield i
            if fail:
                raise ValueError("provider hung up")

        async def abandon_then_fail() -> None:
            stream = runtime.stream_step("s_abandon", chunks, False)
            async for _ in stream:
                break
            await stream.aclose()  # type: ignore[attr-defined]
            with pytest.raises(ValueError, match="hung up"):
                async for _ in runtime.stream_step("s_fail", chunks, True):
                    pass

        await _raise_in_run(runtime, "s", "u", abandon_then_fail)
        assert await runtime.entries("s", "u") == []
        async with runtime.session("s", "u") as run:
            assert [c async for c in runtime.stream_step("s_abandon", chunks, False)] == [0, 1, 2]
        assert run.stats.hits == 0

    # -- turn-taking ---------------------------------------------------------------------

    async def test_concurrent_runs_on_one_session_take_turns(
        self, make_runtime: RuntimeFactory
    ) -> None:
        # Two runtimes over one store stand for two processes; each also runs two tasks.
        runtimes = [await make_runtime(), await make_runtime()]
        timeline: list[tuple[str, int]] = []

        async def one_run(rt: JournalRuntime, label: str) -> None:
            async with rt.session("s", "u"):
                for i in range(3):

                    async def mark(i: int = i) -> int:
                        timeline.append((label, i))
                        await asyncio.sleep(0.005)
                        return i

                    await rt.step(f"step_{i}", mark)

        await asyncio.gather(
            *(one_run(rt, f"{n}-{t}") for n, rt in enumerate(runtimes) for t in range(2))
        )
        labels = [label for label, _ in timeline]
        assert len(labels) == 12
        for start in range(0, 12, 3):  # every run's three steps are contiguous
            assert len(set(labels[start : start + 3])) == 1

    async def test_waiting_too_long_is_a_typed_error(self, make_runtime: RuntimeFactory) -> None:
        holder = await make_runtime()
        waiter = await make_runtime(turn_timeout=0.2)
        release = asyncio.Event()
        entered = asyncio.Event()

        async def hold() -> None:
            async with holder.session("s", "u"):
                entered.set()
                await release.wait()

        task = asyncio.create_task(hold())
        await entered.wait()
        try:
            with pytest.raises(errors.SessionBusyError, match="'s'"):
                async with waiter.session("s", "u"):
                    pass
            # Other users of the same session are not blocked.
            async with waiter.session("s", "someone-else"):
                pass
        finally:
            release.set()
            await task

    async def test_a_fenced_out_run_cannot_write(self, make_runtime: RuntimeFactory) -> None:
        old, new = await make_runtime(), await make_runtime()
        await new.open()
        body = Counter()
        with pytest.raises(errors.OwnershipLostError):
            async with old.session("s", "u") as run:
                await old.step("a", body, 1)
                holder = await new._store.holder(run.scope)
                assert holder is not None
                # A newer owner takes the turn (as after an expired lease).
                claim = await new._store.steal(run.scope, holder[1], "newer-owner", 30.0)
                assert claim is not None
                assert claim.token > run.token
                await old.step("b", body, 2)
        assert len(body.calls) == 2  # the body ran, but its result was not journaled
        assert [e.name for e in await new.entries("s", "u")] == ["a"]

    async def test_a_fenced_out_run_cannot_rewrite_an_entry(
        self, make_runtime: RuntimeFactory
    ) -> None:
        # Over a position that already holds an entry, a stale token writes nothing either.
        old, new = await make_runtime(), await make_runtime()
        await new.open()
        body = Counter()
        with pytest.raises(RuntimeError, match="kept open"):
            async with old.session("s", "u") as run:
                await old.step("a", body, 1)
                [(stored_fp, entry)] = run.entries[(path_key(()), "a")].items()
                holder = await new._store.holder(run.scope)
                assert holder is not None
                assert await new._store.steal(run.scope, holder[1], "newer-owner", 30.0)
                forged = StoredEntry(
                    entry.path, "a", stored_fp, "step", "json", codec.CODEC_VERSION, b'"forged"'
                )
                assert not await old._store.write_entry(run.scope, run.token, run.epoch, forged)
                raise RuntimeError("kept open")
        rows = await new._store.load_run(run.scope, run.epoch)
        assert [(r.name, r.value) for r in rows] == [("a", entry.value)]

    # -- run states, cancel, orphan claims ------------------------------------------------

    async def test_run_states_follow_the_run(self, make_runtime: RuntimeFactory) -> None:
        runtime = await make_runtime()
        record = RunRecord("agent-a", "f" * 64, {"prompt": "p"})

        async def state() -> str:
            [info] = await runtime.sessions(session_id="s")
            return info.state

        async with runtime.session("s", "u", record=record):
            assert await state() == "running"
        assert await state() == "finished"
        with pytest.raises(RuntimeError):
            async with runtime.session("s", "u", record=record):
                raise RuntimeError("raised to its caller")
        assert await state() == "open"
        [info] = await runtime.sessions(state="open")
        assert (info.agent, info.config, info.attempts) == ("agent-a", "f" * 64, 0)
        assert await runtime.orphans() == []  # raised, not orphaned: nothing retries it
        assert await runtime.cancel("s", "u") is True
        assert await state() == "cancelled"
        assert await runtime.cancel("s", "u") is False
        counts = await runtime.count_states()
        assert counts["cancelled"] == 1
        assert sum(counts.values()) == 1
        # A new run of the session (here one without a record) starts with a clean slate.
        with pytest.raises(RuntimeError):
            async with runtime.session("s", "u"):
                assert await state() == "running"
                raise RuntimeError("raised again")
        assert await state() == "open"
        [info] = await runtime.sessions()
        assert (info.agent, info.config) == (None, None)

    async def test_a_stopped_run_is_open_again_while_a_resume_runs_its_steps(
        self, make_runtime: RuntimeFactory
    ) -> None:
        runtime = await make_runtime()
        record = RunRecord(agent="agent-a", config="f" * 64, inputs={"prompt": "p"})
        async with runtime.session("s", "u", record=record) as run:
            await runtime.step("a", Counter(), 1)
            run.outcome = "interrupted"  # as an agent stopped to wait for approval
        [stopped] = await runtime.sessions()
        assert (stopped.state, stopped.open, stopped.epoch) == ("interrupted", False, 1)
        async with runtime.session("s", "u", resume=True) as run:
            replayed = Counter()
            await runtime.step("a", replayed, 1)
            assert replayed.calls == []  # replayed: nothing written
            [still] = await runtime.sessions()
            assert (still.open, still.epoch) == (False, 1)
            await runtime.step("b", Counter(), 2)  # a body runs: the run is open again
            [going] = await runtime.sessions()
            assert (going.state, going.open, going.epoch) == ("running", True, 0)
            assert going.agent == "agent-a"  # its record stays, for a recoverer
        [done] = await runtime.sessions()
        assert (done.state, done.open, done.epoch) == ("finished", False, 1)
        assert [e.name for e in await runtime.entries("s", "u")] == ["a", "b"]

    async def test_an_interrupted_run_can_be_cancelled_and_is_not_resumed(
        self, make_runtime: RuntimeFactory
    ) -> None:
        runtime = await make_runtime()

        async def state() -> str:
            [info] = await runtime.sessions(session_id="s")
            return info.state

        async with runtime.session("s", "u") as run:
            await runtime.step("a", Counter(), 1)
            run.outcome = "interrupted"  # as an agent stopped to wait for approval
        [before] = await runtime.sessions()
        # A write that leaves the run as it was (a decision journaled, not resumed).
        async with runtime.session("s", "u", resume=True) as run:
            run.keep_state = True
            await runtime.step("b", Counter(), 2)
        assert await state() == "interrupted"
        assert await runtime.cancel("s", "u") is True
        assert await state() == "cancelled"
        [after] = await runtime.sessions()
        assert (after.epoch, after.open) == (before.epoch, False)  # closed already: no new epoch
        assert await runtime.cancel("s", "u") is False
        with pytest.raises(errors.RunCancelledError):
            async with runtime.session("s", "u", resume=True):
                pass
        assert await state() == "cancelled"
        assert [e.name for e in await runtime.entries("s", "u")] == ["a", "b"]
        # A finished run is not cancellable.
        async with runtime.session("s", "u"):
            pass
        assert await runtime.cancel("s", "u") is False
        assert await state() == "finished"

    async def test_a_cancelled_run_is_fenced_out_with_a_typed_error(
        self, make_runtime: RuntimeFactory
    ) -> None:
        old, canceller = await make_runtime(), await make_runtime()
        body = Counter()
        with pytest.raises(errors.RunCancelledError):
            async with old.session("s", "u"):
                await old.step("a", body, 1)
                assert await canceller.cancel("s", "u") is True
                await old.step("b", body, 2)
        assert len(body.calls) == 2  # the step under way ran; its result was refused
        assert [e.name for e in await canceller.entries("s", "u")] == ["a"]

    async def test_only_one_claim_on_an_orphan_wins(self, make_runtime: RuntimeFactory) -> None:
        first, second = await make_runtime(), await make_runtime()
        record = RunRecord("agent-a", "f" * 64, {"prompt": "p"})
        with pytest.raises(RuntimeError):
            async with first.session("s", "u", record=record):
                raise RuntimeError("crash stand-in")
        assert await first.orphans() == []
        # A worker takes the run and dies: its lease runs out at once.
        scope_holder = await first._store.try_acquire(
            Scope("s", "u"), "0:1:gone:owner", 0.001
        )  # a holder whose lease runs out at once
        assert scope_holder is not None
        await asyncio.sleep(0.05)
        [orphan] = await first.orphans()
        assert (orphan.agent, decode_record(orphan.record)) == ("agent-a", {"prompt": "p"})
        claims = await asyncio.gather(
            first.claim_orphan(orphan, backoff=0), second.claim_orphan(orphan, backoff=0)
        )
        winners = [c for c in claims if c is not None]
        assert len(winners) == 1
        assert winners[0].attempts == 1
        async with first.adopt(winners[0]):
            pass  # nobody took the turn over: leaving gives the claim back
        [info] = await first.sessions()
        assert (info.owner, info.attempts) == (None, 1)
        # True or False, never anything else: a recoverer must know what was given back.
        assert await first.requeue("s", "u") is True
        assert await first.requeue("nobody", "u") is False

    async def test_a_claim_taken_over_fences_out_the_recoverers_resume(
        self, make_runtime: RuntimeFactory
    ) -> None:
        # A recoverer stopped past its claim's lease, while another owner resumed the run
        # and finished it: its resume must not replay the finished run as if it recovered it.
        recoverer = await make_runtime(lease_seconds=0.2)
        other = await make_runtime()
        body = Counter()
        with pytest.raises(RuntimeError):
            async with recoverer.session("s", "u", record=RunRecord("a", "f" * 64, {})):
                await recoverer.step("a", body, 1)
                raise RuntimeError("crash stand-in")
        gone = await recoverer._store.try_acquire(Scope("s", "u"), "0:1:gone:owner", 0.001)
        assert gone is not None
        await asyncio.sleep(0.05)
        [orphan] = await recoverer.orphans()
        claim = await recoverer.claim_orphan(orphan, backoff=0)
        assert claim is not None
        async with other.session("s", "u", resume=True):  # after the claim's lease
            await other.step("a", body, 1)
            await other.step("b", body, 2)
        async with recoverer.adopt(claim):
            with pytest.raises(errors.OwnershipLostError):
                async with recoverer.session("s", "u", resume=True):
                    await recoverer.step("a", body, 1)
        assert len(body.calls) == 2  # a, once, and b by the other owner
        [info] = await other.sessions()
        assert info.state == "finished"

    # -- values --------------------------------------------------------------------------

    async def test_payload_cap_is_a_clear_error(self, make_runtime: RuntimeFactory) -> None:
        runtime = await make_runtime(max_payload_bytes=1000)
        calls = 0

        async def big() -> str:
            nonlocal calls
            calls += 1
            return "x" * 5000

        with pytest.raises(errors.PayloadTooLargeError, match=r"'big'.*5002 bytes"):
            async with runtime.session("s", "u"):
                await runtime.step("big", big)
        assert calls == 1
        assert await runtime.entries("s", "u") == []

    async def test_unencodable_values_name_the_step_and_type(self, runtime: JournalRuntime) -> None:
        async def returns_object() -> object:
            return object()

        with pytest.raises(errors.JournalEncodeError, match=r"'weird': its result.*'object'"):
            async with runtime.session("s", "u"):
                await runtime.step("weird", returns_object)
        with pytest.raises(errors.JournalEncodeError, match="'args': its arguments"):
            async with runtime.session("s", "u"):
                await runtime.step("args", Counter(), object())

    async def test_pickled_rows_are_skipped_with_exactly_one_warning(
        self, make_runtime: RuntimeFactory
    ) -> None:
        runtime = await make_runtime()
        body = Counter()
        legacy = _pickle_bytes({"legacy": True})

        async def plant() -> None:
            run = runtime.current_run
            assert run is not None
            for name in ("a", "b"):
                fp = _fingerprint_of((1,))
                entry = StoredEntry(path_key(()), name, fp, "step", "pickle", 0, legacy)
                assert await runtime._store.write_entry(run.scope, run.token, run.epoch, entry)

        await _raise_in_run(runtime, "s", "u", plant)
        _journal._pickle_warned = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with runtime.session("s", "u", resume=True) as run:
                await runtime.step("a", body, 1)
                await runtime.step("b", body, 1)
        pickled = [w for w in caught if issubclass(w.category, PickledEntryWarning)]
        assert len(pickled) == 1
        assert len(body.calls) == 2
        assert run.stats.hits == 0

        opted_in = await make_runtime(serializer="pickle")
        await _raise_in_run(opted_in, "s2", "u", lambda: _plant_pickle(opted_in, legacy))
        async with opted_in.session("s2", "u") as run:
            assert await opted_in.step("a", body, 1) == {"legacy": True}
        assert run.stats.hits == 1

    @pytest.mark.parametrize(
        "raw",
        [
            b"{not json",
            b'{"$t":"no-such-tag","v":1}',
            b'{"$t":"model","v":{"cls":"nowhere:Missing","fields":[]}}',
            b"[" * 200_000 + b"]" * 200_000,  # nesting that would exhaust the recursion limit
            b"\xff\xfe",
        ],
    )
    async def test_corrupt_rows_rerun_the_step_and_strict_mode_raises(
        self, runtime: JournalRuntime, raw: bytes
    ) -> None:
        body = Counter()

        async def plant() -> None:
            run = runtime.current_run
            assert run is not None
            entry = StoredEntry(
                path_key(()), "a", _fingerprint_of((1,)), "step", "json", codec.CODEC_VERSION, raw
            )
            assert await runtime._store.write_entry(run.scope, run.token, run.epoch, entry)

        await _raise_in_run(runtime, "s", "u", plant)
        with pytest.raises(errors.CorruptEntryError, match="'a'"):
            async with runtime.session("s", "u", strict_replay=True):
                await runtime.step("a", body, 1)
        assert body.calls == []
        with pytest.raises(RuntimeError, match="crash"):
            async with runtime.session("s", "u") as run:
                assert await runtime.step("a", body, 1) == {"args": [1], "n": 1}
                raise RuntimeError("crash")
        assert run.stats.corrupt == 1
        # The fresh result replaced the corrupt row.
        async with runtime.session("s", "u") as run:
            assert await runtime.step("a", body, 1) == {"args": [1], "n": 1}
        assert run.stats.hits == 1
        assert len(body.calls) == 1

    # -- maintenance -----------------------------------------------------------------------

    async def test_prune_keeps_open_runs_unless_asked(self, runtime: JournalRuntime) -> None:
        body = Counter()
        async with runtime.session("done", "u"):
            await runtime.step("a", body, 1)
        await _raise_in_run(runtime, "open", "u", lambda: runtime.step("a", body, 1))
        assert await runtime.prune() == 1
        assert await runtime.entries("done", "u") == []
        assert len(await runtime.entries("open", "u")) == 1
        async with runtime.session("open", "u") as run:  # still resumable
            await runtime.step("a", body, 1)
        assert run.stats.hits == 1
        await _raise_in_run(runtime, "open2", "u", lambda: runtime.step("a", body, 1))
        assert await runtime.prune(include_open=True) >= 1
        assert await runtime.entries("open2", "u") == []

    async def test_prune_by_session_user_and_age(self, runtime: JournalRuntime) -> None:
        import datetime as dt

        body = Counter()
        for session, user in [("s1", "alice"), ("s1", "bob"), ("s2", "alice"), ("s2", None)]:
            async with runtime.session(session, user):
                await runtime.step("a", body, 1)
        assert await runtime.prune(older_than=dt.timedelta(hours=1)) == 0
        assert await runtime.prune(session_id="s1", user_id="bob") == 1
        assert await runtime.prune(user_id=None) == 1
        assert len(await runtime.entries("s1", "alice")) == 1
        assert await runtime.prune(session_id="s1") == 1
        assert await runtime.prune(older_than=dt.timedelta(seconds=0)) == 1
        assert await runtime.entries("s2", "alice") == []

    async def test_prune_deletes_in_batches_and_reports_progress(
        self, runtime: JournalRuntime
    ) -> None:
        body = Counter()
        async with runtime.session("done", "u"):
            for i in range(5):
                await runtime.step(f"s{i}", body, i)
        await _raise_in_run(runtime, "open", "u", lambda: runtime.step("a", body, 1))
        calls: list[tuple[int, int | None]] = []
        assert await runtime.prune(dry_run=True) == 5  # counted, nothing deleted
        assert len(await runtime.entries("done", "u")) == 5
        deleted = await runtime.prune(
            batch_size=2, on_progress=lambda done, total: calls.append((done, total))
        )
        assert deleted == 5
        assert calls == [(0, 5), (2, 5), (4, 5), (5, 5)]  # counted, then batch by batch
        assert len(await runtime.entries("open", "u")) == 1
        with pytest.raises(errors.UserError, match="batch_size"):
            await runtime.prune(batch_size=0)

    async def test_sessions_are_listed_newest_first(self, runtime: JournalRuntime) -> None:
        body = Counter()
        async with runtime.session("older", "alice"):
            await runtime.step("a", body, 1)
        await _raise_in_run(runtime, "newer", "alice", lambda: runtime.step("a", body, 1))
        async with runtime.session("other", "bob"):
            await runtime.step("a", body, 1)
            await runtime.step("b", body, 2)
        alice = await runtime.sessions(user_id="alice")
        assert [(s.session_id, s.epoch, s.open, s.entries) for s in alice] == [
            ("newer", 0, True, 1),
            ("older", 1, False, 1),
        ]
        assert all(s.owner is None for s in alice)
        everyone = await runtime.sessions()
        assert {s.user_id for s in everyone} == {"alice", "bob"}
        assert len(await runtime.sessions(limit=1)) == 1

    async def test_entries_describe_the_journal(self, runtime: JournalRuntime) -> None:
        async with runtime.session("s", "u"):
            await runtime.step("a", Counter(), 1)
            with runtime.subrun("helper"):
                await runtime.step("b", Counter(), 2)
        infos = await runtime.entries("s", "u")
        assert [(i.name, i.path, i.epoch, i.kind) for i in infos] == [
            ("a", (), 0, "step"),
            ("b", ("helper#0",), 0, "step"),
        ]
        assert all(i.size > 0 and i.created_at > 0 for i in infos)


def _fingerprint_of(args: tuple[Any, ...]) -> str:
    from ..runtime._store import fingerprint

    return fingerprint(args, {})


def _pickle_bytes(value: Any) -> bytes:
    import pickle

    return pickle.dumps(value)


async def _plant_pickle(runtime: JournalRuntime, raw: bytes) -> None:
    run = runtime.current_run
    assert run is not None
    entry = StoredEntry(path_key(()), "a", _fingerprint_of((1,)), "step", "pickle", 0, raw)
    assert await runtime._store.write_entry(run.scope, run.token, run.epoch, entry)
