"""True run states and cancel, in one process, on every backend (memory, SQLite, PostgreSQL)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from loomflow.agent import Agent
from loomflow.errors import ConfigurationError, RunCancelledError
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import RUN_STATES, JournalRuntime, RunRecord, decode_record
from loomflow.tools import tool

Factory = Callable[..., Awaitable[JournalRuntime]]
SCRIPT = [[ToolCall(id="c0", name="work", arguments={"n": 1})], "done"]


def _agent(runtime: JournalRuntime, work: object, **options: object) -> Agent:
    return Agent(
        "You work.",
        model=ScriptedModel(SCRIPT),
        tools=[tool(work, name="work")],  # type: ignore[call-overload]
        runtime=runtime,
        memory=False,
        telemetry=False,
        name="worker",
        **options,  # type: ignore[arg-type]
    )


async def _state(runtime: JournalRuntime, session_id: str) -> str:
    [info] = await runtime.sessions(session_id=session_id)
    return info.state


async def test_finished_open_and_interrupted_runs(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()

    def fine(n: int) -> int:
        return n

    def broken(n: int) -> int:
        raise ConfigurationError("misdeployed")

    agent = _agent(runtime, fine)
    await agent.run("go", session_id="ok", user_id="ana", metadata={"ticket": 7})
    [info] = await runtime.sessions(session_id="ok")
    assert info.state == "finished"
    assert info.agent == "worker"
    assert info.config == agent.config_fingerprint()
    assert info.created_at > 0

    with pytest.raises(ConfigurationError):
        await _agent(runtime, broken).run("go", session_id="raised", user_id="ana")
    assert await _state(runtime, "raised") == "open"  # resumable, but nothing retries it

    short = _agent(runtime, fine, max_turns=1)
    result = await short.run("go", session_id="short", user_id="ana")
    assert result.interrupted
    assert await _state(runtime, "short") == "interrupted"
    # A later run of the session starts clean.
    await agent.run("again", session_id="short", user_id="ana")
    assert await _state(runtime, "short") == "finished"

    assert [s.session_id for s in await runtime.sessions(state="open")] == ["raised"]
    counts = await runtime.count_states()
    assert set(counts) == set(RUN_STATES)
    assert (counts["finished"], counts["open"], counts["running"]) == (2, 1, 0)


async def test_a_run_records_what_resuming_needs(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    record = RunRecord("orders", "f" * 64, {"prompt": "hi", "metadata": {"k": [1, 2]}})
    async with runtime.session("s", "ana", record=record):
        [info] = await runtime.sessions()
        assert info.state == "running"
        assert (info.agent, info.config) == ("orders", "f" * 64)
    orphan_free = await runtime.orphans()
    assert orphan_free == []
    with pytest.raises(Exception, match=r"record must be a loomflow\.runtime\.RunRecord"):
        async with runtime.session("t", "ana", record={"prompt": "x"}):  # type: ignore[arg-type]
            pass
    assert decode_record(b'{"prompt": "hi"}') == {"prompt": "hi"}


async def test_a_cancel_between_steps_starts_no_further_step(runtime_factory: Factory) -> None:
    runtime = await runtime_factory()
    ran: list[str] = []

    def body(name: str) -> str:
        ran.append(name)
        return name

    with pytest.raises(RunCancelledError):
        async with runtime.session("between", "ana"):
            await runtime.step("one", body, "one")
            assert await runtime.cancel("between", "ana") is True  # this process, this runtime
            await runtime.step("two", body, "two")
    assert ran == ["one"]  # "two" never started
    assert await _state(runtime, "between") == "cancelled"

    # Through another runtime object (as from another process) the cancel is seen at the next
    # write: that step's body may run, but nothing of it is journaled.
    ran.clear()
    other = await runtime_factory()
    with pytest.raises(RunCancelledError):
        async with runtime.session("elsewhere", "ana"):
            await runtime.step("one", body, "one")
            assert await other.cancel("elsewhere", "ana") is True
            await runtime.step("two", body, "two")
    assert [e.name for e in await runtime.entries("elsewhere", "ana")] == ["one"]
    assert await _state(runtime, "elsewhere") == "cancelled"


async def test_cancel_stops_the_run_at_its_next_step_and_is_final(
    runtime_factory: Factory,
) -> None:
    runtime = await runtime_factory()
    entered = asyncio.Event()
    release = asyncio.Event()
    calls: list[int] = []

    async def slow(n: int) -> int:
        calls.append(n)
        entered.set()
        await release.wait()
        return n

    agent = _agent(runtime, slow)
    task = asyncio.create_task(agent.run("go", session_id="c", user_id="ana"))
    await entered.wait()
    assert await _state(runtime, "c") == "running"
    # Another runtime object on the same journal: as another process would.
    other = await runtime_factory()
    assert await other.cancel("c", "ana") is True
    assert await _state(other, "c") == "cancelled"
    release.set()
    with pytest.raises(RunCancelledError) as caught:
        await task
    assert (caught.value.session_id, caught.value.user_id) == ("c", "ana")
    assert calls == [1]  # the step under way finished; the model was not called again
    assert await _state(runtime, "c") == "cancelled"
    assert await other.cancel("c", "ana") is False  # nothing open any more
    assert await other.cancel("never-ran", "ana") is False
    assert await runtime.orphans() == []

    # The session can be used again: a new run starts afresh.
    async def quick(n: int) -> int:
        return n

    await _agent(runtime, quick).run("go", session_id="c", user_id="ana")
    assert await _state(runtime, "c") == "finished"
