"""A journal row whose epoch is not a number belongs to no run, and is reported as damaged.

SQLite keeps text or a blob in the INTEGER epoch column. A load by epoch never saw such a row,
so its journaled side effect ran again without a warning, a corrupt count or, under
``strict_replay``, an error; and the keyset prune, which cast its batch bounds to the key's
types, went round one batch forever once a bound was such a row ('zero' became 0). (On
PostgreSQL the column is BIGINT and cannot hold one.)
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _hand_edits import Charge, charged_once, sqlite_exec

from loomflow.errors import CorruptEntryError
from loomflow.runtime import JournalRuntime, SqliteRuntime


@pytest.fixture
async def journal(tmp_path: Path) -> AsyncIterator[Any]:
    """(a factory of runtimes on one SQLite journal, a way to edit its rows, its path)."""
    path = tmp_path / "journal.db"
    opened: list[JournalRuntime] = []

    async def runtime(**options: Any) -> JournalRuntime:
        made = SqliteRuntime(path, **options)
        opened.append(made)
        return made

    async def edit(*statements: str) -> None:
        await asyncio.to_thread(sqlite_exec, path, *statements)

    try:
        yield runtime, edit, path
    finally:
        for made in opened:
            await made.close()


def _cli(path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("edit_value", ["'zero'", "x'00'", "CAST(epoch AS TEXT) || 'x'", "1e19"])
@pytest.mark.parametrize("finish", [True, False])
async def test_an_entry_whose_epoch_is_not_a_number_is_a_corrupt_entry(
    journal: Any,
    edit_value: str,
    finish: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    make, edit, _ = journal
    charge = Charge()
    await charged_once(await make(), charge, finish=finish)
    await edit(f"UPDATE loom_entries SET epoch = {edit_value}")
    # Invisible to the run's load, the entry let the charge run again without a word.
    strict = await make(strict_replay=True)
    with pytest.raises(CorruptEntryError, match=r"journal row of step 'charge' at position 0 .*"):
        async with strict.session("s", "u", resume=True):
            await strict.step("charge", charge, 10)
    assert charge.calls == 1  # strict: refused before any step
    runtime = await make()
    async with runtime.session("s", "u", resume=True) as run:
        assert await runtime.step("charge", charge, 10) == {"charged": 10, "n": 2}
    assert run.stats.corrupt == 1
    assert "for its epoch" in caplog.text


async def test_a_text_epoch_is_found_by_an_index_range(journal: Any) -> None:
    # TEXT and BLOB sort after every INTEGER, so the load finds them without a scan.
    make, _, path = journal
    await charged_once(await make(), Charge())
    from loomflow.runtime._sql import _LOAD_RUN, _PEEK

    conn = sqlite3.connect(path)
    try:
        for sql, args in ((_LOAD_RUN, ("x", 0)), (_PEEK, ("x",))):
            plan = conn.execute(
                "EXPLAIN QUERY PLAN " + sql.replace("$1", "?1").replace("$2", "?2"), args
            ).fetchall()
            details = [row[-1] for row in plan]
            assert not any(d.startswith("SCAN") for d in details), details
    finally:
        conn.close()


async def test_listings_show_an_entry_with_a_text_epoch(journal: Any) -> None:
    make, edit, path = journal
    await charged_once(await make(), Charge())
    await edit("UPDATE loom_entries SET epoch = 'zero'")
    [entry] = await (await make()).entries("s", "u")
    assert entry.epoch == -1
    for command in (
        ["runs", "list"],
        ["runs", "show", "s"],
        ["users", "export", "u"],
        ["approvals", "list", "--session", "s"],
    ):
        done = await asyncio.to_thread(_cli, path, *command)
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr


async def test_listings_read_past_a_step_name_stored_as_a_blob(journal: Any) -> None:
    # `runs show` reads the model calls back for tool names, and `approvals list` looks for
    # approval steps by name: a bytes name was a TypeError out of both.
    make, edit, path = journal
    runtime = await make()
    async with runtime.session("s", "u"):
        await runtime.step("model_call_0", Charge(), 1)
    await edit("UPDATE loom_entries SET name = CAST(name AS BLOB)")
    for command in (["runs", "show", "s"], ["approvals", "list", "--session", "s"]):
        done = await asyncio.to_thread(_cli, path, *command)
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr
    shown = await asyncio.to_thread(_cli, path, "runs", "show", "s")
    assert "model_call_0" in shown.stdout


@pytest.mark.parametrize("damage", ["epoch = 'zero'", "path = CAST(path AS BLOB)"])
async def test_a_prune_goes_past_a_key_of_another_type(journal: Any, damage: str) -> None:
    # The keyset batches cast their bounds to the key's types: 'zero' became 0, and a prune
    # whose batch ended on that row went round the same batch forever (so would `users
    # forget`, an erasure, past 5,000 rows).
    make, edit, _ = journal
    runtime = await make()
    for i in range(3):
        async with runtime.session(f"s{i}", "u"):
            for k in range(5):
                await runtime.step(f"step_{k}", Charge(), k)
    await edit(f"UPDATE loom_entries SET {damage} WHERE name = 'step_2'")
    await asyncio.sleep(0.005)  # SQLite's clock ticks in ms: the cut-off is after every row
    async with asyncio.timeout(30):
        pruned = await runtime.prune(older_than=timedelta(0), include_open=True, batch_size=2)
    assert pruned == 15
    for i in range(3):
        assert await runtime.entries(f"s{i}", "u") == []
