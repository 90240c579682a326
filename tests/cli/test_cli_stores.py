"""Every CLI command group opens its stores through the composition root, ``Stores``.

Reading commands must not change a database they read: listing checkpoints or showing
budget totals creates no journal (or other) tables that were not there.
"""

from __future__ import annotations

import ast
import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path

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
