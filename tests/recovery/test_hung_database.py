"""A PostgreSQL server that stops answering (paused, or cut off without a reset): every
statement gives up after ``LOOMFLOW_POSTGRES_TIMEOUT_SECONDS``, so a run fails with a
:class:`StoreUnavailableError` instead of hanging for good, and resumes once the server is
back. Migrations and prunes are exempt: they may rightly run long."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from _fleet import HangingProxy
from ulid import ULID

from loomflow.agent import Agent
from loomflow.config import Settings
from loomflow.errors import ConfigurationError, StoreUnavailableError
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import PostgresRuntime
from loomflow.storage import PostgresDatabase, unbounded
from loomflow.tools import tool

pytestmark = pytest.mark.postgres


def _decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if any(m.role == "tool" for m in messages):
        return "shipped it"
    return [ToolCall(id="c1", name="ship", arguments={"order": "o-1"})]


async def test_a_run_whose_database_stops_answering_fails_and_later_resumes(
    pg_dsn: str, proxy: HangingProxy
) -> None:
    shipped: list[str] = []

    @tool
    async def ship(order: str) -> str:
        """Ship an order."""
        shipped.append(order)
        proxy.freeze()  # the server stops answering while the tool's step is written
        return "ok"

    settings = Settings(postgres_timeout_seconds=1.0, lease_seconds=2.0)
    runtime = PostgresRuntime(proxy.url(pg_dsn), settings=settings)
    agent = Agent("a", model=FunctionModel(_decide), tools=[ship], runtime=runtime)
    session = f"hung-{ULID()}"
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError) as caught:
            # Before, the run (and even its cancellation) waited as long as the server hung.
            await asyncio.wait_for(agent.run("go", session_id=session, user_id="u"), 60)
        took = time.monotonic() - t0
        assert "did not answer within 1s" in str(caught.value)
        assert "LOOMFLOW_POSTGRES_TIMEOUT_SECONDS" in str(caught.value)
        assert took < 30, took  # the write, then the run's own clean-up, each given up on
    finally:
        proxy.thaw()
        await runtime.close()

    # The server is back: the run resumes from its journal (the model's call replayed).
    direct = PostgresRuntime(pg_dsn, settings=settings)
    try:
        again = Agent("a", model=FunctionModel(_decide), tools=[ship], runtime=direct)
        deadline = time.monotonic() + 30
        while True:  # the failed run's lease (2 s) runs out first
            try:
                result = await again.resume("go", session_id=session, user_id="u")
                break
            except StoreUnavailableError:
                raise
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert result.output == "shipped it"
        assert result.replayed_steps >= 1  # the first model call came from the journal
        assert 1 <= len(shipped) <= 2  # the tool's write was in doubt: at least once
    finally:
        await direct.close()


async def test_statements_are_bounded_except_inside_unbounded(pg_dsn: str) -> None:
    db = PostgresDatabase(pg_dsn, timeout_s=0.5)
    try:
        with pytest.raises(StoreUnavailableError, match=r"did not answer within 0\.5s"):
            await db.fetch("SELECT pg_sleep(2)", what="slow query")
        with pytest.raises(StoreUnavailableError, match=r"did not answer within 0\.5s"):
            async with db.transaction(what="slow transaction") as tx:
                await tx.fetch("SELECT pg_sleep(2)")
        # The database still serves after giving up on a statement.
        assert (await db.fetch("SELECT 41 + 1"))[0][0] == 42
        with unbounded():  # a migration's index build, a prune's count
            assert (await db.fetch("SELECT pg_sleep(1), 7"))[0][1] == 7
            async with db.transaction(what="migration") as tx:
                assert (await tx.fetch("SELECT pg_sleep(1), 8"))[0][1] == 8
    finally:
        await db.close()


async def test_zero_means_no_limit_and_the_setting_is_the_default(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert PostgresDatabase(pg_dsn, timeout_s=0).timeout_s is None
    monkeypatch.setenv("LOOMFLOW_POSTGRES_TIMEOUT_SECONDS", "7.5")
    assert PostgresDatabase(pg_dsn).timeout_s == 7.5
    assert PostgresRuntime(pg_dsn).database.timeout_s == 7.5
    monkeypatch.delenv("LOOMFLOW_POSTGRES_TIMEOUT_SECONDS")
    assert PostgresDatabase(pg_dsn).timeout_s == 60.0
    db = PostgresDatabase(pg_dsn, timeout_s=0)
    try:
        assert (await db.fetch("SELECT pg_sleep(0.2), 1"))[0][1] == 1
    finally:
        await db.close()


@pytest.mark.parametrize("bad", ["-1", "inf", "nan", "soon"])
def test_a_bad_timeout_setting_is_refused_by_name(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOMFLOW_POSTGRES_TIMEOUT_SECONDS", bad)
    with pytest.raises(ConfigurationError, match="POSTGRES_TIMEOUT_SECONDS"):
        Settings()


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "60"])
def test_a_bad_timeout_argument_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="statement timeout"):
        PostgresDatabase("postgresql://u@127.0.0.1:1/x", timeout_s=bad)
