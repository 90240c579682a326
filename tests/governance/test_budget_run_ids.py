"""``loomflow budget holds`` names the run holding each reservation (schema version 2)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.governance.budget import Cap, SqlBudgetStore, StandardBudget
from loomflow.governance.budget.migrations import COMPONENT, MIGRATIONS, SCHEMA_VERSION
from loomflow.messages import Message, ModelResponse, ToolSpec, Usage
from loomflow.models import FunctionModel
from loomflow.storage import apply_migrations, database_from_url

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _url(backend: str, tmp_path: Any, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'budget.db'}"
    dsn: str = request.getfixturevalue("pg_dsn")
    return dsn


def _holds(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "budget", "--budget-url", url, "holds", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ),
    )


class _PricedModel(FunctionModel):
    provider = "acme"


@pytest.mark.parametrize("backend", BACKENDS)
def test_holds_name_the_run_whose_call_holds_them(
    tmp_path: Any, backend: str, request: pytest.FixtureRequest
) -> None:
    # A hold named only its worker (host and process): an operator could not tell which of
    # the runs on that worker was in a call, nor find it in the journal or the audit trail.
    url = _url(backend, tmp_path, request)
    seen: list[subprocess.CompletedProcess[str]] = []

    def decide(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        # Mid-call the reservation is held: look at it as an operator would.
        seen.append(_holds(url, "--json"))
        seen.append(_holds(url))
        return ModelResponse(text="ok", usage=Usage(input_tokens=10, output_tokens=5))

    async def run() -> str:
        budget = StandardBudget([Cap("tokens_total", 10**6)], store=SqlBudgetStore(url))
        agent = Agent("x", model=_PricedModel(decide, name="claude-haiku-4-5"), budget=budget)
        try:
            result = await agent.run("go", user_id="ana")
        finally:
            await budget.close()
        return result.run_id

    run_id = asyncio.run(run())
    as_json, table = seen
    assert as_json.returncode == 0, as_json.stderr
    [row] = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert (row["user_id"], row["run_id"]) == ("ana", run_id)
    assert table.returncode == 0, table.stderr
    header, line = table.stdout.splitlines()
    assert header[header.index("run") :].split()[:2] == ["run", "worker"]
    assert line[header.index("run") :].split()[0] == run_id
    # Settled after the call: nothing is held any more.
    assert _holds(url).stdout.strip() == "no budget reservations held"


async def _hold_of_an_older_release(url: str) -> None:
    """A dead worker's hold as a release before run ids stored it (schema version 1)."""
    db = database_from_url(url)
    await db.open()
    try:
        assert await apply_migrations(db, COMPONENT, MIGRATIONS[:1]) == 1
        await db.execute(
            "INSERT INTO loom_budget_reservations (id, owner, buckets, tokens_in, tokens_out, "
            "cost_nanousd, on_expiry, created_at, expires_at) "
            "VALUES ($1, $2, $3, 100, 10, 0, 'charge', 1.0, 2.0)",
            "01OLDHOLD",
            "host:1:1",
            json.dumps(['["user","ana",""]']),
        )
    finally:
        await db.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_holds_of_an_older_release_show_an_unknown_run(
    tmp_path: Any, backend: str, request: pytest.FixtureRequest
) -> None:
    url = _url(backend, tmp_path, request)
    asyncio.run(_hold_of_an_older_release(url))
    refused = _holds(url)  # a listing never changes a schema: the deploy step does
    assert refused.returncode == 1
    assert "loomflow migrate" in refused.stderr
    migrate = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", url, "migrate"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ),
    )
    assert "budget schema at version 2" in migrate.stdout, migrate.stdout + migrate.stderr
    table = _holds(url)
    assert table.returncode == 0, table.stderr
    header, line = table.stdout.splitlines()
    assert line[header.index("run") :].split()[:2] == ["unknown", "host:1:1"]
    as_json = _holds(url, "--json")
    [row] = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert (row["reservation_id"], row["run_id"]) == ("01OLDHOLD", None)
    assert SCHEMA_VERSION == 2
