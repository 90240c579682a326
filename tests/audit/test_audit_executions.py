"""The audit trail records every execution that really began, across failures and crashes.

A tool call is written (``tool.call``) before the tool body runs and its outcome
(``tool.result``) before the journal entry, both with one ``execution`` id; a model call gets
``model.start`` before the request. Here the journal write, then the audit append, fails for
real (another connection holds SQLite's write lock) right after the tool body ran, and a real
process is killed inside a tool body: each time the trail shows exactly the executions that
happened.
"""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.audit import (
    AuditEntry,
    AuditLog,
    InMemoryAuditStore,
    SqliteAuditStore,
    audit_store_from_url,
)
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime

WORKER = Path(__file__).with_name("_trail_worker.py")


def plan(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role != "tool":
        return [ToolCall(id="c1", name="refund", arguments={"order": "o-7"})]
    return f"done: {messages[-1].content}"


def trail(entries: list[AuditEntry]) -> list[tuple[str, str | None]]:
    return [(e.action, e.payload.get("execution")) for e in entries]


@pytest.mark.parametrize("failing", ["journal", "audit"])
async def test_a_failed_write_after_the_tool_ran_leaves_both_executions_in_the_trail(
    failing: str, tmp_path: Path
) -> None:
    journal, audit_db = tmp_path / "journal.db", tmp_path / "audit.db"
    ledger: list[str] = []
    holder: list[sqlite3.Connection] = []

    async def refund(order: str) -> str:
        """Refund an order."""
        ledger.append(order)
        if len(ledger) == 1:
            # Another connection takes the write lock of one database as the body returns:
            # the write that follows (journal entry, or audit tool.result) fails for real.
            con = sqlite3.connect(journal if failing == "journal" else audit_db, timeout=0)
            con.execute("BEGIN EXCLUSIVE")
            holder.append(con)
        return f"refunded {order}"

    runtime = SqliteRuntime(journal, busy_timeout_ms=200)
    audit = AuditLog(SqliteAuditStore(audit_db, busy_timeout_ms=200))
    agent = Agent("x", model=FunctionModel(plan), tools=[refund], runtime=runtime, audit=audit)
    with pytest.raises(Exception, match="locked"):
        await agent.run("refund o-7", session_id="s", user_id="ana")
    holder[0].rollback()
    holder[0].close()

    result = await agent.resume("refund o-7", session_id="s", user_id="ana")
    assert result.output == "done: refunded o-7"
    assert ledger == ["o-7", "o-7"]  # nothing journaled the first execution: it ran again

    entries = (await audit.query(user_id="ana", action="tool.*")).entries
    calls = [e for e in entries if e.action == "tool.call"]
    results = [e for e in entries if e.action == "tool.result"]
    assert not [e for e in entries if e.action == "tool.replay"]  # no "did not run" claim
    assert len(calls) == 2  # one per execution that began
    assert calls[0].payload["execution"] != calls[1].payload["execution"]
    assert calls[0].payload["step"] == calls[1].payload["step"]
    assert all(c.payload["executed"] for c in calls)
    finished = [r.payload["execution"] for r in results]
    if failing == "journal":  # both executions finished; the first was never journaled
        assert finished == [c.payload["execution"] for c in calls]
    else:  # the first one's result could not be written: it began and has no outcome
        assert finished == [calls[1].payload["execution"]]
    assert (await audit.verify()).ok
    await runtime.close()
    await audit.close()


async def test_a_model_answer_whose_journal_write_failed_is_on_record(tmp_path: Path) -> None:
    journal = tmp_path / "journal.db"
    holder: list[sqlite3.Connection] = []

    def answer(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if not holder:  # the provider answers (and bills), then the journal write fails
            con = sqlite3.connect(journal, timeout=0)
            con.execute("BEGIN EXCLUSIVE")
            holder.append(con)
        return "the answer"

    runtime = SqliteRuntime(journal, busy_timeout_ms=200)
    audit = AuditLog(SqliteAuditStore(tmp_path / "audit.db"))
    model = FunctionModel(answer)
    agent = Agent("x", model=model, runtime=runtime, audit=audit)
    with pytest.raises(Exception, match="locked"):
        await agent.run("q", session_id="s", user_id="ana")
    holder[0].rollback()
    holder[0].close()
    await agent.resume("q", session_id="s", user_id="ana")
    assert model.calls == 2  # the first answer was never journaled: asked again

    entries = (await audit.query(user_id="ana", action="model.*")).entries
    assert [a for a, _ in trail(entries)] == [
        "model.start",
        "model.call",
        "model.start",
        "model.call",
    ]
    first, second = entries[1].payload, entries[3].payload
    assert first["execution"] == entries[0].payload["execution"] != second["execution"]
    assert first["output_tokens"] > 0  # what the first, unjournaled call cost is on record
    await runtime.close()
    await audit.close()


async def test_a_failing_model_call_is_recorded_as_an_error() -> None:
    def broken(messages: list[Message], tools: list[ToolSpec]) -> Any:
        raise ConnectionError("provider unreachable")

    store = InMemoryAuditStore()
    agent = Agent("x", model=FunctionModel(broken), audit=AuditLog(store))
    with pytest.raises(ConnectionError):
        await agent.run("q", session_id="s", user_id="ana")
    start, error = (e for e in store.all_entries if e.action.startswith("model."))
    assert (start.action, error.action) == ("model.start", "model.error")
    assert error.payload["execution"] == start.payload["execution"]
    assert error.payload["error_type"] == "ConnectionError"
    assert error.payload["error"] == "provider unreachable"


def _wait_for_line(proc: subprocess.Popen[str], expected: str, timeout: float) -> None:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no {expected!r} from the worker within {timeout}s")
    line = proc.stdout.readline().strip()
    assert line == expected, line


@pytest.mark.crash
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def test_a_process_killed_inside_a_tool_leaves_a_started_execution_in_the_trail(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        request.getfixturevalue("pg_dsn")
        if backend == "postgres"
        else f"sqlite:///{tmp_path / 'journal.db'}"
    )
    ledger = tmp_path / "ledger.txt"
    first = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, str(WORKER), url, str(ledger), "first"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        await asyncio.to_thread(_wait_for_line, first, "IN-TOOL", 60)
    finally:
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.communicate, timeout=30)
    resumed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(WORKER), url, str(ledger), "resume"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["output"] == "done: refunded o-7"
    assert ledger.read_text().splitlines() == ["o-7", "o-7"]  # the killed body, then again

    store = audit_store_from_url(url)
    try:
        entries = (await store.query(user_id="ana", limit=100)).entries
        assert (await store.verify()).ok
    finally:
        await store.close()
    killed_run, resumed_run = entries[0].run_id, entries[-1].run_id
    assert killed_run != resumed_run
    killed = [e for e in entries if e.run_id == killed_run]
    again = [e for e in entries if e.run_id == resumed_run]
    # The killed run: its model call finished, its tool call began and never ended.
    assert [a for a, _ in trail(killed)] == ["run.start", "model.start", "model.call", "tool.call"]
    assert killed[1].payload["execution"] == killed[2].payload["execution"]
    # The resumed run: the model call replayed (it did not run), the tool ran again, in full.
    assert [a for a, _ in trail(again)] == [
        "run.start",
        "model.replay",
        "tool.call",
        "tool.result",
        "model.start",
        "model.call",
        "run.end",
    ]
    assert again[2].payload["execution"] == again[3].payload["execution"]
    assert again[2].payload["execution"] != killed[3].payload["execution"]
    assert again[2].payload["step"] == killed[3].payload["step"]
