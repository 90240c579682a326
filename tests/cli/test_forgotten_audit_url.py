"""Placing, lifting or listing legal holds, and forgetting a user, refuse a journal database
that holds no audit log instead of creating an empty one there.

With the audit log kept elsewhere (``LOOMFLOW_AUDIT_URL``) and the variable forgotten in one
shell, ``users hold`` created a fresh audit log beside the journal, placed the hold there and
exited 0: the real log never had the hold, so ``users forget`` and ``journal prune`` run with
the right settings deleted the held user's data. The ``audit`` commands and the console
already refused such a database.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from _cli import clean_env, loomflow

from loomflow.agent import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import PostgresRuntime, SqliteRuntime
from loomflow.testing.checkpoint_conformance import Shop


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        return sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master"))


def _rows(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT COUNT(*) FROM loom_entries").fetchone()[0])


@pytest.fixture
def deployment(tmp_path: Path) -> tuple[Path, Path]:
    """A journal with bob's finished run and an open one of alice, and the audit log kept in
    a database of its own, in which bob is under legal hold."""
    journal, audit = tmp_path / "journal.db", tmp_path / "audit.db"

    async def record() -> None:
        runtime = SqliteRuntime(journal)
        agent = Agent("x", model=ScriptedModel(["ok", "ok"]), runtime=runtime, audit=None)
        await agent.run("hi", session_id="s", user_id="bob")
        shop = Shop(fail_at=1)  # alice's run raises after its first tool call
        shopper = Agent("x", model=shop.model, tools=[shop.tool], runtime=runtime, audit=None)
        with pytest.raises(ConnectionError):
            await shopper.run("shop", session_id="open", user_id="alice")
        await runtime.close()

    asyncio.run(record())
    env = clean_env(LOOMFLOW_AUDIT_URL=f"sqlite:///{audit}")
    made = loomflow("--url", f"sqlite:///{journal}", "migrate", env=env)
    assert made.returncode == 0, made.stderr
    # migrate created the other stores beside the journal, but the audit log only in audit.db
    held = loomflow("--url", f"sqlite:///{journal}", "users", "hold", "bob", "--reason", "case 7",
                    env=env)  # fmt: skip
    assert held.returncode == 0, held.stderr
    assert "loom_audit" not in _tables(journal)
    return journal, audit


@pytest.mark.parametrize(
    "command",
    [
        ["users", "hold", "alice", "--reason", "case 8"],
        ["users", "release", "bob"],
        # They check the holds: in an empty log made here, bob (held in the real one) was
        # erased, exit 0; `users holds` listed nobody.
        ["users", "forget", "bob", "--yes"],
        ["users", "holds"],
        # The same for the other deletions that keep held users' data: bob's run went with
        # the rest of the journal, and his checkpoints.
        ["journal", "prune", "--all"],
        ["journal", "prune", "--user", "bob", "--all"],
        ["checkpoints", "forget", "--user", "bob", "--yes"],
    ],
    ids=" ".join,
)
def test_a_forgotten_audit_url_is_refused_and_changes_nothing(
    deployment: tuple[Path, Path], command: list[str]
) -> None:
    journal, _ = deployment
    before, entries = _tables(journal), _rows(journal)
    got = loomflow("--url", f"sqlite:///{journal}", *command)
    assert got.returncode == 1, (got.stdout, got.stderr)
    assert "holds no audit log" in got.stderr, got.stderr
    assert "loomflow migrate" in got.stderr
    assert got.stderr.count("\n") == 1, got.stderr
    assert _tables(journal) == before
    assert _rows(journal) == entries


def test_with_the_audit_url_the_hold_is_found_and_kept(deployment: tuple[Path, Path]) -> None:
    journal, audit = deployment
    env = clean_env(LOOMFLOW_AUDIT_URL=f"sqlite:///{audit}")
    entries = _rows(journal)
    pruned = loomflow("--url", f"sqlite:///{journal}", "journal", "prune", "--all", env=env)
    assert pruned.returncode == 0, pruned.stderr
    assert _rows(journal) == entries  # bob is held; alice's run is open
    forgot = loomflow("--url", f"sqlite:///{journal}", "users", "forget", "bob", "--yes", env=env)
    assert forgot.returncode == 1
    assert "legal hold" in forgot.stderr


@pytest.mark.postgres
def test_a_postgres_journal_without_an_audit_log_is_refused_too(pg_dsn: str) -> None:
    async def record() -> None:
        runtime = await PostgresRuntime.connect(pg_dsn)
        agent = Agent("x", model=ScriptedModel(["ok"]), runtime=runtime, audit=None)
        await agent.run("hi", session_id="s", user_id="bob")
        await runtime.close()

    asyncio.run(record())
    for command in (
        ["users", "hold", "bob", "--reason", "case 7"],
        ["users", "release", "bob"],
        ["audit", "query"],  # and still none afterwards: the refusals created no log
    ):
        got = loomflow("--url", pg_dsn, *command)
        assert got.returncode == 1, (command, got.stderr)
        assert "holds no audit log" in got.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["users", "forget", "bob"],
        ["checkpoints", "forget", "--user", "bob"],
        ["audit", "retain", "--older-than", "30d"],
    ],
    ids=" ".join,
)
def test_a_deletion_without_yes_is_bad_usage_before_the_audit_log_is_looked_for(
    deployment: tuple[Path, Path], command: list[str]
) -> None:
    """Without --yes: exit 2 naming --yes, as documented. The missing audit log was reported
    first (exit 1), as if adding --yes would have been enough."""
    journal, _ = deployment
    got = loomflow("--url", f"sqlite:///{journal}", *command)
    assert got.returncode == 2, (got.stdout, got.stderr)
    assert "--yes" in got.stderr
    assert "audit log" not in got.stderr


def test_the_migrate_the_refusal_names_reaches_the_journal_the_command_was_given(
    tmp_path: Path,
) -> None:
    # A journal the runtime wrote alone has no audit log. The refusal's `loomflow migrate`
    # once read only the settings, so run as shown it made .loomflow/journal.db instead.
    async def record() -> None:
        runtime = SqliteRuntime(tmp_path / "journal.db")
        async with runtime, runtime.session("s", "bob"):
            await runtime.step("a", asyncio.sleep, 0)

    asyncio.run(record())
    got = loomflow("--url", "sqlite:///journal.db", "users", "holds", cwd=tmp_path)
    assert got.returncode == 1
    (shown,) = [part for part in got.stderr.split("`") if part.startswith("loomflow migrate")]
    assert shown == "loomflow migrate --url sqlite:///journal.db"
    made = loomflow(*shown.split()[1:], cwd=tmp_path)  # the command as the user copies it
    assert made.returncode == 0, made.stderr
    assert not (tmp_path / ".loomflow").exists()
    assert "loom_audit" in _tables(tmp_path / "journal.db")
    listed = loomflow("--url", "sqlite:///journal.db", "users", "holds", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
