"""Every CLI command group opens its stores through the composition root, ``Stores``.

Reading commands must not change a database they read: listing checkpoints or showing
budget totals creates no journal (or other) tables that were not there.
"""

from __future__ import annotations

import ast
import asyncio
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import loomflow.cli as cli_package
from loomflow.checkpoints import checkpoint_store_from_url
from loomflow.governance.budget import SqlBudgetStore

# Store factories the CLI must reach only through ``Stores``.
_FACTORIES = {
    "checkpoint_store_from_url",
    "budget_store_from_url",
    "audit_store_from_url",
    "memory_store_from_url",
    "database_from_url",
}


def loomflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        return sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master"))


def test_no_cli_module_builds_a_store_from_a_url_itself() -> None:
    offenders = []
    for module in Path(cli_package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            name = None
            if isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.alias):
                name = node.name
            if name in _FACTORIES:
                offenders.append(f"{module.name}:{getattr(node, 'lineno', '?')} {name}")
    assert offenders == []


def test_checkpoint_export_on_a_checkpoint_only_database_opens_no_journal(
    tmp_path: Path,
) -> None:
    path = tmp_path / "checkpoints.db"

    async def make() -> None:
        store = checkpoint_store_from_url(f"sqlite:///{path}")
        await store.migrate()
        await store.close()

    asyncio.run(make())
    before = _tables(path)
    assert not any("journal" in t for t in before), before
    done = loomflow("--url", f"sqlite:///{path}", "checkpoints", "export", "--user", "alice")
    assert done.returncode == 0, done.stderr
    assert '"checkpoints": []' in done.stdout
    assert _tables(path) == before  # no journal tables, nothing migrated


def test_checkpoint_list_leaves_the_tables_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    assert loomflow("--url", url, "migrate").returncode == 0
    before = _tables(path)
    listed = loomflow("--url", url, "checkpoints", "list", "nope", "--user", "alice")
    assert listed.returncode != 0  # no such session
    assert "no session 'nope'" in listed.stderr
    assert _tables(path) == before


def test_checkpoints_refuse_a_missing_database(tmp_path: Path) -> None:
    path = tmp_path / "typo.db"
    done = loomflow("--url", f"sqlite:///{path}", "checkpoints", "export", "--user", "alice")
    assert done.returncode != 0
    assert "no journal at" in done.stderr
    assert not path.exists()


def test_budget_show_on_a_budget_database_adds_no_tables(tmp_path: Path) -> None:
    path = tmp_path / "budget.db"

    async def make() -> None:
        store = SqlBudgetStore(f"sqlite:///{path}")
        await store.migrate()
        await store.close()

    asyncio.run(make())
    before = _tables(path)
    shown = loomflow("budget", "--budget-url", f"sqlite:///{path}", "show")
    assert shown.returncode == 0, shown.stderr
    assert "no budget usage recorded" in shown.stdout
    assert _tables(path) == before
    missing = loomflow("budget", "--budget-url", f"sqlite:///{tmp_path / 'typo.db'}", "show")
    assert missing.returncode != 0
    assert "no budget store at" in missing.stderr
    assert not (tmp_path / "typo.db").exists()


READ_COMMANDS = (
    ["runs", "list"],
    ["budget", "show"],
    ["audit", "verify"],
    ["users", "export", "bob"],
    ["checkpoints", "list", "s"],
    ["approvals", "list"],
)


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
@pytest.mark.parametrize(
    "edit", ["DELETE FROM loom_schema_version", "DROP TABLE loom_schema_version"]
)
def test_read_commands_say_the_version_rows_are_lost_not_that_no_store_is_there(
    kind: str, edit: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # They said the database "holds no loomflow store yet" and to run `loomflow migrate`,
    # which then refused (rightly): the tables are there, their version rows are not.
    if kind == "sqlite":
        path = tmp_path / "journal.db"
        url = f"sqlite:///{path}"
    else:
        url = request.getfixturevalue("pg_dsn")
    assert loomflow("--url", url, "migrate").returncode == 0
    if kind == "sqlite":
        with sqlite3.connect(path) as db:
            db.execute(edit)
    else:
        asyncio.run(_pg_execute(url, edit))
    for command in READ_COMMANDS:
        done = loomflow("--url", url, *command)
        assert done.returncode == 1, (command, done.stdout)
        assert "holds no loomflow store yet" not in done.stderr, command
        assert re.match(
            r"loomflow: error: '.*' holds loomflow tables \(loom_\w+, .*\) but "
            r"loom_schema_version records no schema version: the version table lost its rows",
            done.stderr,
        ), done.stderr
    migrate = loomflow("--url", url, "migrate")  # which agrees, and changes nothing either
    assert migrate.returncode == 1
    assert "the version table lost rows" in migrate.stderr


async def _pg_execute(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def test_a_database_without_loomflow_tables_still_holds_no_store_yet(tmp_path: Path) -> None:
    # The control: a table of another application whose name merely starts like ours.
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE loomish (id INTEGER)")
        db.execute("CREATE TABLE loom_schema_version (component TEXT, version INTEGER)")
    done = loomflow("--url", f"sqlite:///{path}", "runs", "list")
    assert done.returncode == 1
    assert "holds no loomflow store yet" in done.stderr, done.stderr
