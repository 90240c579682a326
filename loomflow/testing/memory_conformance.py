"""One conformance suite for every memory backend, store-level and through the agent.

Subclass :class:`MemoryConformance` and provide a ``make_runtime`` fixture, exactly as for
:class:`~loomflow.testing.conformance.JournalConformance`: an async factory whose every call
returns a new runtime over the *same* storage. The memory under test is the one
:func:`~loomflow.memory.memory_for` puts beside that runtime; override the ``memory`` fixture
to test your own :class:`~loomflow.memory.MemoryStore` (``Memory(MyStore())``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from ..agent import Agent, Tuning
from ..errors import ReplayDivergenceError, UserError
from ..memory import Episode, Memory, memory_for
from ..messages import Message, ToolCall, ToolSpec
from ..models import FunctionModel
from ..runtime import JournalRuntime
from ..tools import tool

__all__ = ["MemoryConformance", "RuntimeFactory", "recalling_model"]

RuntimeFactory = Callable[..., Awaitable[JournalRuntime]]


def recalling_model() -> FunctionModel:
    """A model that answers with what it was told before in the conversation.

    Its answer to ``"what did I say?"`` lists the earlier user messages it can see, so a test
    reads the rehydrated history straight off the output.
    """

    def decide(messages: list[Message], tools: list[ToolSpec]) -> str:
        said = [m.content for m in messages if m.role == "user"]
        if said[-1] == "what did I say?":
            return "you said: " + " | ".join(said[:-1]) if len(said) > 1 else "nothing yet"
        return f"noted: {said[-1]}"

    return FunctionModel(decide)


def _says(user: str, text: str) -> list[Message]:
    return [Message.user(text), Message.assistant(f"{user} heard")]


class MemoryConformance:
    """Behaviour every memory backend must show (see the module docstring)."""

    @pytest.fixture
    async def runtime(self, make_runtime: RuntimeFactory) -> JournalRuntime:
        return await make_runtime()

    @pytest.fixture
    async def memory(self, runtime: JournalRuntime) -> Memory:
        return memory_for(runtime)

    # -- episodes ----------------------------------------------------------------------------

    async def test_episodes_in_journal_order_newest_limit(self, memory: Memory) -> None:
        for epoch in (2, 0, 1):
            await memory.record_episode(
                "s",
                user_id="u",
                key=f"run-{epoch}",
                messages=_says("u", f"turn {epoch}"),
                output=f"out {epoch}",
                epoch=epoch,
            )
        episodes = await memory.episodes("s", user_id="u")
        assert [e.epoch for e in episodes] == [0, 1, 2]
        assert [e.epoch for e in await memory.episodes("s", user_id="u", limit=2)] == [1, 2]
        assert [e.epoch for e in await memory.episodes("s", user_id="u", before_epoch=2)] == [
            0,
            1,
        ]
        assert await memory.episodes("s", user_id="u", before_epoch=0) == []
        assert episodes[0].messages == _says("u", "turn 0")
        history = await memory.history("s", user_id="u", before_epoch=2)
        assert [m.content for m in history if m.role == "user"] == ["turn 0", "turn 1"]

    async def test_writing_an_episode_key_again_replaces_it(self, memory: Memory) -> None:
        first = await memory.record_episode(
            "s", user_id="u", key="k", messages=_says("u", "v1"), output="1", epoch=0
        )
        second = await memory.record_episode(
            "s", user_id="u", key="k", messages=_says("u", "v2"), output="2", epoch=0
        )
        episodes = await memory.episodes("s", user_id="u")
        assert len(episodes) == 1
        assert (second.id, second.created_at) == (first.id, first.created_at)
        assert episodes[0].output == "2"
        assert episodes[0].messages == _says("u", "v2")

    @pytest.mark.parametrize(
        ("session", "user"), [("s", "bob"), ("s", None), ("s", "None"), ("t", "u")]
    )
    async def test_episodes_are_partitioned_by_session_and_user(
        self, memory: Memory, session: str, user: str | None
    ) -> None:
        await memory.record_episode(
            "s", user_id="u", key="k", messages=_says("u", "secret"), output="", epoch=0
        )
        assert await memory.episodes(session, user_id=user) == []
        # Keys are unique per user: under another user the same key is another episode.
        key = "k" if user != "u" else "k2"
        await memory.record_episode(
            session, user_id=user, key=key, messages=_says("x", "mine"), output="", epoch=0
        )
        assert [e.messages[0].content for e in await memory.episodes("s", user_id="u")] == [
            "secret"
        ]

    async def test_forget_session(self, memory: Memory) -> None:
        for key, session in (("a", "s"), ("b", "s"), ("c", "t")):
            await memory.record_episode(
                session, user_id="u", key=key, messages=_says("u", "x"), output="", epoch=0
            )
        assert await memory.forget_session("s", user_id="u") == 2
        assert await memory.episodes("s", user_id="u") == []
        assert len(await memory.episodes("t", user_id="u")) == 1

    async def test_an_episode_key_written_from_another_session_keeps_its_session(
        self, memory: Memory
    ) -> None:
        first = await memory.record_episode(
            "s", user_id="u", key="k", messages=_says("u", "v1"), output="1", epoch=0
        )
        await memory.record_episode(
            "t", user_id="u", key="k", messages=_says("u", "v2"), output="2", epoch=1
        )
        assert await memory.episodes("t", user_id="u") == []
        (kept,) = await memory.episodes("s", user_id="u")
        assert (kept.id, kept.session_id, kept.output) == (first.id, "s", "2")

    async def test_sessions_stay_apart_across_forgetting_and_recording(
        self, memory: Memory
    ) -> None:
        async def record(session: str, key: str, epoch: int) -> None:
            await memory.record_episode(
                session, user_id="u", key=key, messages=_says("u", key), output=key, epoch=epoch
            )

        for i in range(3):
            await record("s", f"s{i}", i)
            await record("t", f"t{i}", i)
        assert await memory.forget_session("s", user_id="u") == 3
        await record("t", "t3", 3)
        await record("s", "s-new", 0)
        await record("t", "t1", 1)  # replaces in place, order unchanged
        assert [e.output for e in await memory.episodes("t", user_id="u")] == [
            "t0",
            "t1",
            "t2",
            "t3",
        ]
        assert [e.output for e in await memory.episodes("s", user_id="u")] == ["s-new"]
        assert await memory.episodes("s", user_id="other") == []

    # -- facts -------------------------------------------------------------------------------

    async def test_a_newer_fact_supersedes_and_both_stay_queryable(self, memory: Memory) -> None:
        paris = await memory.remember("alice", "lives_in", "Paris", user_id="u", source="r1")
        await memory.remember("alice", "works_at", "ACME", user_id="u")
        rome = await memory.remember("alice", "lives_in", "Rome", user_id="u")
        current = await memory.facts(user_id="u", subject="alice", predicate="lives_in")
        assert [f.object for f in current] == ["Rome"]
        history = await memory.facts(user_id="u", predicate="lives_in", history=True)
        assert [(f.object, f.current) for f in history] == [("Paris", False), ("Rome", True)]
        old = history[0]
        assert old.valid_to == rome.valid_from
        assert old.superseded_by == rome.id
        assert old.source == "r1"
        # Every version is visible at its own start, even when the clock did not move.
        then = await memory.facts(user_id="u", predicate="lives_in", as_of=paris.valid_from)
        assert [f.object for f in then] == ["Paris"]
        assert paris.valid_from < rome.valid_from
        now = await memory.facts(user_id="u", subject="alice", as_of=rome.valid_from)
        assert sorted(f.object for f in now) == ["ACME", "Rome"]
        before = await memory.facts(user_id="u", as_of=paris.valid_from.timestamp() - 60)
        assert before == []

    async def test_repeating_the_current_fact_changes_nothing(self, memory: Memory) -> None:
        first = await memory.remember("alice", "likes", "tea", user_id="u")
        again = await memory.remember("alice", "likes", "tea", user_id="u")
        assert again == first
        assert len(await memory.facts(user_id="u", history=True)) == 1

    async def test_retract_ends_a_fact_without_a_successor(self, memory: Memory) -> None:
        fact = await memory.remember("alice", "likes", "tea", user_id="u")
        closed = await memory.retract("alice", "likes", user_id="u")
        assert closed is not None
        assert closed.id == fact.id
        assert closed.valid_to is not None
        assert closed.superseded_by is None
        assert await memory.facts(user_id="u") == []
        assert await memory.retract("alice", "likes", user_id="u") is None
        assert [f.id for f in await memory.facts(user_id="u", history=True)] == [fact.id]

    async def test_concurrent_supersessions_leave_one_current_fact(self, memory: Memory) -> None:
        await asyncio.gather(
            *(memory.remember("alice", "mood", f"m{i}", user_id="u") for i in range(8))
        )
        current = await memory.facts(user_id="u", predicate="mood")
        assert len(current) == 1
        history = await memory.facts(user_id="u", predicate="mood", history=True)
        assert len(history) == 8
        # Each version ends exactly where its successor starts: one unbroken timeline.
        for older, newer in itertools.pairwise(history):
            assert older.valid_to == newer.valid_from
            assert older.superseded_by == newer.id

    async def test_facts_are_partitioned_by_user(self, memory: Memory) -> None:
        await memory.remember("alice", "lives_in", "Paris", user_id="alice")
        await memory.remember("alice", "lives_in", "Oslo", user_id="bob")
        await memory.remember("alice", "lives_in", "Lima", user_id=None)
        for user, city in (("alice", "Paris"), ("bob", "Oslo"), (None, "Lima")):
            assert [f.object for f in await memory.facts(user_id=user)] == [city]

    async def test_fact_arguments_are_validated(self, memory: Memory) -> None:
        with pytest.raises(UserError):
            await memory.remember("", "p", "o", user_id="u")
        with pytest.raises(UserError, match="NUL"):
            await memory.remember("s", "p\x00", "o", user_id="u")
        with pytest.raises(UserError, match="not both"):
            await memory.facts(user_id="u", as_of=0.0, history=True)

    # -- working blocks ----------------------------------------------------------------------

    async def test_blocks_are_written_read_and_deleted_per_user(self, memory: Memory) -> None:
        first = await memory.set_block("notes", "v1", user_id="u")
        second = await memory.set_block("notes", "v2", user_id="u")
        await memory.set_block("persona", "terse", user_id="u")
        await memory.set_block("notes", "bob's", user_id="bob")
        block = await memory.block("notes", user_id="u")
        assert block is not None
        assert block.content == "v2"
        # A block never rewritten was updated when it was created (PostgreSQL read its clock
        # once for each, microseconds apart: it looked edited since).
        assert first.created_at == first.updated_at
        assert second.created_at == first.created_at
        assert second.updated_at >= first.updated_at
        assert [b.name for b in await memory.blocks(user_id="u")] == ["notes", "persona"]
        assert await memory.delete_block("notes", user_id="u") is True
        assert await memory.delete_block("notes", user_id="u") is False
        assert await memory.block("notes", user_id="u") is None
        bobs = await memory.block("notes", user_id="bob")
        assert bobs is not None
        assert bobs.content == "bob's"

    # -- per user ----------------------------------------------------------------------------

    async def _fill(self, memory: Memory, user: str | None) -> None:
        await memory.record_episode(
            "s", user_id=user, key="k", messages=_says("u", "hi"), output="o", epoch=0
        )
        await memory.remember("x", "y", "1", user_id=user)
        await memory.remember("x", "y", "2", user_id=user)
        await memory.set_block("notes", "n", user_id=user)

    async def test_forget_user_deletes_everything_of_that_user_only(self, memory: Memory) -> None:
        for user in ("alice", "bob", None):
            await self._fill(memory, user)
        assert await memory.forget_user("alice") == {"episodes": 1, "facts": 2, "blocks": 1}
        assert await memory.forget_user("alice") == {"episodes": 0, "facts": 0, "blocks": 0}
        gone = await memory.export_user("alice")
        assert (gone["episodes"], gone["facts"], gone["blocks"]) == ([], [], [])
        for user in ("bob", None):
            kept = await memory.export_user(user)
            assert (len(kept["episodes"]), len(kept["facts"]), len(kept["blocks"])) == (1, 2, 1)

    async def test_export_user_is_json_and_complete(self, memory: Memory) -> None:
        await self._fill(memory, "alice")
        await self._fill(memory, "bob")
        exported = json.loads(json.dumps(await memory.export_user("alice")))
        assert exported["user_id"] == "alice"
        assert [Episode.model_validate(e).output for e in exported["episodes"]] == ["o"]
        assert [(f["object"], f["valid_to"] is None) for f in exported["facts"]] == [
            ("1", False),
            ("2", True),
        ]
        assert [b["content"] for b in exported["blocks"]] == ["n"]
        assert {e["user_id"] for e in exported["episodes"] + exported["facts"]} == {"alice"}

    async def test_another_worker_sees_the_same_memory(
        self, memory: Memory, make_runtime: RuntimeFactory
    ) -> None:
        await memory.remember("alice", "likes", "tea", user_id="u")
        other = memory_for(await make_runtime())
        assert [f.object for f in await other.facts(user_id="u")] == ["tea"]

    # -- through the agent -------------------------------------------------------------------

    async def test_a_session_remembers_earlier_runs_of_the_same_user(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        agent = Agent("x", model=recalling_model(), runtime=runtime, memory=memory)
        await agent.run("Hi, I'm Alice.", session_id="conv_42", user_id="alice")
        await agent.run("I like tea.", session_id="conv_42", user_id="alice")
        answer = await agent.run("what did I say?", session_id="conv_42", user_id="alice")
        assert answer.output == "you said: Hi, I'm Alice. | I like tea."
        other_session = await agent.run("what did I say?", session_id="conv_43", user_id="alice")
        assert other_session.output == "nothing yet"
        other_user = await agent.run("what did I say?", session_id="conv_42", user_id="mallory")
        assert other_user.output == "nothing yet"

    async def test_the_episode_write_is_a_journaled_step(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        agent = Agent("x", model=recalling_model(), runtime=runtime, memory=memory)
        await agent.run("hello", session_id="s", user_id="u")
        names = [e.name for e in await runtime.entries("s", "u")]
        assert names == ["model_call_0", "persist_episode_1"]
        (episode,) = await memory.episodes("s", user_id="u")
        assert episode.epoch == 0
        assert [m.role for m in episode.messages] == ["user", "assistant"]

    async def test_resuming_a_finished_run_replays_every_step_and_writes_no_duplicate(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        model = recalling_model()
        agent = Agent(
            "x",
            model=model,
            runtime=runtime,
            memory=memory,
            tuning=Tuning(strict_replay=True),  # any changed input would raise
        )
        await agent.run("first", session_id="s", user_id="u")
        second = await agent.run("what did I say?", session_id="s", user_id="u")
        assert second.output == "you said: first"
        calls = model.calls
        # The second run's own episode exists now; it must not leak into its replay.
        resumed = await agent.resume("what did I say?", session_id="s", user_id="u")
        assert resumed.output == "you said: first"
        assert model.calls == calls
        assert (resumed.replayed_steps, resumed.fresh_steps) == (2, 0)
        assert resumed.messages == second.messages
        episodes = await memory.episodes("s", user_id="u")
        assert [e.epoch for e in episodes] == [0, 1]

    async def test_a_crash_between_the_write_and_its_journal_entry_writes_once(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        class LosesTheAcknowledgement(Memory):
            """Writes the episode, then fails as if the process died before journaling."""

            failures = 1

            async def record_episode(self, *args: Any, **kwargs: Any) -> Episode:
                episode = await super().record_episode(*args, **kwargs)
                if self.failures:
                    self.failures -= 1
                    raise ConnectionError("died after the write")
                return episode

        flaky = LosesTheAcknowledgement(memory.store)
        model = recalling_model()
        agent = Agent("x", model=model, runtime=runtime, memory=flaky)
        with pytest.raises(ConnectionError):
            await agent.run("hello", session_id="s", user_id="u")
        assert len(await memory.episodes("s", user_id="u")) == 1
        result = await agent.run("hello", session_id="s", user_id="u")  # the open run again
        assert result.replayed_steps == 1  # the model call
        assert model.calls == 1
        assert len(await memory.episodes("s", user_id="u")) == 1

    async def test_memory_tools_act_for_the_runs_user_and_replay(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        writes = 0

        @tool
        def count() -> str:
            """Count."""
            nonlocal writes
            writes += 1
            return "ok"

        def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
            if messages[-1].role == "tool":
                return "remembered"
            return [
                ToolCall(
                    id="m",
                    name="remember_fact",
                    arguments={"subject": "user", "predicate": "drinks", "value": "tea"},
                ),
                ToolCall(id="c", name="count", arguments={}),
            ]

        agent = Agent(
            "x",
            model=FunctionModel(decide),
            tools=[*memory.tools(), count],
            runtime=runtime,
        )
        await agent.run("remember I drink tea", session_id="s", user_id="alice")
        (fact,) = await memory.facts(user_id="alice")
        assert (fact.subject, fact.predicate, fact.object) == ("user", "drinks", "tea")
        assert await memory.facts(user_id=None) == []
        await memory.remember("user", "drinks", "coffee", user_id="alice")
        await agent.resume("remember I drink tea", session_id="s", user_id="alice")
        assert writes == 1
        # The replayed tool call did not write again: coffee is still the current fact.
        assert [f.object for f in await memory.facts(user_id="alice")] == ["coffee"]

    async def test_an_agent_inside_another_run_records_no_episode(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        worker = Agent("w", model=recalling_model(), memory=memory, name="helper")

        def lead_decides(messages: list[Message], tools: list[ToolSpec]) -> Any:
            if messages[-1].role == "tool":
                return f"lead: {messages[-1].content}"
            return [ToolCall(id="h", name="helper", arguments={"task": "note this"})]

        lead = Agent(
            "l",
            model=FunctionModel(lead_decides),
            tools=[worker.as_tool()],
            runtime=runtime,
            memory=memory,
        )
        result = await lead.run("go", session_id="s", user_id="u")
        assert result.output == "lead: noted: note this"
        (episode,) = await memory.episodes("s", user_id="u")
        assert episode.messages[0].content == "go"

    async def test_a_restored_checkpoint_does_not_consult_memory(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        class Counting(Memory):
            reads = 0

            async def history(self, *args: Any, **kwargs: Any) -> list[Message]:
                self.reads += 1
                return await super().history(*args, **kwargs)

        counting = Counting(memory.store)
        model = recalling_model()
        agent = Agent(
            "x",
            model=model,
            runtime=runtime,
            memory=counting,
            tuning=Tuning(checkpoint=True),
        )
        await agent.run("first", session_id="s", user_id="u")
        second = await agent.run("what did I say?", session_id="s", user_id="u")
        reads, calls = counting.reads, model.calls
        resumed = await agent.resume("what did I say?", session_id="s", user_id="u")
        assert resumed.restored_from is not None
        assert counting.reads == reads  # no re-seeding from memory
        assert model.calls == calls
        assert resumed.output == second.output == "you said: first"
        assert len(await memory.episodes("s", user_id="u")) == 2

    async def test_a_replayed_run_with_changed_history_is_a_divergence(
        self, runtime: JournalRuntime, memory: Memory
    ) -> None:
        agent = Agent(
            "x",
            model=recalling_model(),
            runtime=runtime,
            memory=memory,
            tuning=Tuning(strict_replay=True),
        )
        await agent.run("first", session_id="s", user_id="u")
        await agent.run("what did I say?", session_id="s", user_id="u")
        await memory.forget_session("s", user_id="u")
        # Memory is not journaled: forgetting changes what the replayed call would see.
        with pytest.raises(ReplayDivergenceError, match="model_call_0"):
            await agent.resume("what did I say?", session_id="s", user_id="u")
