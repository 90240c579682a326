"""A damaged row under an idempotency key costs one fresh run of the step, never more.

A row edited by hand (SQLite keeps any type in any column; PostgreSQL only what the column
type allows) is unreadable: the step runs once more, the fresh result replaces the row, and
later calls replay it. The replacement is conditional on the damaged row still being there, so
it must find that row again whatever its columns hold; when it did not, every retry ran the
side effect again and then raised ``OwnershipLostError``.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from loomflow.errors import NewerEntryError
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime, codec
from loomflow.runtime._store import StoredEntry


class Charge:
    """A side effect that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, amount: int) -> dict[str, int]:
        self.calls += 1
        return {"charged": amount, "call": self.calls}


async def _charge(runtime: JournalRuntime, session_id: str, charge: Charge) -> Any:
    async with runtime.session(session_id, user_id="alice"):
        return await runtime.step("charge", charge, 5, idempotency_key="order-42")


# Column damage as `UPDATE loom_idempotency SET <column> = <expression>` writes it.
SQLITE_DAMAGE = [
    ("value", "7"),
    ("value", "1.5"),
    ("value", "'{bad'"),
    ("value", "''"),
    ("value", "X''"),
    ("value", "X'7b626164'"),
    ("format", "X'00'"),
    ("format", "7"),
    ("format", "'X'"),
    ("format", "'pickle'"),
    ("codec_version", "'x'"),
    ("codec_version", "1.5"),
    ("codec_version", "X'01'"),
]

POSTGRES_DAMAGE = [
    ("value", "convert_to('{bad', 'UTF8')"),
    ("value", "''::bytea"),
    ("format", "'X'"),
    ("format", "''"),
    ("format", "'pickle'"),
]


def _sqlite(path: Path, sql: str) -> list[Any]:
    conn = sqlite3.connect(path)
    try:
        with conn:
            return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _damage_sqlite(path: Path, column: str, expression: str) -> None:
    _sqlite(path, f"UPDATE loom_idempotency SET {column} = {expression}")
    assert _sqlite(path, "SELECT count(*) FROM loom_idempotency") == [(1,)]


async def _postgres(dsn: str, sql: str) -> list[Any]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return [tuple(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


async def _damaged_row_costs_one_run(runtime: JournalRuntime, damage: Any, read_row: Any) -> None:
    charge = Charge()
    assert await _charge(runtime, "a", charge) == {"charged": 5, "call": 1}
    await damage()
    # The first retry runs the step once more and replaces the row ...
    assert await _charge(runtime, "c", charge) == {"charged": 5, "call": 2}
    assert charge.calls == 2
    assert await read_row() == [
        ("json", codec.CODEC_VERSION, codec.dumps({"charged": 5, "call": 2}))
    ]
    # ... so later retries replay its result instead of charging again.
    for session_id in ("d", "e"):
        assert await _charge(runtime, session_id, charge) == {"charged": 5, "call": 2}
    assert charge.calls == 2


# A pickled row is skipped with a warning (once per process), then replaced like the others.
@pytest.mark.filterwarnings("ignore::loomflow.runtime._journal.PickledEntryWarning")
@pytest.mark.parametrize(("column", "expression"), SQLITE_DAMAGE)
async def test_a_damaged_sqlite_row_runs_the_step_once_more_then_replays(
    tmp_path: Path, column: str, expression: str
) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)

    async def damage() -> None:
        await asyncio.to_thread(_damage_sqlite, path, column, expression)

    async def read_row() -> list[Any]:
        return await asyncio.to_thread(
            _sqlite, path, "SELECT format, codec_version, value FROM loom_idempotency"
        )

    try:
        await _damaged_row_costs_one_run(runtime, damage, read_row)
    finally:
        await runtime.close()


@pytest.mark.postgres
@pytest.mark.filterwarnings("ignore::loomflow.runtime._journal.PickledEntryWarning")
@pytest.mark.parametrize(("column", "expression"), POSTGRES_DAMAGE)
async def test_a_damaged_postgres_row_runs_the_step_once_more_then_replays(
    pg_dsn: str, column: str, expression: str
) -> None:
    runtime = await PostgresRuntime.connect(pg_dsn)

    async def damage() -> None:
        await _postgres(pg_dsn, f"UPDATE loom_idempotency SET {column} = {expression}")

    async def read_row() -> list[Any]:
        rows = await _postgres(pg_dsn, "SELECT format, codec_version, value FROM loom_idempotency")
        return [(f, v, bytes(b)) for f, v, b in rows]

    try:
        await _damaged_row_costs_one_run(runtime, damage, read_row)
    finally:
        await runtime.close()


@pytest.mark.parametrize(
    ("column", "expression"),
    [("value", "7"), ("value", "'{bad'"), ("format", "X'00'"), ("codec_version", "'x'")],
)
async def test_replacing_a_damaged_sqlite_row_keeps_fencing_and_a_concurrent_winner(
    tmp_path: Path, column: str, expression: str
) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        await _charge(runtime, "a", Charge())
        await asyncio.to_thread(_damage_sqlite, path, column, expression)
        before = await asyncio.to_thread(_sqlite, path, "SELECT * FROM loom_idempotency")
        store = runtime._store
        async with runtime.session("c", user_id="alice") as run:
            damaged = await store.get_idempotent(run.scope.user_key, "order-42")
            assert damaged is not None
            first = StoredEntry("[]", "charge", "", "step", "json", 1, codec.dumps("first"))
            second = StoredEntry("[]", "charge", "", "step", "json", 1, codec.dumps("second"))
            # A writer that lost its turn replaces nothing and learns it was fenced out.
            fenced = await store.put_idempotent(
                run.scope, run.token - 1, "order-42", first, replacing=damaged
            )
            assert fenced is None
            after = await asyncio.to_thread(_sqlite, path, "SELECT * FROM loom_idempotency")
            assert after == before
            # The owner replaces the damaged row ...
            assert (
                await store.put_idempotent(
                    run.scope, run.token, "order-42", first, replacing=damaged
                )
                == first
            )
            # ... and a second writer that read the same damaged row gets that result.
            winner = await store.put_idempotent(
                run.scope, run.token, "order-42", second, replacing=damaged
            )
            assert winner is not None
            assert winner.value == first.value
        stored = await asyncio.to_thread(_sqlite, path, "SELECT value FROM loom_idempotency")
        assert stored == [(codec.dumps("first"),)]
    finally:
        await runtime.close()


# A row a newer loomflow wrote (a higher codec version) is not damage: it is most likely sound,
# so running the step again could charge twice, and replacing the row would lose it. Every
# reader refuses it, strict or not, and leaves it as it is. It used to run the step again.
async def _newer_row_is_refused(
    runtime: JournalRuntime, mark_newer: Any, read_rows: Any, table: str
) -> None:
    charge = Charge()

    async def positional(session_id: str) -> Any:
        async with runtime.session(session_id, user_id="alice"):
            return await runtime.step("charge", charge, 7)

    await _charge(runtime, "a", charge)
    with pytest.raises(RuntimeError, match="crash"):  # the run stays open: a resume replays it
        async with runtime.session("p", user_id="alice"):
            await runtime.step("charge", charge, 7)
            raise RuntimeError("crash")
    assert charge.calls == 2
    await mark_newer()
    before = await read_rows()
    for attempt in (
        lambda: _charge(runtime, "c", charge),
        lambda: positional("p"),
    ):
        with pytest.raises(NewerEntryError, match=r"newer codec \(v999\).*upgrade"):
            await attempt()
    assert charge.calls == 2, "a step a newer loomflow journaled ran again"
    assert await read_rows() == before, f"the newer {table} row was changed"


async def test_a_row_a_newer_loomflow_wrote_is_refused_not_run_again_sqlite(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)

    async def mark_newer() -> None:
        for table in ("loom_idempotency", "loom_entries"):
            await asyncio.to_thread(_sqlite, path, f"UPDATE {table} SET codec_version = 999")

    async def read_rows() -> list[Any]:
        return [
            await asyncio.to_thread(_sqlite, path, f"SELECT * FROM {table} ORDER BY 1, 2, 3")
            for table in ("loom_idempotency", "loom_entries")
        ]

    try:
        await _newer_row_is_refused(runtime, mark_newer, read_rows, "journal")
    finally:
        await runtime.close()


@pytest.mark.postgres
async def test_a_row_a_newer_loomflow_wrote_is_refused_not_run_again_postgres(
    pg_dsn: str,
) -> None:
    runtime = await PostgresRuntime.connect(pg_dsn)

    async def mark_newer() -> None:
        for table in ("loom_idempotency", "loom_entries"):
            await _postgres(pg_dsn, f"UPDATE {table} SET codec_version = 999")

    async def read_rows() -> list[Any]:
        return [
            await _postgres(pg_dsn, f"SELECT * FROM {table} ORDER BY 1, 2, 3")
            for table in ("loom_idempotency", "loom_entries")
        ]

    try:
        await _newer_row_is_refused(runtime, mark_newer, read_rows, "journal")
    finally:
        await runtime.close()


@pytest.mark.parametrize("fmt", ["json", "cbor"])  # a format this release does not know, too
async def test_a_newer_row_with_other_inputs_is_refused_not_run_again_as_a_divergence(
    tmp_path: Path, fmt: str
) -> None:
    # A newer release may encode a step's arguments differently, so the fingerprint it stored
    # is not the one this release computes. The mismatch was taken for a divergence: the
    # step ran again (charging twice) and its result replaced the newer release's entry.
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    charge = Charge()
    try:
        with pytest.raises(RuntimeError, match="crash"):
            async with runtime.session("p", user_id="alice"):
                await runtime.step("charge", charge, 7)
                raise RuntimeError("crash")
        await asyncio.to_thread(
            _sqlite,
            path,
            f"UPDATE loom_entries SET codec_version = 999, fingerprint = 'newer', format = '{fmt}'",
        )
        before = await asyncio.to_thread(_sqlite, path, "SELECT * FROM loom_entries")
        with pytest.raises(NewerEntryError, match=r"newer codec \(v999\).*upgrade"):
            async with runtime.session("p", user_id="alice", resume=True):
                await runtime.step("charge", charge, 7)
        assert charge.calls == 1, "a step a newer loomflow journaled ran again"
        assert await asyncio.to_thread(_sqlite, path, "SELECT * FROM loom_entries") == before
    finally:
        await runtime.close()
