"""One conformance suite for every checkpoint backend, store-level and through the agent.

Subclass :class:`CheckpointConformance` and provide a ``make_runtime`` fixture, exactly as
for :class:`~loomflow.testing.conformance.JournalConformance`: an async factory whose every
call returns a new runtime over the *same* storage. The store under test is the one
:func:`~loomflow.checkpoints.checkpoint_store_for` puts beside that runtime; override the
``store`` fixture to test a store of your own::

    class TestMyBackend(CheckpointConformance):
        @pytest.fixture
        async def make_runtime(self):
            ...
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from ulid import ULID

from ..agent import Agent, RunResult, Tuning
from ..checkpoints import (
    Checkpoint,
    CheckpointRestored,
    CheckpointSaved,
    CheckpointStore,
    checkpoint_store_for,
)
from ..errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidIdError,
    UserError,
)
from ..hooks import Interrupt, RunHooks, RunInfo
from ..messages import Message, ModelResponse, ModelSettings, ToolCall, ToolSpec, Usage
from ..models import FunctionModel
from ..runtime import JournalRuntime
from ..tools import tool

__all__ = ["CheckpointConformance", "RuntimeFactory", "Shop", "checkpoint"]

RuntimeFactory = Callable[..., Awaitable[JournalRuntime]]


def checkpoint(
    session_id: str = "s",
    user_id: str | None = "u",
    *,
    turn: int = 1,
    final: bool = False,
    text: str = "hello",
    epoch: int = 0,
    parent_id: str | None = None,
) -> Checkpoint:
    """A small, valid checkpoint for store-level tests."""
    return Checkpoint(
        id=str(ULID()),
        session_id=session_id,
        user_id=user_id,
        run_id=str(ULID()),
        epoch=epoch,
        turn=turn,
        final=final,
        prompt=text,
        output="",
        messages=[
            Message.system("be brief"),
            Message.user(text),
            Message.assistant("", [ToolCall(id="c1", name="look", arguments={"q": "ünï"})]),
            Message.tool_result("c1", "found", name="look"),
        ],
        prompt_index=1,
        usage=Usage(input_tokens=10 * turn, output_tokens=turn),
        cost_usd=0.25 * turn,
        parent_id=parent_id,
    )


class Shop:
    """A model that buys three items, one tool call per turn, then answers; and its tool.

    ``fail_at`` makes the model call of that turn raise once (a crash in the middle of a
    run); ``bought`` counts real executions of the side-effecting tool.
    """

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.bought: list[str] = []

        @tool
        def buy(item: str) -> str:
            """Buy one item.

            Args:
                item: What to buy.
            """
            self.bought.append(item)
            return f"bought {item}"

        self.tool = buy
        self.model = FunctionModel(self._decide)

    def _decide(self, messages: list[Message], tools: list[ToolSpec]) -> Any:
        start = max(i for i, m in enumerate(messages) if m.role == "user")
        done = sum(1 for m in messages[start:] if m.role == "tool")
        if done == self.fail_at:
            self.fail_at = None
            raise ConnectionError("the provider went away")
        if done < 3:
            item = ("apples", "bread", "cheese")[done]
            return [ToolCall(id=f"call-{done}", name="buy", arguments={"item": item})]
        return "bought: " + ", ".join(m.content for m in messages[start:] if m.role == "tool")


class LiveCalls(RunHooks):
    """Records the turns of live model calls, and can refuse one turn once."""

    def __init__(self, refuse_turn: int | None = None) -> None:
        self.refuse_turn = refuse_turn
        self.live_turns: list[int] = []
        self.replayed_turns: list[int] = []

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        if turn == self.refuse_turn:
            self.refuse_turn = None
            raise Interrupt("budget:tokens", "cap reached")
        self.live_turns.append(turn)
        return None

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        if replayed:
            self.replayed_turns.append(turn)


class CheckpointConformance:
    """Behaviour every checkpoint backend must show (see the module docstring)."""

    @pytest.fixture
    async def runtime(self, make_runtime: RuntimeFactory) -> JournalRuntime:
        return await make_runtime()

    @pytest.fixture
    async def store(self, runtime: JournalRuntime) -> CheckpointStore:
        return checkpoint_store_for(runtime)

    # -- the store ---------------------------------------------------------------------------

    async def test_latest_get_and_list_newest_first(self, store: CheckpointStore) -> None:
        first = await store.put(checkpoint(turn=1))
        second = await store.put(checkpoint(turn=2))
        third = await store.put(checkpoint(turn=3, final=True))
        assert (await store.latest("s", user_id="u")) == third
        listed = await store.list_checkpoints("s", user_id="u")
        assert [c.id for c in listed] == [third.id, second.id, first.id]
        assert [c.id for c in await store.list_checkpoints("s", user_id="u", limit=2)] == [
            third.id,
            second.id,
        ]
        assert await store.get(first.id, session_id="s", user_id="u") == first
        assert await store.get("nope", session_id="s", user_id="u") is None
        created = [c.created_at for c in reversed(listed)]
        assert None not in created
        assert created == sorted(created)  # type: ignore[type-var]

    async def test_the_transcript_and_usage_round_trip(self, store: CheckpointStore) -> None:
        original = checkpoint(turn=4, final=True, text="naïve café ☕", parent_id="p").model_copy(
            update={"output_type": "Weather", "output_format": "0f" * 32}
        )
        await store.put(original)
        loaded = await store.latest("s", user_id="u")
        assert loaded is not None
        assert loaded.model_copy(update={"created_at": None}) == original
        assert loaded.messages[2].tool_calls[0].arguments == {"q": "ünï"}
        assert loaded.usage == Usage(input_tokens=40, output_tokens=4)

    @pytest.mark.parametrize(
        ("session", "user"),
        [("s", "bob"), ("s", None), ("s", "None"), ("other", "u"), ('s","u', None)],
    )
    async def test_checkpoints_are_isolated_per_session_and_user(
        self, store: CheckpointStore, session: str, user: str | None
    ) -> None:
        mine = await store.put(checkpoint("s", "u"))
        assert await store.latest(session, user_id=user) is None
        assert await store.list_checkpoints(session, user_id=user) == []
        assert await store.get(mine.id, session_id=session, user_id=user) is None
        theirs = await store.put(checkpoint(session, user))
        assert await store.latest("s", user_id="u") == mine
        assert await store.latest(session, user_id=user) == theirs

    async def test_retention_keeps_the_newest_per_session_and_user(
        self, store: CheckpointStore
    ) -> None:
        other = await store.put(checkpoint("s", "other"), retention=1)
        kept = [await store.put(checkpoint(turn=t), retention=3) for t in range(1, 7)]
        listed = await store.list_checkpoints("s", user_id="u")
        assert [c.id for c in listed] == [c.id for c in reversed(kept[-3:])]
        assert await store.list_checkpoints("s", user_id="other") == [other]
        for _ in range(4):
            await store.put(checkpoint(turn=9))  # no retention: nothing is cut
        assert len(await store.list_checkpoints("s", user_id="u")) == 7

    async def test_delete_session(self, store: CheckpointStore) -> None:
        for _ in range(3):
            await store.put(checkpoint("s", "u"))
        await store.put(checkpoint("t", "u"))
        assert await store.delete_session("s", user_id="u") == 3
        assert await store.latest("s", user_id="u") is None
        assert await store.latest("t", user_id="u") is not None

    async def test_forget_user_deletes_every_session_of_that_user_only(
        self, store: CheckpointStore
    ) -> None:
        for session in ("a", "b", "c"):
            await store.put(checkpoint(session, "alice"))
        await store.put(checkpoint("a", "bob"))
        await store.put(checkpoint("a", None))
        assert await store.forget_user("alice") == 3
        assert await store.forget_user("alice") == 0
        for session in ("a", "b", "c"):
            assert await store.latest(session, user_id="alice") is None
        assert await store.latest("a", user_id="bob") is not None
        assert await store.forget_user(None) == 1  # the anonymous bucket, and only it
        assert await store.latest("a", user_id="bob") is not None

    async def test_export_user_is_json_and_complete(self, store: CheckpointStore) -> None:
        written = [await store.put(checkpoint(s, "alice", turn=2)) for s in ("a", "b")]
        await store.put(checkpoint("a", "bob"))
        exported = json.loads(json.dumps(await store.export_user("alice")))
        assert exported["user_id"] == "alice"
        restored = [Checkpoint.model_validate(c) for c in exported["checkpoints"]]
        assert restored == written
        assert (await store.export_user("nobody"))["checkpoints"] == []

    async def test_another_worker_sees_the_same_checkpoints(
        self, store: CheckpointStore, make_runtime: RuntimeFactory
    ) -> None:
        saved = await store.put(checkpoint())
        other = checkpoint_store_for(await make_runtime())
        assert await other.latest("s", user_id="u") == saved

    async def test_ids_are_validated(self, store: CheckpointStore) -> None:
        with pytest.raises(UserError, match="NUL"):
            await store.latest("s\x00", user_id="u")
        with pytest.raises(UserError, match="string"):
            await store.latest("s", user_id=7)  # type: ignore[arg-type]
        # A checkpoint id follows the same rules: a NUL or a lone surrogate is no database
        # error (PostgreSQL's was a StoreUnavailableError), and an empty id is no lookup.
        for bad, why in (("a\x00b", "NUL"), ("\ud800", "surrogate"), ("", "must not be empty")):
            with pytest.raises(UserError, match=why):
                await store.get(bad, session_id="s", user_id="u")

    async def test_a_checkpoint_id_is_stored_once(self, store: CheckpointStore) -> None:
        """A second put() of an id already stored, in any session of any user, is refused
        by name on every backend, and leaves the first one as it was (the SQL stores failed
        it as StoreUnavailableError, an outage to retry; memory kept both)."""
        kept = await store.put(checkpoint())
        for other in (kept, kept.model_copy(update={"session_id": "t", "user_id": "v"})):
            with pytest.raises(InvalidIdError, match="already"):
                await store.put(other.model_copy(update={"turn": 2}))
        assert await store.list_checkpoints("s", user_id="u") == [kept]
        assert await store.list_checkpoints("t", user_id="v") == []
        # Gone (retention, erasure), its id can be used again.
        await store.delete_session("s", user_id="u")
        await store.put(kept)
        assert [c.id for c in await store.list_checkpoints("s", user_id="u")] == [kept.id]

    async def test_a_stored_snapshot_is_not_changed_through_its_objects(
        self, store: CheckpointStore
    ) -> None:
        """What put() was given and what a read returns are the caller's: changing their
        transcript changes no stored snapshot (the in-memory store kept and handed out the
        caller's own lists and argument dicts, which the SQL stores never share)."""
        given = checkpoint()
        expected = given.model_copy(deep=True).messages
        returned = await store.put(given)
        read = await store.latest("s", user_id="u")
        assert read is not None
        for cp in (given, returned, read):
            cp.messages.append(Message.user("added afterwards"))
            cp.messages[2].tool_calls[0].arguments["q"] = "changed"
        for again in (
            await store.latest("s", user_id="u"),
            await store.get(given.id, session_id="s", user_id="u"),
            (await store.list_checkpoints("s", user_id="u"))[0],
        ):
            assert again is not None
            assert again.messages == expected

    @pytest.mark.parametrize(
        ("limit", "error"),
        [
            (-1, InvalidArgumentError),
            (2**63, InvalidArgumentError),
            (True, InvalidArgumentTypeError),
            (2.5, InvalidArgumentTypeError),
            ("2", InvalidArgumentTypeError),
        ],
    )
    async def test_a_bad_limit_is_refused_by_name(
        self, store: CheckpointStore, limit: Any, error: type[Exception]
    ) -> None:
        await store.put(checkpoint())
        with pytest.raises(error, match="limit"):
            await store.list_checkpoints("s", user_id="u", limit=limit)
        assert await store.list_checkpoints("s", user_id="u", limit=0) == []

    @pytest.mark.parametrize(
        ("retention", "error"),
        [
            (0, InvalidArgumentError),
            (-1, InvalidArgumentError),
            (True, InvalidArgumentTypeError),
            (2.5, InvalidArgumentTypeError),
        ],
    )
    async def test_a_bad_retention_is_refused_before_anything_is_written_or_cut(
        self, store: CheckpointStore, retention: Any, error: type[Exception]
    ) -> None:
        kept = await store.put(checkpoint())
        with pytest.raises(error, match="retention"):
            await store.put(checkpoint(turn=2), retention=retention)
        assert await store.list_checkpoints("s", user_id="u") == [kept]

    # -- through the agent -------------------------------------------------------------------

    def agent(
        self,
        runtime: JournalRuntime,
        shop: Shop,
        *,
        hooks: list[RunHooks] | None = None,
        retention: int | None = 10,
        max_turns: int = 10,
    ) -> Agent:
        return Agent(
            "You shop.",
            model=shop.model,
            tools=[shop.tool],
            runtime=runtime,
            tuning=Tuning(checkpoint=True, checkpoint_retention=retention),
            hooks=hooks or [],
            max_turns=max_turns,
        )

    async def test_a_snapshot_after_every_pass(self, runtime: JournalRuntime) -> None:
        shop = Shop()
        agent = self.agent(runtime, shop)
        events = [e async for e in agent.stream("shop", session_id="s", user_id="u")]
        result: RunResult = events[-1].result  # type: ignore[union-attr]
        listed = await agent.list_checkpoints("s", user_id="u")
        assert [(c.turn, c.final) for c in listed] == [
            (4, True),
            (3, False),
            (2, False),
            (1, False),
        ]
        assert listed[0].messages == result.messages
        assert listed[0].usage == Usage(
            input_tokens=result.tokens_in, output_tokens=result.tokens_out
        )
        assert listed[0].run_id == result.run_id
        assert listed[0].prompt == "shop"
        assert len(listed[3].messages) == 4  # system, user, the first call and its result
        saved = [e.checkpoint_id for e in events if isinstance(e, CheckpointSaved)]
        assert saved == [c.id for c in reversed(listed)]
        assert await agent.list_checkpoints("s", user_id="someone else") == []

    async def test_resume_restores_without_replay_or_rebilling(
        self, runtime: JournalRuntime
    ) -> None:
        uninterrupted = await self.agent(runtime, Shop()).run("shop", session_id="ref")
        shop = Shop(fail_at=2)
        calls = LiveCalls()
        agent = self.agent(runtime, shop, hooks=[calls])
        with pytest.raises(ConnectionError):
            await agent.run("shop", session_id="s", user_id="u")
        assert shop.bought == ["apples", "bread"]
        before = shop.model.calls
        calls.live_turns.clear()
        result = await agent.resume("shop", session_id="s", user_id="u")
        assert result.output == "bought: bought apples, bought bread, bought cheese"
        assert shop.bought == ["apples", "bread", "cheese"]  # nothing bought twice
        assert shop.model.calls == before + 2  # turns 2 and 3 only
        assert calls.live_turns == [2, 3]  # earlier turns never reach the budget again
        assert calls.replayed_turns == []  # ... and were not replayed either: restored
        assert result.replayed_steps == 0
        assert result.restored_from is not None
        assert result.turns == uninterrupted.turns == 4
        assert (result.tokens_in, result.tokens_out, result.cost_usd) == (
            uninterrupted.tokens_in,
            uninterrupted.tokens_out,
            uninterrupted.cost_usd,
        )

    async def test_resuming_a_finished_run_makes_no_calls(self, runtime: JournalRuntime) -> None:
        shop = Shop()
        agent = self.agent(runtime, shop)
        first = await agent.run("shop", session_id="s", user_id="u")
        before = shop.model.calls
        events = [e async for e in agent._events("shop", "s", "u", None, resume=True)]
        again: RunResult = events[-1].result  # type: ignore[union-attr]
        assert shop.model.calls == before
        assert again.output == first.output
        assert (again.turns, again.tokens_in, again.tokens_out) == (
            first.turns,
            first.tokens_in,
            first.tokens_out,
        )
        # No replay walk: the one step a restored run touches is its episode write, which
        # the first run journaled (so memory is not written twice).
        assert (again.replayed_steps, again.fresh_steps) == (1, 0)
        restored = [e for e in events if isinstance(e, CheckpointRestored)]
        assert [e.checkpoint_id for e in restored] == [again.restored_from]
        # The run it continued is still the last one: the next run is a new one.
        fresh = await agent.run("shop", session_id="s", user_id="u")
        assert fresh.replayed_steps == 0
        assert fresh.restored_from is None
        assert shop.bought == ["apples", "bread", "cheese"] * 2

    async def test_without_a_snapshot_resume_replays_the_journal(
        self, runtime: JournalRuntime
    ) -> None:
        shop = Shop(fail_at=0)  # the very first model call fails: no pass ever ended
        agent = self.agent(runtime, shop)
        with pytest.raises(ConnectionError):
            await agent.run("shop", session_id="s", user_id="u")
        assert await agent.list_checkpoints("s", user_id="u") == []
        result = await agent.resume("shop", session_id="s", user_id="u")
        assert result.restored_from is None
        assert result.output.startswith("bought: ")

    async def test_a_snapshot_of_an_earlier_run_is_not_restored(
        self, runtime: JournalRuntime
    ) -> None:
        agent = self.agent(runtime, Shop())
        await agent.run("shop", session_id="s", user_id="u")
        shop = Shop(fail_at=0)
        crashing = self.agent(runtime, shop)
        with pytest.raises(ConnectionError):
            await crashing.run("other errand", session_id="s", user_id="u")
        # The newest snapshot belongs to the finished first run, not to the crashed second
        # one; resuming continues the second run from its journal.
        result = await crashing.resume("other errand", session_id="s", user_id="u")
        assert result.restored_from is None
        assert shop.bought == ["apples", "bread", "cheese"]

    async def test_a_fork_continues_in_a_new_session_and_leaves_the_original(
        self, runtime: JournalRuntime
    ) -> None:
        shop = Shop()
        agent = self.agent(runtime, shop)
        original = await agent.run("shop", session_id="s", user_id="u")
        before = await agent.list_checkpoints("s", user_id="u")
        after_first_pass = before[-1]
        assert after_first_pass.turn == 1
        calls = shop.model.calls
        fork = await agent.resume(
            "shop", session_id="s", user_id="u", from_checkpoint=after_first_pass.id
        )
        assert fork.session_id != "s"
        assert fork.restored_from == after_first_pass.id
        assert fork.output == original.output
        assert shop.model.calls == calls + 3  # turns 1, 2 and 3 run again in the fork
        assert shop.bought == ["apples", "bread", "cheese", "bread", "cheese"]
        assert await agent.list_checkpoints("s", user_id="u") == before  # untouched
        forked = await agent.list_checkpoints(fork.session_id, user_id="u")
        assert forked[-1].parent_id == after_first_pass.id
        assert forked[-1].turn == 1
        assert forked[0].final
        # The original still resumes to its own snapshot, and the fork to its own.
        again = await agent.resume("shop", session_id="s", user_id="u")
        assert again.restored_from == before[0].id
        named = await agent.resume(
            "shop",
            session_id="s",
            user_id="u",
            from_checkpoint=after_first_pass.id,
            fork_session_id="my-fork",
        )
        assert named.session_id == "my-fork"

    async def test_a_fork_needs_a_checkpoint_of_this_session_and_user(
        self, runtime: JournalRuntime
    ) -> None:
        agent = self.agent(runtime, Shop())
        await agent.run("shop", session_id="s", user_id="alice")
        alices = (await agent.list_checkpoints("s", user_id="alice"))[0].id
        with pytest.raises(CheckpointNotFoundError):
            await agent.resume("shop", session_id="s", user_id="bob", from_checkpoint=alices)
        with pytest.raises(CheckpointNotFoundError):
            await agent.resume("shop", session_id="t", user_id="alice", from_checkpoint=alices)
        with pytest.raises(UserError, match="own"):
            await agent.resume(
                "shop",
                session_id="s",
                user_id="alice",
                from_checkpoint=alices,
                fork_session_id="s",
            )

    async def test_a_fork_with_earlier_history_resumes_from_its_own_snapshot(
        self, runtime: JournalRuntime
    ) -> None:
        """A fork of a session whose transcript holds earlier runs (recalled from memory)
        crashes, and its resume restores the fork's snapshot: nothing bought twice."""
        shop = Shop()
        agent = self.agent(runtime, shop)
        await agent.run("shop", session_id="s", user_id="u")
        await agent.run("shop again", session_id="s", user_id="u")
        second = [c for c in await agent.list_checkpoints("s", user_id="u") if c.epoch == 1]
        after_first_pass = second[-1]
        assert after_first_pass.prompt_index > 1  # the first run's turns come before it
        shop.fail_at = 2  # the fork's model call after its second purchase fails
        with pytest.raises(ConnectionError):
            await agent.resume(
                "shop again", session_id="s", user_id="u", from_checkpoint=after_first_pass.id,
                fork_session_id="fork",
            )  # fmt: skip
        bought = list(shop.bought)
        assert bought[-1:] == ["bread"]
        resumed = await agent.resume("shop again", session_id="fork", user_id="u")
        assert resumed.restored_from is not None  # its own snapshot, not a replay from turn 0
        assert shop.bought == [*bought, "cheese"]
        assert resumed.output == "bought: bought apples, bought bread, bought cheese"
        # Every snapshot of the forked run names the snapshot it was forked from.
        fork_snapshots = await agent.list_checkpoints("fork", user_id="u")
        assert {c.parent_id for c in fork_snapshots} == {after_first_pass.id}
        assert {c.prompt_index for c in fork_snapshots} == {after_first_pass.prompt_index}

    async def test_a_fork_into_a_session_that_has_runs_is_refused(
        self, runtime: JournalRuntime
    ) -> None:
        """A fork is a new session: one named by fork_session_id= that has runs (a finished
        one, or an open one it would take over and finish) is refused, and is left as is."""
        shop = Shop()
        agent = self.agent(runtime, shop)
        await agent.run("shop", session_id="s", user_id="u")
        oldest = (await agent.list_checkpoints("s", user_id="u"))[-1]
        crashed = Shop(fail_at=1)
        with pytest.raises(ConnectionError):
            await self.agent(runtime, crashed).run("other", session_id="open", user_id="u")
        await agent.run("shop", session_id="done", user_id="u")
        for taken in ("open", "done"):
            with pytest.raises(UserError, match="already has runs"):
                await agent.resume(
                    "shop", session_id="s", user_id="u", from_checkpoint=oldest.id,
                    fork_session_id=taken,
                )  # fmt: skip
        # The open run is still its own, and resumes to its end.
        resumed = await self.agent(runtime, crashed).resume("other", session_id="open", user_id="u")
        assert crashed.bought == ["apples", "bread", "cheese"]
        assert resumed.output.startswith("bought:")
        # A name no run of this user has is fine.
        fork = await agent.resume(
            "shop", session_id="s", user_id="u", from_checkpoint=oldest.id,
            fork_session_id="fresh",
        )  # fmt: skip
        assert fork.session_id == "fresh"

    async def test_a_snapshot_of_another_prompt_is_refused(self, runtime: JournalRuntime) -> None:
        agent = self.agent(runtime, Shop())
        await agent.run("shop", session_id="s", user_id="u")
        with pytest.raises(UserError, match="original prompt"):
            await agent.resume("something else", session_id="s", user_id="u")

    async def test_an_interrupted_run_resumes_from_its_last_pass(
        self, runtime: JournalRuntime
    ) -> None:
        shop = Shop()
        calls = LiveCalls(refuse_turn=2)
        agent = self.agent(runtime, shop, hooks=[calls])
        stopped = await agent.run("shop", session_id="s", user_id="u")
        assert stopped.interruption_reason == "budget:tokens"
        calls.live_turns.clear()
        # The cap was raised (the hook now allows the call): resume goes on from turn 2.
        result = await agent.resume("shop", session_id="s", user_id="u")
        assert not result.interrupted
        assert calls.live_turns == [2, 3]
        assert shop.bought == ["apples", "bread", "cheese"]

    async def test_max_turns_stays_reached_after_restore(self, runtime: JournalRuntime) -> None:
        shop = Shop()
        agent = self.agent(runtime, shop, max_turns=2)
        first = await agent.run("shop", session_id="s", user_id="u")
        assert first.interruption_reason == "max_turns"
        calls = shop.model.calls
        again = await agent.resume("shop", session_id="s", user_id="u")
        assert again.interruption_reason == "max_turns"
        assert again.turns == 2
        assert shop.model.calls == calls

    async def test_retention_applies_to_agent_snapshots(self, runtime: JournalRuntime) -> None:
        agent = self.agent(runtime, Shop(), retention=2)
        await agent.run("shop", session_id="s", user_id="u")
        assert [c.turn for c in await agent.list_checkpoints("s", user_id="u")] == [4, 3]
