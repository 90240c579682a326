"""``loomflow_store_unavailable_total`` counts journal failures, not only budget ones (an audit
store's: ``test_telemetry_spans.py``, a hung journal under ``loomflow worker``:
``tests/recovery/test_worker_faults.py``).

The critical alert ``LoomflowStoreUnavailable`` reads this counter; a journal or audit store
that failed under a run (or under a recovery sweep) has to show there. Real SQLite files, held
by another connection past the busy timeout.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.errors import StoreUnavailableError
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.recovery import Recovery
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import Metrics, Telemetry


def failures(registry: CollectorRegistry) -> dict[str, float]:
    return {
        store: registry.get_sample_value("loomflow_store_unavailable_total", {"store": store}) or 0
        for store in ("journal", "audit", "budget")
    }


@pytest.fixture
def held() -> Iterator[list[sqlite3.Connection]]:
    connections: list[sqlite3.Connection] = []
    yield connections
    for connection in connections:
        connection.close()


def lock(path: Path, held: list[sqlite3.Connection]) -> None:
    """Hold ``path``'s write lock from another connection (as another process would)."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    held.append(other)


async def fails_then_closes(
    agent: Agent, held: list[sqlite3.Connection], close: Callable[[], Awaitable[None]]
) -> None:
    """Run ``agent`` into the store failure, then let the file go and close the store."""
    try:
        with pytest.raises(StoreUnavailableError):
            await agent.run("q", session_id="s1", user_id="erin")
    finally:
        for connection in held:
            connection.close()
        held.clear()
        await close()


async def test_a_journal_that_fails_under_a_run_is_counted_as_the_journal(
    registry: CollectorRegistry, tmp_path: Path, held: list[sqlite3.Connection]
) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path, busy_timeout_ms=50)

    def answer(messages: list[Message], tools: list[ToolSpec]) -> Any:
        lock(path, held)  # the journal write of this model step finds the file held
        return "hi"

    agent = Agent(
        "x",
        model=FunctionModel(answer),
        runtime=runtime,
        telemetry=Telemetry(metrics=Metrics(registry), tracing=False),
        memory=False,
    )
    await fails_then_closes(agent, held, runtime.close)
    assert failures(registry) == {"journal": 1, "audit": 0, "budget": 0}


async def test_a_recovery_sweep_that_fails_on_the_journal_is_counted(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    # A journal path that cannot be opened: every sweep fails, and the run-state gauge (the
    # only other recovery figure) keeps its last value, so this counter is what shows it.
    runtime = SqliteRuntime(tmp_path)  # a directory, not a SQLite file
    agent = Agent("x", model=FunctionModel(lambda m, t: "hi"), runtime=runtime, name="a")
    recovery = Recovery(runtime, {"a": agent}, metrics=Metrics(registry))
    for _ in range(2):
        with pytest.raises(StoreUnavailableError):
            await recovery.sweep()
    assert failures(registry) == {"journal": 2, "audit": 0, "budget": 0}


async def test_a_journal_that_cannot_open_a_run_is_counted(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    # The database down from the start: the run never begins, so no hook hears it end.
    runtime = SqliteRuntime(tmp_path)  # a directory, not a SQLite file
    agent = Agent(
        "x",
        model=FunctionModel(lambda m, t: "hi"),
        runtime=runtime,
        telemetry=Telemetry(metrics=Metrics(registry), tracing=False),
    )
    for n in range(2):
        with pytest.raises(StoreUnavailableError):
            await agent.run("q", session_id=f"s{n}", user_id="erin")
    assert failures(registry) == {"journal": 2, "audit": 0, "budget": 0}
