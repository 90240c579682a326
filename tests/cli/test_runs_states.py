"""``loomflow runs list --state/--json`` and ``runs cancel``: true states, crafted rows, errors."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow.errors import ConfigurationError
from loomflow.runtime import RunRecord, SqliteRuntime


def loomflow(*args: str, journal: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMFLOW_")}
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{journal}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def _json_rows(out: str) -> dict[str, dict[str, object]]:
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    return {str(r["session_id"]): r for r in rows}


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    """A journal with a finished run, an open (raised) run and an open run to cancel."""
    path = tmp_path / "journal.db"

    async def build() -> None:
        runtime = SqliteRuntime(path)
        record = RunRecord("orders", "c" * 64, {"prompt": "hi"})
        try:
            async with runtime.session("done", "ana", record=record):
                await runtime.step("s", lambda: 1)
            for session in ("raised", "victim"):
                with pytest.raises(ConfigurationError):
                    async with runtime.session(session, "ana", record=record):
                        raise ConfigurationError("boom")
        finally:
            await runtime.close()

    asyncio.run(build())
    return path


def test_list_reports_true_states_as_json_and_table(journal: Path) -> None:
    result = loomflow("runs", "list", "--json", journal=journal)
    assert result.returncode == 0, result.stderr
    rows = _json_rows(result.stdout)
    assert {k: r["state"] for k, r in rows.items()} == {
        "done": "finished",
        "raised": "open",
        "victim": "open",
    }
    assert rows["done"]["agent"] == "orders"
    result = loomflow("runs", "list", "--state", "open", "--json", journal=journal)
    assert set(_json_rows(result.stdout)) == {"raised", "victim"}
    table = loomflow("runs", "list", journal=journal).stdout
    assert "finished" in table
    assert "orders" in table
    assert loomflow("runs", "list", "--state", "failed", journal=journal).stdout.strip() == (
        "no failed runs in the journal"
    )


def test_list_keeps_to_the_anonymous_sessions_with_anonymous(journal: Path) -> None:
    async def anonymous_run() -> None:
        runtime = SqliteRuntime(journal)
        try:
            async with runtime.session("nobody's", None):
                await runtime.step("s", lambda: 1)
        finally:
            await runtime.close()

    asyncio.run(anonymous_run())
    result = loomflow("runs", "list", "--anonymous", "--json", journal=journal)
    assert result.returncode == 0, result.stderr
    rows = _json_rows(result.stdout)
    assert set(rows) == {"nobody's"}
    assert rows["nobody's"]["user_id"] is None
    none_open = loomflow("runs", "list", "--anonymous", "--state", "open", journal=journal)
    assert none_open.stdout.strip() == "no open runs without a user in the journal"
    both = loomflow("runs", "list", "--anonymous", "--user", "ana", journal=journal)
    assert both.returncode == 2  # one or the other


def test_cancel_from_the_cli(journal: Path) -> None:
    result = loomflow("runs", "cancel", "victim", "--user", "ana", "--json", journal=journal)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "session_id": "victim",
        "user_id": "ana",
        "cancelled": True,
    }
    rows = _json_rows(loomflow("runs", "list", "--json", journal=journal).stdout)
    assert rows["victim"]["state"] == "cancelled"
    assert rows["raised"]["state"] == "open"
    # Finished, unknown, or another user's: nothing to cancel, a clear message, exit 1.
    for args in (["done", "--user", "ana"], ["nope", "--user", "ana"], ["raised", "--user", "bo"]):
        result = loomflow("runs", "cancel", *args, journal=journal)
        assert result.returncode == 1
        assert "has no open or interrupted run to cancel" in result.stderr
    result = loomflow("runs", "cancel", "", "--user", "ana", journal=journal)
    assert result.returncode == 1
    assert "session_id" in result.stderr
    # The cancel is in the audit log beside the journal, with the person as actor.
    result = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{journal}", "audit", "query",
         "--user", "ana", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    entries = json.loads(result.stdout)["entries"]
    cancels = [e for e in entries if e["action"] == "run.cancel"]
    assert len(cancels) == 1
    assert cancels[0]["actor"].startswith("cli:")


def test_crafted_rows_are_listed_as_unreadable_not_a_crash(journal: Path) -> None:
    with sqlite3.connect(journal) as conn:
        conn.execute("UPDATE loom_sessions SET status = 'pwned' WHERE session_id = 'done'")
        conn.execute("UPDATE loom_sessions SET attempts = 'many' WHERE session_id = 'raised'")
        conn.execute("UPDATE loom_sessions SET owner = X'00ff' WHERE session_id = 'victim'")
    result = loomflow("runs", "list", "--json", journal=journal)
    assert result.returncode == 0, result.stderr
    rows = _json_rows(result.stdout)
    assert {r["state"] for r in rows.values()} == {"unreadable"}
    result = loomflow("runs", "list", journal=journal)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("unreadable") == 3
    result = loomflow("runs", "list", "--state", "unreadable", "--json", journal=journal)
    assert len(_json_rows(result.stdout)) == 3


def test_a_huge_tool_name_from_the_model_does_not_widen_every_line(tmp_path: Path) -> None:
    # A model's tool name is not checked (an unknown tool is the model's error to see), and
    # `runs show` padded every line of the table to it: a 100,000-character name made each
    # line 100 KB wide. Cells stop at 1,000 characters; --json still has the whole name.
    from loomflow import Agent, ToolCall
    from loomflow.models import ScriptedModel

    path = tmp_path / "journal.db"
    name = "t" * 100_000

    async def build() -> None:
        runtime = SqliteRuntime(path)
        try:
            script = [[ToolCall(id="c1", name=name, arguments={})], "done"]
            agent = Agent("x", model=ScriptedModel(script), runtime=runtime, memory=False)
            await agent.run("go", session_id="wide", user_id="ana")
        finally:
            await runtime.close()

    asyncio.run(build())
    result = loomflow("runs", "show", "wide", journal=path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4  # header, model call, tool call, model call
    assert max(len(line) for line in lines) < 1200
    assert "t" * 999 + "…" in result.stdout
    shown = loomflow("runs", "show", "wide", "--json", journal=path)
    assert name in shown.stdout


def test_show_does_not_promise_to_run_again_a_step_a_newer_release_wrote(
    journal: Path,
) -> None:
    # A step written by a newer loomflow (a codec version above this one's) is not run again
    # on resume: NewerEntryError stops the run, so a side effect is not done twice. `runs
    # show` listed it as "damaged: runs again", telling an operator the opposite.
    from loomflow.errors import NewerEntryError

    with sqlite3.connect(journal) as conn:
        conn.execute("UPDATE loom_entries SET codec_version = 99")
    shown = loomflow("runs", "show", "done", journal=journal)
    assert shown.returncode == 0, shown.stderr
    assert "runs again" not in shown.stdout
    assert "newer loomflow" in shown.stdout
    rows = [
        json.loads(line)
        for line in loomflow("runs", "show", "done", "--json", journal=journal).stdout.splitlines()
    ]
    assert rows
    assert all("newer" in str(r["damage"]) for r in rows)

    async def resume() -> None:
        runtime = SqliteRuntime(journal)
        ran: list[int] = []
        try:
            with pytest.raises(NewerEntryError):
                async with runtime.session("done", "ana", resume=True):
                    await runtime.step("s", lambda: ran.append(1))
        finally:
            await runtime.close()
        assert ran == []

    asyncio.run(resume())


def test_a_second_session_row_of_the_same_user_does_not_ask_for_user_again(
    journal: Path,
) -> None:
    # A session row copied under a key spelled otherwise (a space in its JSON) is one more row
    # of the same (session, user). Every command taking the session said "has runs of several
    # users ('ana', 'ana'): pick one with --user", also when given --user ana: no way out.
    with sqlite3.connect(journal) as conn:
        conn.execute(
            "INSERT INTO loom_sessions (scope, session_id, user_id, epoch, open, updated_at) "
            'SELECT \'["done", "ana"]\', session_id, user_id, epoch, 1, updated_at + 10 '
            "FROM loom_sessions WHERE session_id = 'done'"
        )
    listed = loomflow("runs", "list", "--json", journal=journal).stdout.splitlines()
    states = sorted(json.loads(r)["state"] for r in listed if '"done"' in r)
    assert states == ["finished", "unreadable"]  # the copy is listed, marked
    for args in (["--user", "ana"], []):
        shown = loomflow("runs", "show", "done", *args, journal=journal)
        assert shown.returncode == 0, shown.stderr
        assert "replays" in shown.stdout
        listed_ckpt = loomflow("checkpoints", "list", "done", *args, journal=journal)
        assert listed_ckpt.returncode == 0, listed_ckpt.stderr
