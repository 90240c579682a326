"""One damaged checkpoint row shows as damaged in listings and exports; the rest is listed.

A checkpoint row edited by hand (text in a number column, a negative ``prompt_index``, a
transcript that does not decode) made ``checkpoints list``, ``checkpoints export`` and the
data-access export ``users export`` exit 1 with nothing. ``resume()`` already fell back to the
journal. Now each listing carries on and shows the row with what it still tells and why it
cannot be read.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from loomflow.agent import Agent, Tuning
from loomflow.checkpoints import Checkpoint, SqlCheckpointStore, checkpoint_store_for
from loomflow.errors import CheckpointError
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.testing.checkpoint_conformance import Shop

# (edit, what the reason names), per backend: PostgreSQL's columns hold only numbers, but ones
# no checkpoint has. Each edits the oldest of alice's four snapshots of session "s".
EDITS = {
    "sqlite": [
        ("turn = 'two'", "turn holds 'two'"),
        ("created_at = 'yesterday'", "created_at holds 'yesterday'"),
        ("prompt_index = -1", "prompt_index: Input should be greater than or equal to 0"),
        ("messages = X'00'", "cannot be decoded"),
        ("final = 'yes'", "final holds 'yes'"),
    ],
    "postgres": [
        ("prompt_index = -1", "prompt_index: Input should be greater than or equal to 0"),
        ("turn = -3", "turn: Input should be greater than or equal to 0"),
        ("created_at = 'NaN'", "created_at holds nan"),
        ("messages = '\\x7b6e6f74'::bytea", "cannot be decoded"),
    ],
}
CASES = [
    pytest.param(kind, edit, named, id=f"{kind}-{edit}", marks=marks)
    for kind, marks in (("sqlite", []), ("postgres", [pytest.mark.postgres]))
    for edit, named in EDITS[kind]
]
OLDEST = "seq = (SELECT MIN(seq) FROM loom_checkpoints)"


async def _recorded(runtime: JournalRuntime) -> None:
    """alice shops in sessions "s" and "t" (four and four snapshots), bob in "s"."""
    shop = Shop()
    agent = Agent(
        "You shop.",
        model=shop.model,
        tools=[shop.tool],
        runtime=runtime,
        tuning=Tuning(checkpoint=True),
    )
    await agent.run("shop", session_id="s", user_id="alice")
    await agent.run("shop", session_id="t", user_id="alice")
    await agent.run("shop", session_id="s", user_id="bob")


async def _database(
    tmp_path: Path, dsn: str = ""
) -> tuple[str, Callable[[str], Awaitable[None]], Callable[[], Awaitable[JournalRuntime]]]:
    """A journal (SQLite, or PostgreSQL at ``dsn``): its URL, a way to edit its rows by hand,
    and a way to open runtimes on it."""
    if not dsn:
        path = tmp_path / "journal.db"

        async def edit(sql: str) -> None:
            def run() -> None:
                with sqlite3.connect(path) as conn:
                    conn.execute(sql)

            await asyncio.to_thread(run)

        async def sqlite_runtime() -> JournalRuntime:
            return SqliteRuntime(path)

        return f"sqlite:///{path}", edit, sqlite_runtime

    async def pg_edit(sql: str) -> None:
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    async def pg_runtime() -> JournalRuntime:
        return await PostgresRuntime.connect(dsn)

    return dsn, pg_edit, pg_runtime


async def _recorded_journal(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[str, Callable[[str], Awaitable[None]], Callable[[], Awaitable[JournalRuntime]]]:
    """:func:`_database` on ``kind`` ("sqlite" or "postgres"), with :func:`_recorded`'s runs."""
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    url, tamper, make = await _database(tmp_path, dsn)
    runtime = await make()
    try:
        await _recorded(runtime)
    finally:
        await runtime.close()
    return url, tamper, make


def _cli(url: str, cwd: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", url, *command],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.mark.parametrize(("kind", "edit", "named"), CASES)
async def test_listings_and_exports_show_a_damaged_checkpoint_and_carry_on(
    kind: str, edit: str, named: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url, tamper, make = await _recorded_journal(kind, request, tmp_path)
    runtime = await make()
    try:
        oldest = await checkpoint_store_for(runtime).list_checkpoints("s", user_id="alice")
        damaged = oldest[-1].id
    finally:
        await runtime.close()
    await tamper(f"UPDATE loom_checkpoints SET {edit} WHERE {OLDEST}")

    listed_json = await asyncio.to_thread(
        _cli, url, tmp_path, "checkpoints", "list", "s", "--user", "alice", "--json"
    )
    assert listed_json.returncode == 0, listed_json.stderr
    rows = [json.loads(line) for line in listed_json.stdout.splitlines()]
    assert [r["id"] for r in rows][-1] == damaged
    assert [("unreadable" in r) for r in rows] == [False, False, False, True]
    assert named in rows[-1]["unreadable"]

    exported = await asyncio.to_thread(
        _cli, url, tmp_path, "checkpoints", "export", "--user", "alice"
    )
    assert exported.returncode == 0, exported.stderr
    document = json.loads(exported.stdout)
    assert len(document["checkpoints"]) == 8  # s and t: the damaged one among them
    [shown] = [c for c in document["checkpoints"] if "unreadable" in c]
    assert (shown["id"], shown["session_id"], shown["user_id"]) == (damaged, "s", "alice")

    access = await asyncio.to_thread(_cli, url, tmp_path, "users", "export", "alice")
    assert access.returncode == 0, access.stderr
    everything = json.loads(access.stdout)
    assert everything["counts"]["checkpoints"] == 8
    assert [c["id"] for c in everything["checkpoints"]["checkpoints"] if "unreadable" in c] == [
        damaged
    ]
    assert everything["counts"]["journal entries"] > 0  # and the rest of the export is there

    from loomflow.checkpoints import UnreadableCheckpoint  # new with the fix

    runtime = await make()
    try:
        store = checkpoint_store_for(runtime)
        assert isinstance(store, SqlCheckpointStore)
        with pytest.raises(CheckpointError, match=re.escape(named)):  # what resume() reads
            await store.list_checkpoints("s", user_id="alice")
        listed = await store.listing("s", user_id="alice")
        assert [type(c) for c in listed] == [Checkpoint] * 3 + [UnreadableCheckpoint]
        bad = listed[-1]
        assert isinstance(bad, UnreadableCheckpoint)
        assert (bad.id, bad.session_id, bad.user_id) == (damaged, "s", "alice")
        assert named in bad.unreadable
    finally:
        await runtime.close()


async def test_the_table_marks_the_damaged_row_and_says_why(tmp_path: Path) -> None:
    url, tamper, make = await _database(tmp_path)
    runtime = await make()
    try:
        await _recorded(runtime)
    finally:
        await runtime.close()
    await tamper(f"UPDATE loom_checkpoints SET turn = 'two' || char(27) || '[2J' WHERE {OLDEST}")
    done = await asyncio.to_thread(
        _cli, url, tmp_path, "checkpoints", "list", "s", "--user", "alice"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 5  # the header and four rows
    assert lines[-1].split()[1] == "unreadable"
    assert "turn holds 'two\\x1b[2J'" in done.stderr  # why, with the escape shown, not sent
    assert "\x1b" not in done.stdout + done.stderr


NEWEST_OF_ALICE_S = (
    "seq = (SELECT MAX(seq) FROM loom_checkpoints WHERE session_id = 's' AND user_id = 'alice')"
)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ("checkpoint_id = 'cp' || char(0)", "checkpoint_id contains the control character U+0000"),
        ("checkpoint_id = printf('%.300c', 'x')", "checkpoint_id is 300 bytes long"),
        ("run_id = run_id || char(10)", "run_id contains the control character U+000A"),
        ("parent_id = char(27) || '[2J'", "parent_id contains the control character U+001B"),
    ],
)
async def test_a_checkpoint_whose_ids_no_put_accepts_is_not_restored(
    tmp_path: Path, edit: str, named: str
) -> None:
    """An id that breaks the id rules (put() refuses it) was read back as it was: resume
    restored such a snapshot and handed its NUL or 300-byte id back as ``restored_from``."""
    _, tamper, make = await _database(tmp_path)
    await _recorded(recording := await make())
    await recording.close()
    await tamper(f"UPDATE loom_checkpoints SET {edit} WHERE {NEWEST_OF_ALICE_S}")
    for strict in (True, False):  # strict first: a replay writes new snapshots
        runtime = await make()
        try:
            shop = Shop()
            tuning = Tuning(checkpoint=True, strict_replay=strict)
            agent = Agent("You shop.", model=shop.model, tools=[shop.tool], runtime=runtime,
                          tuning=tuning)  # fmt: skip
            if strict:
                with pytest.raises(CheckpointError, match=re.escape(named)):
                    await agent.resume("shop", session_id="s", user_id="alice")
            else:
                result = await agent.resume("shop", session_id="s", user_id="alice")
                assert result.restored_from is None  # the journal replayed instead
                assert result.output.startswith("bought: ")
                assert shop.bought == []
                store = checkpoint_store_for(runtime)
                assert isinstance(store, SqlCheckpointStore)
                listed = await store.listing("s", user_id="alice")
                [bad] = [c for c in listed if not isinstance(c, Checkpoint)]
                assert named in bad.unreadable
        finally:
            await runtime.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_snapshot_moved_under_another_users_key_goes_with_its_users_erasure(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Found by the user key alone: bob's snapshots, moved under alice's key in the database,
    # left bob's export, and `users forget bob` left his transcript behind (memory rows and
    # journal sessions moved the same way go with either user's export and erasure).
    from loomflow.runtime._store import Scope

    url, tamper, make = await _recorded_journal(kind, request, tmp_path)
    alices = Scope("s", "alice")
    await tamper(
        f"UPDATE loom_checkpoints SET scope = '{alices.key}', user_key = '{alices.user_key}' "
        "WHERE user_id = 'bob'"
    )
    output = tmp_path / "bob.json"
    exported = await asyncio.to_thread(
        _cli, url, tmp_path, "users", "export", "bob", "-o", str(output)
    )
    assert exported.returncode == 0, exported.stderr
    snapshots = json.loads(output.read_text())["checkpoints"]["checkpoints"]
    assert [(c["session_id"], c["user_id"]) for c in snapshots] == [("s", "bob")] * 4
    forgot = await asyncio.to_thread(_cli, url, tmp_path, "users", "forget", "bob", "--yes")
    assert forgot.returncode == 0, forgot.stderr
    assert "checkpoints: 4," in forgot.stdout
    runtime = await make()
    try:
        store = checkpoint_store_for(runtime)
        assert (await store.export_user("bob"))["checkpoints"] == []
        left = (await store.export_user("alice"))["checkpoints"]
        assert [c["user_id"] for c in left] == ["alice"] * 8  # none of alice's went
    finally:
        await runtime.close()
