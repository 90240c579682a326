"""A journal row whose position (``seq``) was edited to the top of its column.

A run numbers its next entry one past the highest position it read back. A row set by hand to
the column's top (2**63 - 1 in SQLite, 2**31 - 1 in PostgreSQL's INTEGER) made that number
one the database cannot hold, and every resume of the session failed at its first new step
with a ``StoreUnavailableError`` ("journal write failed"): an outage to an SRE, retried by
recovery until it gave the run up. The position only orders a run's entries, so such a row is
read as damaged in that one respect, as text there already was, and the run goes on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.runtime import PostgresRuntime, SqliteRuntime


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def journal(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[SqliteRuntime | PostgresRuntime, int]]:
    """A runtime on a real journal, and the top of its seq column (SQLite's INTEGER is 64-bit)."""
    runtime: SqliteRuntime | PostgresRuntime
    if request.param == "sqlite":
        runtime, top = SqliteRuntime(tmp_path / "journal.db"), 2**63 - 1
    else:
        runtime, top = await PostgresRuntime.connect(request.getfixturevalue("pg_dsn")), 2**31 - 1
    try:
        yield runtime, top
    finally:
        await runtime.close()


class Body:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, what: str) -> str:
        self.calls.append(what)
        return f"did {what}"


@pytest.mark.parametrize("below", [0, 1])
async def test_a_position_at_the_top_of_its_column_does_not_stop_a_resume(
    journal: tuple[SqliteRuntime | PostgresRuntime, int], below: int
) -> None:
    runtime, top = journal
    body = Body()
    with pytest.raises(RuntimeError, match="crash"):
        async with runtime.session("s", "u"):
            await runtime.step("reserve", body, "reserve")
            raise RuntimeError("crash")
    await runtime.database.execute(f"UPDATE loom_entries SET seq = {top - below}")

    async with runtime.session("s", "u", resume=True) as run:
        assert await runtime.step("reserve", body, "reserve") == "did reserve"  # replayed
        for step in ("ship", "bill", "mail"):
            assert await runtime.step(step, body, step) == f"did {step}"
    assert body.calls == ["reserve", "ship", "bill", "mail"]
    assert run.stats.hits == 1

    # The run's new entries were journaled: a replay runs none of them again.
    async with runtime.session("s", "u", resume=True) as again:
        for step in ("reserve", "ship", "bill", "mail"):
            await runtime.step(step, body, step)
    assert again.epoch == run.epoch
    assert body.calls == ["reserve", "ship", "bill", "mail"]
