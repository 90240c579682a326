"""Files that hold users' data are owner-only, whatever the process's umask.

A journal and its -wal and -shm files, and the exports the command line writes, hold prompts,
answers and tool results. Under the common umask 022 they were created readable by every
local account.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from _cli import clean_env, loomflow

from loomflow import Agent
from loomflow.audit import AuditLog
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


async def _one_run(path: Path, real: Path | None = None) -> None:
    """One run on ``path``; ``real`` is the file a symlink ``path`` points to."""
    runtime = SqliteRuntime(path)
    try:
        agent = Agent("x", model=ScriptedModel(["hi"]), runtime=runtime, telemetry=False)
        await agent.run("my card is 4111", session_id="chat", user_id="ana")
        # While the runtime is open the -wal and -shm files exist.
        for suffix in ("", "-wal", "-shm"):
            file = (real or path).with_name((real or path).name + suffix)
            assert _mode(file) == 0o600, f"{file.name} is {oct(_mode(file))}"
    finally:
        await runtime.close()


def test_a_new_journal_and_its_wal_files_are_owner_only(tmp_path: Path, open_umask: None) -> None:
    path = tmp_path / "new-dir" / "journal.db"
    asyncio.run(_one_run(path))
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700  # the directory it made for it


def test_an_existing_journal_keeps_the_mode_its_operator_gave_it(
    tmp_path: Path, open_umask: None
) -> None:
    path = tmp_path / "journal.db"
    asyncio.run(_one_run(tmp_path / "first.db"))
    path.touch()
    path.chmod(0o640)  # group-readable on purpose: left as it is
    runtime = SqliteRuntime(path)

    async def open_and_close() -> None:
        await runtime.open()
        await runtime.close()

    asyncio.run(open_and_close())
    assert _mode(path) == 0o640


async def _seed(url: str) -> None:
    runtime, audit = SqliteRuntime(url), AuditLog(url)
    try:
        agent = Agent(
            "x", model=ScriptedModel(["hi"]), runtime=runtime, audit=audit, telemetry=False
        )
        await agent.run("hello", session_id="chat", user_id="ana")
    finally:
        await runtime.close()
        await audit.close()


@pytest.mark.parametrize(
    "command",
    [
        ["users", "export", "ana"],
        ["audit", "export", "--user", "ana"],
        ["checkpoints", "export", "--user", "ana"],
    ],
    ids=["users", "audit", "checkpoints"],
)
def test_exports_written_to_a_file_are_owner_only(
    tmp_path: Path, open_umask: None, command: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_seed(url))
    out = tmp_path / "export.json"
    done = loomflow("--url", url, *command, "-o", str(out), env=clean_env())
    assert done.returncode == 0, done.stderr
    assert "ana" in out.read_text(encoding="utf-8") or command[0] == "checkpoints"
    assert _mode(out) == 0o600


def test_a_journal_made_through_a_symlink_is_owner_only(tmp_path: Path, open_umask: None) -> None:
    # A path that is a symlink to a file not made yet (a journal kept on another volume):
    # SQLite created the target through the link with the umask's 0644.
    target = tmp_path / "volume" / "journal.db"
    link = tmp_path / "journal.db"
    link.symlink_to(target)
    asyncio.run(_one_run(link, target))
    assert _mode(target) == 0o600
    assert _mode(target.parent) == 0o700


def test_every_directory_made_for_a_journal_is_owner_only(tmp_path: Path, open_umask: None) -> None:
    # mkdir -p's way gave the directories above the last one the umask's 0755.
    path = tmp_path / "var" / "lib" / "app" / "journal.db"
    asyncio.run(_one_run(path))
    for directory in (path.parent, path.parent.parent, path.parent.parent.parent):
        assert _mode(directory) == 0o700, f"{directory} is {oct(_mode(directory))}"


def test_a_jsonl_audit_log_keeps_the_modes_its_operator_gave_it(
    tmp_path: Path, open_umask: None
) -> None:
    # Before: the heads file is written anew (and renamed over) at every append, and the log
    # at every erasure, each as 0640: an operator's `chmod 600` lasted until the next one.
    log = tmp_path / "audit.jsonl"
    heads = tmp_path / "audit.jsonl.heads"

    async def record_then_erase(first: bool) -> None:
        audit = AuditLog(f"jsonl:///{log}")
        try:
            for user in ("ana", "bo"):
                await audit.record("x.y", user_id=user, actor="t", payload={"k": 1})
            if first:
                return
            await audit.store.erase("ana", reason="asked")
        finally:
            await audit.store.close()

    asyncio.run(record_then_erase(first=True))
    assert (_mode(log), _mode(heads)) == (0o640, 0o640)  # as made
    log.chmod(0o600)
    heads.chmod(0o600)
    asyncio.run(record_then_erase(first=False))
    assert (_mode(log), _mode(heads)) == (0o600, 0o600)
