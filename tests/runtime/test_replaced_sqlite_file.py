"""A SQLite journal file replaced under a running process (a backup restored, the file moved
or deleted): the process must stop writing, and say why, rather than go on committing
frames that SQLite's ``-wal`` file (found by name) pairs with whatever file is at the path."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.errors import StoreUnavailableError
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime

MOVED = "was replaced, moved or deleted after this process opened it"


def _agent(runtime: SqliteRuntime) -> Agent:
    return Agent("sys", model=FunctionModel(lambda messages, tools: "done"), runtime=runtime)


def _sessions(path: Path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT session_id FROM loom_sessions ORDER BY session_id").fetchall()
    finally:
        db.close()
    return [r[0] for r in rows]


async def test_a_backup_restored_under_a_running_process_stops_its_writes(
    tmp_path: Path,
) -> None:
    path, backup = tmp_path / "journal.db", tmp_path / "backup.db"
    runtime = SqliteRuntime(path)
    agent = _agent(runtime)
    try:
        await agent.run("one", session_id="s1", user_id="u")
        live, copy = sqlite3.connect(path), sqlite3.connect(backup)
        live.backup(copy)  # as an operator takes one
        live.close()
        copy.close()
        await agent.run("two", session_id="s2", user_id="u")
        os.replace(backup, path)  # restored while the process runs
        for _ in range(2):  # refused, and refused again: it does not reconnect on its own
            with pytest.raises(StoreUnavailableError, match=MOVED) as caught:
                await agent.run("three", session_id="s3", user_id="u")
            assert str(path) in str(caught.value)
            assert "close and open this runtime" in str(caught.value)
    finally:
        await runtime.close()
    # It used to commit s3 into the -wal file that the restored file is now read with.
    assert "s3" not in _sessions(path)


async def test_a_moved_file_gets_nothing_more(tmp_path: Path) -> None:
    path, moved = tmp_path / "journal.db", tmp_path / "elsewhere.db"
    runtime = SqliteRuntime(path)
    agent = _agent(runtime)
    try:
        await agent.run("one", session_id="s1", user_id="u")
        for name in ("", "-wal", "-shm"):  # the whole database, moved away as one
            os.rename(f"{path}{name}", f"{moved}{name}")
        with pytest.raises(StoreUnavailableError, match=MOVED):
            await agent.run("two", session_id="s2", user_id="u")
    finally:
        await runtime.close()
    assert _sessions(moved) == ["s1"]
    # Closed and opened again, the runtime uses the file at the path (a new one here).
    runtime = SqliteRuntime(path)
    try:
        assert (await _agent(runtime).run("two", session_id="s2", user_id="u")).output == "done"
    finally:
        await runtime.close()
    assert _sessions(path) == ["s2"]


async def test_an_untouched_file_is_used_on_and_on(tmp_path: Path) -> None:
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = _agent(runtime)
    try:
        for n in range(3):
            await agent.run(str(n), session_id=f"s{n}", user_id="u")
    finally:
        await runtime.close()
    assert _sessions(tmp_path / "journal.db") == ["s0", "s1", "s2"]
