"""A session's lease row edited by hand is reported before any step, and at once.

SQLite keeps any type in any column, and PostgreSQL's SMALLINT and double hold values no
release writes. An ``open`` no release writes read as an open run, so a resume of a finished
run ran a fresh epoch and its journaled side effect again, strict or not; a ``lease_until``
that never compares below the clock made a resume wait out its whole turn timeout and then
call the session busy. Now the claim raises ``CorruptEntryError`` naming the row.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _hand_edits import Charge, charged_once, sqlite_exec

from loomflow.errors import CorruptEntryError, SessionBusyError
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.runtime._store import Scope

BOTH = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def per_backend(edits: dict[str, list[str]]) -> list[Any]:
    """(backend, value) parameters: each backend with the values its column can hold."""
    marks = {"postgres": [pytest.mark.postgres]}
    return [
        pytest.param(kind, value, marks=marks.get(kind, []), id=f"{kind}-{value}")
        for kind, values in edits.items()
        for value in values
    ]


@pytest.fixture(params=BOTH)
async def journal(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """(kind, a factory of runtimes on one real journal, a way to edit its rows by hand)."""
    kind = request.param
    dsn = request.getfixturevalue("pg_dsn") if kind == "postgres" else ""
    path = tmp_path / "journal.db"
    opened: list[JournalRuntime] = []

    async def runtime(**options: Any) -> JournalRuntime:
        made: JournalRuntime
        if kind == "sqlite":
            made = SqliteRuntime(path, **options)
        else:
            made = await PostgresRuntime.connect(dsn, **options)
        opened.append(made)
        return made

    async def edit(*statements: str) -> None:
        if kind == "sqlite":
            await asyncio.to_thread(sqlite_exec, path, *statements)
            return
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            for sql in statements:
                await conn.execute(sql)
        finally:
            await conn.close()

    try:
        yield kind, runtime, edit, path
    finally:
        for made in opened:
            await made.close()


# -- loom_sessions.open --------------------------------------------------------------------------

OPEN_EDITS = {
    "sqlite": ["'yes'", "2", "-1", "x'01'"],
    "postgres": ["2", "-1"],  # SMALLINT: only numbers, but ones no release writes
}


@pytest.mark.parametrize(("journal", "value"), per_backend(OPEN_EDITS), indirect=["journal"])
@pytest.mark.parametrize("strict", [False, True])
async def test_an_open_no_release_writes_is_a_damaged_lease_row(
    journal: Any, value: str, strict: bool
) -> None:
    _, make, edit, _ = journal
    runtime = await make(strict_replay=strict)
    charge = Charge()
    await charged_once(runtime, charge)
    await edit(f"UPDATE loom_sessions SET open = {value}")
    # It used to read as an open run: resume ran a fresh epoch and charged again.
    for resume in (True, True, False):  # and a refusal leaves nothing that reads otherwise
        with pytest.raises(CorruptEntryError, match=r"lease row is damaged \(open .*'s'.*'u'"):
            async with runtime.session("s", "u", resume=resume):
                await runtime.step("charge", charge, 10)
    assert charge.calls == 1
    # A listing shows the row as damaged rather than as an open run.
    [info] = await runtime.sessions(session_id="s")
    assert info.state == "unreadable"
    assert (await runtime.count_states())["unreadable"] == 1


async def test_peek_treats_a_damaged_open_as_damaged(journal: Any) -> None:
    _, make, edit, _ = journal
    runtime = await make()
    await charged_once(runtime, Charge())
    scope = Scope("s", "u")
    assert (await runtime._store.peek_last_run(scope)) is not None  # the control
    await edit("UPDATE loom_sessions SET open = 2")
    assert await runtime._store.peek_last_run(scope) is None  # the claim path names it


# -- loom_sessions.lease_until -----------------------------------------------------------------

LEASE_EDITS = {
    "sqlite": ["'soon'", "x'00'"],
    "postgres": ["'NaN'", "'Infinity'"],  # never earlier than now: no lease runs out
}


@pytest.mark.parametrize(("journal", "value"), per_backend(LEASE_EDITS), indirect=["journal"])
@pytest.mark.parametrize("crashed", [False, True])
async def test_a_lease_until_no_claim_writes_is_reported_at_once(
    journal: Any, value: str, crashed: bool
) -> None:
    _, make, edit, _ = journal
    runtime = await make(turn_timeout=20)
    charge = Charge()
    await charged_once(runtime, charge, finish=not crashed)
    # Held by a worker on another host: only the lease's end could free it, and it never ends.
    await edit(
        "UPDATE loom_sessions SET owner = 'ns:1:elsewhere:01J0', "
        f"lease_until = {value}, open = {int(crashed)}"
    )
    started = time.monotonic()
    with pytest.raises(CorruptEntryError, match=r"lease row is damaged \(lease_until"):
        async with runtime.session("s", "u", resume=True):
            await runtime.step("charge", charge, 10)
    assert time.monotonic() - started < 10  # not after the whole turn timeout
    assert charge.calls == 1
    [info] = await runtime.sessions(session_id="s")
    assert info.state == "unreadable"


async def test_a_live_lease_still_makes_a_resume_wait(journal: Any) -> None:
    # The control: a well-formed lease held elsewhere is waited for, not called damaged.
    _, make, edit, _ = journal
    runtime = await make(turn_timeout=0.3)
    await charged_once(runtime, Charge(), finish=False)
    await edit(
        "UPDATE loom_sessions SET owner = 'ns:1:elsewhere:01J0', lease_until = 1e12, open = 1"
    )
    with pytest.raises(SessionBusyError):
        async with runtime.session("s", "u", resume=True):
            pass


# -- loom_sessions.epoch and token, as listed --------------------------------------------------

NUMBER_EDITS = {
    "sqlite": [
        "epoch = -3",
        "epoch = 'x'",
        "epoch = 1.5",
        "epoch = 9223372036854775807",
        "token = 'x'",
        "token = -5",
    ],
    "postgres": ["epoch = -3", "epoch = 9223372036854775807", "token = -5"],
}


@pytest.mark.parametrize(("journal", "value"), per_backend(NUMBER_EDITS), indirect=["journal"])
async def test_a_listing_shows_a_row_resume_refuses_as_unreadable(journal: Any, value: str) -> None:
    _, make, edit, _ = journal
    runtime = await make()
    await charged_once(runtime, Charge())
    await edit(f"UPDATE loom_sessions SET {value}")
    # It listed as "finished", while every resume refused it as damaged.
    [info] = await runtime.sessions(session_id="s")
    assert info.state == "unreadable"
    assert await runtime.sessions(session_id="s", state="finished") == []
    assert [i.session_id for i in await runtime.sessions(state="unreadable")] == ["s"]
    with pytest.raises(CorruptEntryError, match="lease row is damaged"):
        async with runtime.session("s", "u", resume=True):
            pass
