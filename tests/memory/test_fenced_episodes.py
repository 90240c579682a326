"""A run's memory episode is written under the run's fencing token, as a snapshot is.

The episode is written inside a journaled step, after the step's lease check. A worker frozen
(SIGSTOP, a long GC pause) in between, whose run another worker took over and finished,
replaced the new owner's episode when it woke: the step's journal write was refused, the
episode's was not. The write now carries the token, and a run fenced out writes nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent
from loomflow.errors import OwnershipLostError, RunCancelledError
from loomflow.memory import Episode, Memory, SqliteMemory, memory_for
from loomflow.messages import Message
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime

pytestmark = pytest.mark.timeout(60)

_ROW = "SELECT run_id, output, updated_at FROM loom_memory_episodes"


class _FrozenOnce(Memory):
    """Memory whose first episode write stops the whole process (its loop, heartbeat and
    all) just after the journal's lease check, while ``meanwhile`` runs on another thread."""

    def __init__(self, memory: Memory, meanwhile: Callable[[], Awaitable[None]]) -> None:
        super().__init__(memory.store)
        self.meanwhile: Callable[[], Awaitable[None]] | None = meanwhile
        self.refused: list[BaseException] = []

    async def record_episode(self, *args: Any, **kwargs: Any) -> Episode:
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            time.sleep(0.8)  # noqa: ASYNC251 - the point: the loop stops, past its lease
            thread = threading.Thread(target=asyncio.run, args=(meanwhile(),))
            thread.start()
            thread.join()
        try:
            return await super().record_episode(*args, **kwargs)
        except OwnershipLostError as exc:
            self.refused.append(exc)
            raise


def _answer(messages: list[Message], tools: Any) -> str:
    return "the answer"


async def test_a_thawed_worker_does_not_replace_the_new_owners_episode(
    sql_runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    mine = await sql_runtime_factory(lease_seconds=0.5)
    after_takeover: list[Any] = []

    async def take_over() -> None:  # another worker, on its own loop and connection
        runtime = await sql_runtime_factory(turn_timeout=10)
        try:
            other = Agent("Answer.", model=FunctionModel(_answer), runtime=runtime)
            result = await other.resume("hello", session_id="s", user_id="u")
            assert result.output == "the answer"
            after_takeover.extend(await runtime.database.fetch(_ROW))  # type: ignore[attr-defined]
        finally:
            await runtime.close()

    memory = _FrozenOnce(memory_for(mine), take_over)
    agent = Agent("Answer.", model=FunctionModel(_answer), runtime=mine, memory=memory)
    with pytest.raises(OwnershipLostError):
        await agent.run("hello", session_id="s", user_id="u")
    # The row is exactly as the new owner left it ...
    assert len(after_takeover) == 1
    rows = await mine.database.fetch(_ROW)  # type: ignore[attr-defined]
    assert [tuple(r) for r in rows] == [tuple(r) for r in after_takeover]
    # ... because the episode write itself was refused, not only the journal entry after it.
    assert [type(e) for e in memory.refused] == [OwnershipLostError]
    assert "now belongs to a newer run" in str(memory.refused[0])


async def _record(runtime: JournalRuntime, memory: Memory) -> Episode:
    """An episode written as the agent writes its own, for the run open on ``runtime``."""
    return await runtime.record_episode(  # type: ignore[no-any-return]
        memory,
        "s",
        name="persist_episode",
        user_id="u",
        key="k",
        messages=[Message.user("hi")],
        output="an answer",
        epoch=0,
    )


async def test_an_episode_after_a_cancel_from_another_worker_is_refused(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    mine, other = await runtime_factory(), await runtime_factory()
    memory = memory_for(mine)
    with pytest.raises(RunCancelledError):
        async with mine.session("s", user_id="u"):
            await mine.step("work", lambda: 1)  # the run holds the turn, its lease is fresh
            assert await other.cancel("s", user_id="u")
            # The lease check passes (fresh, so the store is not asked): the write is fenced.
            await _record(mine, memory)
    assert await memory.episodes("s", user_id="u") == []


async def test_memory_on_another_database_gets_the_lease_check_alone(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]], tmp_path: Path
) -> None:
    mine = await runtime_factory()
    elsewhere = SqliteMemory(tmp_path / "memory.db")
    try:
        async with mine.session("s", user_id="u"):
            await mine.step("work", lambda: 1)
            stored = await _record(mine, elsewhere)
        assert [e.id for e in await elsewhere.episodes("s", user_id="u")] == [stored.id]
    finally:
        await elsewhere.close()
