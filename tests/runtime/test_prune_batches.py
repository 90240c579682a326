"""Batched journal prune on memory, a real SQLite file and a real PostgreSQL database.

Each case builds one journal, copies it exactly (SQLite's backup API, ``CREATE DATABASE ...
TEMPLATE`` on PostgreSQL, a deep copy in memory), prunes the original in batches smaller than
the row count and the copy in one statement, and checks that both lost exactly the rows the
documented rules select.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import itertools
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from ulid import ULID

from loomflow.errors import UserError
from loomflow.runtime import InMemoryRuntime, JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.runtime._store import Scope
from loomflow.runtime.inmemory import InMemoryStore

# (session, user): the runs written before the pause ("old"), then after it ("new"); the
# idempotency key of a run's last step, if it has one.
OLD_FINISHED = {("s1", "alice"): "k-alice-old", ("s1", "bob"): None, ("s2", "alice"): None,
                ("s2", None): "k-anon-old"}  # fmt: skip
NEW_OPEN = [("s1", "alice"), ("s2", None)]  # runs that raise: open, resumable
NEW_FINISHED = {("s3", "bob"): "k-bob-new"}
IDEMPOTENT = {key: user for (_, user), key in (OLD_FINISHED | NEW_FINISHED).items() if key}
PAUSE_S = 0.5
BATCH = 3

Row = tuple[str, str | None, int, str]  # (session, user, epoch, step name)


class Journals:
    """A fresh journal on one backend, and exact copies of it (each copy's runtime is new)."""

    def __init__(self, backend: str, tmp_path: Path, pg_dsn: str | None) -> None:
        self.backend = backend
        self.tmp_path = tmp_path
        self.pg_dsn = pg_dsn
        self.opened: list[JournalRuntime] = []
        self.clones: list[str] = []

    async def fresh(self) -> JournalRuntime:
        runtime: JournalRuntime
        if self.backend == "memory":
            runtime = InMemoryRuntime()
        elif self.backend == "sqlite":
            runtime = SqliteRuntime(self.tmp_path / "journal.db")
        else:
            assert self.pg_dsn is not None
            runtime = await PostgresRuntime.connect(self.pg_dsn)
        self.opened.append(runtime)
        return runtime

    async def copy(self, runtime: JournalRuntime) -> tuple[JournalRuntime, JournalRuntime]:
        """Close ``runtime``; return it reopened and an exact copy of its journal."""
        if self.backend == "memory":
            assert isinstance(runtime._store, InMemoryStore)
            twin = JournalRuntime(copy.deepcopy(runtime._store))
            self.opened.append(twin)
            return runtime, twin
        await runtime.close()
        if self.backend == "sqlite":
            target = self.tmp_path / "copy.db"
            src, dst = sqlite3.connect(self.tmp_path / "journal.db"), sqlite3.connect(target)
            try:
                src.backup(dst)
            finally:
                src.close()
                dst.close()
            originals = SqliteRuntime(self.tmp_path / "journal.db")
            twin = SqliteRuntime(target)
        else:
            assert self.pg_dsn is not None
            base, _, source = self.pg_dsn.rpartition("/")
            clone = f"loom_clone_{str(ULID()).lower()}"
            await _admin(f"{base}/postgres", f'CREATE DATABASE "{clone}" TEMPLATE "{source}"')
            self.clones.append(f"{base}/postgres|{clone}")
            originals = await PostgresRuntime.connect(self.pg_dsn)
            twin = await PostgresRuntime.connect(f"{base}/{clone}")
        self.opened += [originals, twin]
        return originals, twin

    async def close(self) -> None:
        for runtime in self.opened:
            await runtime.close()
        for item in self.clones:
            admin, clone = item.split("|")
            await _admin(admin, f'DROP DATABASE IF EXISTS "{clone}" WITH (FORCE)')


async def _admin(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def journals(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Journals]:
    dsn = request.getfixturevalue("pg_dsn") if request.param == "postgres" else None
    made = Journals(request.param, tmp_path, dsn)
    yield made
    await made.close()


async def _steps(runtime: JournalRuntime, n: int, key: str | None = None) -> None:
    for i in range(n):
        await runtime.step(f"step{i}", lambda i=i: i)
    if key is not None:
        await runtime.step("charge", lambda: "charged", idempotency_key=key)


async def _build(runtime: JournalRuntime, pause_s: float = 0.0) -> float:
    """Write the layout above; returns a time early in the pause between old and new rows."""
    for (session, user), key in OLD_FINISHED.items():
        async with runtime.session(session, user):
            await _steps(runtime, 4, key)
    await asyncio.sleep(pause_s)
    inside_pause = time.time() - pause_s * 0.8
    for session, user in NEW_OPEN:
        with pytest.raises(RuntimeError, match="crash"):
            async with runtime.session(session, user):
                await _steps(runtime, 3)
                raise RuntimeError("crash")
    for (session, user), key in NEW_FINISHED.items():
        async with runtime.session(session, user):
            await _steps(runtime, 3, key)
    return inside_pause


async def _state(runtime: JournalRuntime) -> tuple[set[Row], set[str]]:
    rows = {
        (s.session_id or "", s.user_id, e.epoch, e.name)
        for s in await runtime.sessions(limit=1000)
        for e in await runtime.entries(s.session_id, s.user_id)
    }
    keys = {
        key
        for key, user in IDEMPOTENT.items()
        if await runtime._store.get_idempotent(Scope(None, user).user_key, key) is not None
    }
    return rows, keys


def _expected(rows: set[Row], keys: set[str], filters: dict[str, Any]) -> tuple[set[Row], set[str]]:
    """What the rules leave: the oracle the single statement and the batches must both meet."""
    by_session, by_user = "session_id" in filters, "user_id" in filters
    aged = "older_than" in filters

    def doomed(row: Row) -> bool:
        session, user, epoch, _ = row
        is_open = (session, user) in NEW_OPEN and epoch == 1
        is_old = epoch == 0 and (session, user) in OLD_FINISHED
        return (
            (not by_session or session == filters["session_id"])
            and (not by_user or user == filters["user_id"])
            and (not aged or is_old)
            and (filters.get("include_open", False) or not is_open)
        )

    def key_doomed(key: str) -> bool:
        # Idempotency results go only by age (with the user filter), never by session.
        return (
            aged
            and not by_session
            and key.endswith("-old")
            and (not by_user or IDEMPOTENT[key] == filters["user_id"])
        )

    return {r for r in rows if not doomed(r)}, {k for k in keys if not key_doomed(k)}


CASES: list[dict[str, Any]] = [
    {},
    {"include_open": True},
    {"session_id": "s1"},
    {"user_id": "alice"},
    {"user_id": None},
    {"older_than": "pause"},
    {"older_than": "pause", "user_id": "alice"},
    {"session_id": "s2", "user_id": None, "include_open": True},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c) or "everything")
async def test_batches_delete_exactly_what_one_statement_deletes(
    journals: Journals, case: dict[str, Any]
) -> None:
    # Only the age cases need old and new rows apart: the cutoff goes early in the pause, and
    # the two prunes must both run before the clock reaches its end (0.4 s later).
    inside_pause = await _build(await journals.fresh(), PAUSE_S if "older_than" in case else 0)
    batched, single = await journals.copy(journals.opened[0])
    before = await _state(batched)
    assert before == await _state(single)
    filters = dict(case)
    if filters.get("older_than") == "pause":
        filters["older_than"] = dt.timedelta(seconds=time.time() - inside_pause)
    calls: list[tuple[int, int | None]] = []
    deleted = await batched.prune(
        **filters, batch_size=BATCH, on_progress=lambda *call: calls.append(call)
    )
    assert deleted == await single.prune(**filters, batch_size=1_000_000)
    after = await _state(batched)
    assert after == await _state(single)
    assert after == _expected(*before, filters)
    gone = len(before[0]) - len(after[0]) + len(before[1]) - len(after[1])
    assert deleted == gone > BATCH  # several batches
    # Progress: the count first, then every batch, ending full.
    assert calls[0] == (0, deleted)
    assert calls[-1] == (deleted, deleted)
    assert {total for _, total in calls} == {deleted}
    done = [d for d, _ in calls]
    assert all(0 < b - a <= BATCH for a, b in itertools.pairwise(done))


async def test_prune_without_a_callback_or_anything_to_delete(journals: Journals) -> None:
    runtime = await journals.fresh()
    calls: list[tuple[int, int | None]] = []
    assert await runtime.prune(on_progress=lambda *call: calls.append(call)) == 0
    assert calls == [(0, 0)]
    await _build(runtime)
    assert await runtime.prune(include_open=True, batch_size=1) == 25
    assert (await _state(runtime)) == (set(), set(IDEMPOTENT))  # no age: results outlive runs


@pytest.mark.parametrize("bad", [0, -5, True, 2.5, "100", None])
async def test_a_bad_batch_size_is_a_user_error(journals: Journals, bad: Any) -> None:
    runtime = await journals.fresh()
    with pytest.raises(UserError, match="batch_size must be a positive integer"):
        await runtime.prune(batch_size=bad)
