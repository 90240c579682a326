"""A journal entry that decodes but is not what its step returns is damage, not a crash.

A tool call's entry must hold a tool outcome and a model call's its chunks with the response;
a row edited to hold ``12345``, a list, or a value class the registry does not know (read back
as plain data) used to reach the agent loop and raise ``AttributeError`` (or blame the model
for "a stream without a response") on every resume, so the session could never finish. Now it
is handled as an entry that does not decode: the step runs again once and its entry is
replaced (later resumes replay it), or ``CorruptEntryError`` names it under strict replay.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent, ToolCall, Tuning, tool
from loomflow.errors import CorruptEntryError
from loomflow.models import ScriptedModel
from loomflow.runtime import PostgresRuntime, SqliteRuntime

CALLS: list[str] = []


@tool
async def refund(order_id: str) -> str:
    """Refund an order."""
    CALLS.append(order_id)
    return f"refunded {order_id}"


def _agent(runtime: Any, *, strict: bool = False) -> Agent:
    model = ScriptedModel(
        [
            [ToolCall(id="c1", name="refund", arguments={"order_id": "42"})],
            [ToolCall(id="c2", name="refund", arguments={"order_id": "43"})],
            "Done.",
        ]
    )
    return Agent("support", model=model, tools=[refund], runtime=runtime, memory=False,
                 tuning=Tuning(strict_replay=strict))  # fmt: skip


MISSHAPEN = {
    "a number": "12345",
    "null": "null",
    "a list": "[1, 2, 3]",
    "an unknown class": '{"$t": "model", "v": {"cls": "os:system", "fields": {}}}',
    "an object": '{"ok": true}',
}


def _edit(path: Path, name_like: str, value: str) -> str:
    with sqlite3.connect(path) as conn:
        [(name,)] = conn.execute(
            "SELECT name FROM loom_entries WHERE name LIKE ?", (name_like,)
        ).fetchall()
        conn.execute(
            "UPDATE loom_entries SET value = CAST(? AS BLOB) WHERE name = ?", (value, name)
        )
    conn.close()
    return str(name)


async def _finished_run(path: Path) -> None:
    runtime = SqliteRuntime(path)
    try:
        result = await _agent(runtime).run("refund", session_id="s1", user_id="ana")
        assert result.output == "Done."
    finally:
        await runtime.close()
    CALLS.clear()


async def _resume(path: Path, *, strict: bool = False) -> Any:
    runtime = SqliteRuntime(path)
    try:
        return await _agent(runtime, strict=strict).resume("refund", session_id="s1", user_id="ana")
    finally:
        await runtime.close()


@pytest.mark.parametrize("value", MISSHAPEN.values(), ids=MISSHAPEN.keys())
async def test_a_tool_entry_that_is_no_outcome_runs_the_tool_once_more(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "journal.db"
    await _finished_run(path)
    _edit(path, "tool_call_0_0%", value)
    with pytest.raises(
        CorruptEntryError, match=r"tool_call_0_0_\w+' holds \w+, not a tool outcome"
    ):
        await _resume(path, strict=True)
    assert CALLS == []  # strict: nothing ran
    result = await _resume(path)
    assert (result.output, CALLS) == ("Done.", ["42"])  # the damaged call ran again, once
    CALLS.clear()
    again = await _resume(path, strict=True)  # its entry was replaced: a clean replay
    assert (again.output, again.fresh_steps, CALLS) == ("Done.", 0, [])


@pytest.mark.parametrize(
    "value", ["[1, 2, 3]", "[]", "{}", '[{"$t": "model", "v": {"cls": "x:y", "fields": {}}}]']
)
async def test_a_model_entry_without_its_response_calls_the_model_again(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "journal.db"
    await _finished_run(path)
    _edit(path, "model_call_1", value)
    with pytest.raises(CorruptEntryError, match="model_call_1' holds"):
        await _resume(path, strict=True)
    result = await _resume(path)
    assert result.output == "Done."
    assert result.fresh_steps >= 1  # the model call, made again, and what followed from it
    again = await _resume(path, strict=True)
    assert (again.output, again.fresh_steps) == ("Done.", 0)


@pytest.mark.postgres
async def test_a_misshapen_tool_entry_on_postgres_runs_again(pg_dsn: str) -> None:
    import asyncpg

    runtime = await PostgresRuntime.connect(pg_dsn)
    try:
        await _agent(runtime).run("refund", session_id="s1", user_id="ana")
    finally:
        await runtime.close()
    CALLS.clear()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(
            "UPDATE loom_entries SET value = convert_to('12345', 'UTF8') "
            "WHERE name LIKE 'tool_call_1_0%'"
        )
    finally:
        await conn.close()
    runtime = await PostgresRuntime.connect(pg_dsn)
    try:
        agent = _agent(runtime)
        result = await agent.resume("refund", session_id="s1", user_id="ana")
        assert (result.output, CALLS) == ("Done.", ["43"])
    finally:
        await runtime.close()
    CALLS.clear()
