"""Numbers read back from storage are ASCII digits or not numbers at all.

``str.isdigit`` is true for "²" and other digit-like characters that ``int()`` refuses, so a
crafted owner, step name or legacy column holding one must be taken for "not a number", not
raise ``ValueError`` out of a listing or a lease check.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

from loomflow import Agent, ToolCall, tool
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime
from loomflow.runtime._legacy import _as_int
from loomflow.runtime._owner import is_this_process, pid_namespace


def test_an_owner_with_a_digit_like_pid_is_not_this_process() -> None:
    host = socket.gethostname()
    assert is_this_process(f"{pid_namespace()}:{os.getpid()}:{host}:x")  # the control
    for pid in ("²", "١٢", "", "-1", f"{os.getpid()}²"):
        assert not is_this_process(f"{pid_namespace()}:{pid}:{host}:x"), pid


def test_a_legacy_column_with_digit_like_text_is_no_number() -> None:
    assert _as_int(" 12 ") == 12
    for text in ("²", "1²", "١٢", "x"):
        assert _as_int(text) is None, text


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()


async def _one_run(path: Path) -> None:
    runtime = SqliteRuntime(path)
    model = ScriptedModel([[ToolCall(id="c1", name="lookup", arguments={"key": "k"})], "done"])
    agent = Agent("a", model=model, tools=[lookup], runtime=runtime)
    await agent.run("go", session_id="s-1", user_id="ana")
    await runtime.close()


def test_runs_show_reads_past_a_step_named_with_a_digit_like_turn(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    asyncio.run(_one_run(path))
    with sqlite3.connect(path) as conn:
        changed = conn.execute(
            "UPDATE loom_entries SET name = 'model_call_²' WHERE name = 'model_call_0'"
        ).rowcount
    assert changed == 1
    shown = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", "runs", "show",
         "s-1", "--user", "ana"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr
    assert "model_call_²" in shown.stdout
