"""A third-party journal store that answers None where the protocol says True or False.

Read as False, such an answer passed for "nothing happened": a dead letter the store wrote
was reported as a lost claim (and never audited), a cancel it made was neither audited nor
seen by the run in this process, and a run that held its turn ended as taken over. Each is
now a :class:`StorageError` naming the store and the method.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _fleet import close_agents, start_and_kill
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.audit import AuditLog, InMemoryAuditStore
from loomflow.audit.actions import RUN_CANCEL, RUN_DEAD_LETTER
from loomflow.errors import StorageError
from loomflow.governance import Approve, StandardPermissions
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.recovery import Recovery, cancel_run
from loomflow.runtime import JournalRuntime, SqliteRuntime
from loomflow.telemetry import Metrics
from loomflow.tools import Tool, tool


class _SaysNothing:
    """The real store, except that the named methods do their work and answer None."""

    def __init__(self, store: Any, *silent: str) -> None:
        self._store = store
        self._silent = silent

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if name not in self._silent:
            return found

        async def answers_none(*args: Any, **kwargs: Any) -> None:
            await found(*args, **kwargs)

        return answers_none


def _silence(runtime: JournalRuntime, *methods: str) -> None:
    runtime._store = _SaysNothing(runtime._store, *methods)  # type: ignore[assignment]


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch, journal_url: str, ledger: Path) -> Callable[..., Any]:
    """Start ``count`` runs of the fleet app and SIGKILL their worker; the app's agents."""
    import _app

    monkeypatch.setenv("FLEET_URL", journal_url)
    monkeypatch.setenv("FLEET_LEDGER", str(ledger))
    monkeypatch.delenv("FLEET_BLOCK", raising=False)
    monkeypatch.delenv("FLEET_FAIL", raising=False)

    async def start(prefix: str) -> dict[str, Agent]:
        await start_and_kill(journal_url, ledger, 1, prefix)
        return _app.agents()

    return start


async def test_a_dead_letter_the_store_does_not_confirm_is_an_error_not_a_lost_claim(
    killed: Callable[..., Any],
) -> None:
    agents = await killed("given")
    runtime = agents["orders"].runtime
    assert isinstance(runtime, JournalRuntime)
    try:
        await runtime.database.execute("UPDATE loom_sessions SET attempts = 3")  # type: ignore[attr-defined]
        _silence(runtime, "dead_letter")
        recovery = Recovery(runtime, agents, max_attempts=1, metrics=Metrics(CollectorRegistry()))
        # Before: report.claim_lost held the run (another recoverer's, it said), though the
        # store had marked it failed; its dead letter was never audited.
        with pytest.raises(StorageError, match=r"_SaysNothing answered dead_letter\(\) with a "):
            await recovery.sweep()
        [info] = await runtime.sessions()
        assert info.state == "failed"
        audit = agents["orders"].audit
        assert isinstance(audit, AuditLog)
        assert (await audit.query(user_id="ana", action=RUN_DEAD_LETTER)).entries == []
    finally:
        await close_agents(agents)


async def test_a_cancel_the_store_does_not_confirm_is_an_error(
    killed: Callable[..., Any],
) -> None:
    agents = await killed("stop")
    runtime = agents["orders"].runtime
    assert isinstance(runtime, JournalRuntime)
    audit = AuditLog(InMemoryAuditStore())
    try:
        _silence(runtime, "cancel")
        # Before: cancel_run returned None and audited nothing, while the run was cancelled.
        with pytest.raises(StorageError, match=r"answered cancel\(\) with a NoneType"):
            await cancel_run(runtime, "stop-0", user_id="ana", audit=audit)
        assert (await audit.query(user_id="ana", action=RUN_CANCEL)).entries == []
    finally:
        await close_agents(agents)


@tool
async def slow_lookup(key: str) -> str:
    """Look a key up, slowly."""
    await asyncio.sleep(0.6)  # twice the lease: the heartbeat renews it meanwhile
    return f"value of {key}"


def _one_call(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role == "tool":
        return "done"
    return [ToolCall(id="c1", name="slow_lookup", arguments={"key": "k"})]


@pytest.mark.parametrize("method", ["write_entry", "release", "renew"])
async def test_a_run_whose_store_answers_none_fails_naming_it_not_as_taken_over(
    tmp_path: Path, method: str
) -> None:
    # Before: OwnershipLostError ("taken over"), though nobody else ever held the turn.
    runtime = SqliteRuntime(tmp_path / "journal.db", lease_seconds=0.3)
    _silence(runtime, method)
    agent = Agent("x", model=FunctionModel(_one_call), tools=[slow_lookup], runtime=runtime)
    try:
        with pytest.raises(StorageError, match=rf"_SaysNothing answered {method}\(\) with a "):
            await agent.run("go", session_id="s", user_id="ana")
    finally:
        await runtime.close()


async def test_an_approved_run_whose_store_does_not_confirm_the_reopen_fails_naming_it(
    tmp_path: Path,
) -> None:
    # Before: OwnershipLostError ("changed hands before its stopped run could go on").
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = Agent(
        "x",
        model=FunctionModel(_one_call),
        tools=[Tool(slow_lookup.fn, destructive=True)],
        runtime=runtime,
        permissions=StandardPermissions(approval="defer"),
    )
    try:
        [pending] = (await agent.run("go", session_id="s", user_id="ana")).pending_approvals
        _silence(runtime, "reopen")
        with pytest.raises(StorageError, match=r"_SaysNothing answered reopen\(\) with a "):
            await agent.resume(
                "go", session_id="s", user_id="ana", approvals={pending.request_id: Approve()}
            )
    finally:
        await runtime.close()
