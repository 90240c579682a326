"""What docs/operations/fleet.md tells an operator to do with a dead letter, done for real.

A run whose worker was SIGKILLed is resumed by a recoverer, raises, and is given up
(``max_attempts=1``): it is ``failed``. From a shell the operator lists it with its error,
then either retries it (``agent.resume`` with its inputs, once the cause is fixed: it
finishes, and the effect that was journaled before the kill is not repeated) or cancels it
(``loomflow runs cancel``: it is ``cancelled`` and no later sweep touches it).
"""

from __future__ import annotations

import json
from pathlib import Path

import _app
import pytest
from _fleet import app_env, cli, close_agents, start_and_kill, tool_counts
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.recovery import Recovery
from loomflow.runtime import JournalRuntime
from loomflow.telemetry import Metrics


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, journal_url: str, ledger: Path) -> None:
    monkeypatch.setenv("FLEET_URL", journal_url)
    monkeypatch.setenv("FLEET_LEDGER", str(ledger))
    monkeypatch.delenv("FLEET_BLOCK", raising=False)
    monkeypatch.setenv("FLEET_FAIL", "1")  # the carrier is down: every resume raises


async def _dead_letters(journal_url: str, ledger: Path, count: int) -> None:
    """``count`` runs killed with their worker, resumed once each, and given up."""
    await start_and_kill(journal_url, ledger, count, "order")
    agents = _app.agents()
    try:
        recovery = Recovery(
            _runtime(agents), agents, max_attempts=1, metrics=Metrics(CollectorRegistry())
        )
        report = await recovery.sweep()
        assert len(report.resumed) == count
        await recovery.wait()
        assert recovery.failures == count
    finally:
        await close_agents(agents)


def _runtime(agents: dict[str, Agent]) -> JournalRuntime:
    runtime = agents["orders"].runtime
    assert isinstance(runtime, JournalRuntime)
    return runtime


async def _listed(journal_url: str, ledger: Path, state: str) -> list[dict[str, object]]:
    code, out, err = await cli(
        "--url",
        journal_url,
        "runs",
        "list",
        "--state",
        state,
        "--json",
        env=app_env(journal_url, ledger),
    )
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def test_a_dead_letter_is_listed_with_its_error_and_a_retry_finishes_it(
    env: None, journal_url: str, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _dead_letters(journal_url, ledger, 1)
    [row] = await _listed(journal_url, ledger, "failed")
    assert row["session_id"] == "order-0"
    assert row["state"] == "failed"
    assert row["attempts"] == 1
    assert "the carrier is down" in str(row["last_error"])
    assert tool_counts(ledger, "reserve") == {"order-0": 1}

    # The cause is fixed; the operator resumes the run with the inputs it began with.
    monkeypatch.delenv("FLEET_FAIL")
    agents = _app.agents()
    try:
        result = await agents["orders"].resume(_app.PROMPT, session_id="order-0", user_id="ana")
        assert result.output == "Reserved and shipped."
        [info] = await _runtime(agents).sessions(session_id="order-0")
        assert info.state == "finished"
    finally:
        await close_agents(agents)
    assert await _listed(journal_url, ledger, "failed") == []
    # reserve was journaled before the kill: replayed, not repeated; ship ran once at last.
    assert tool_counts(ledger, "reserve") == {"order-0": 1}
    assert tool_counts(ledger, "ship") == {"order-0": 1}


async def test_a_cancelled_dead_letter_is_never_recovered(
    env: None, journal_url: str, ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _dead_letters(journal_url, ledger, 2)
    assert {r["session_id"] for r in await _listed(journal_url, ledger, "failed")} == {
        "order-0",
        "order-1",
    }
    code, out, err = await cli(
        "--url",
        journal_url,
        "runs",
        "cancel",
        "order-1",
        "--user",
        "ana",
        "--json",
        env=app_env(journal_url, ledger),
    )
    assert code == 0, err
    assert json.loads(out)["cancelled"] is True
    [cancelled] = await _listed(journal_url, ledger, "cancelled")
    assert cancelled["session_id"] == "order-1"

    # The cause is fixed and a worker sweeps: it resumes neither the dead letter (that is the
    # operator's call) nor the cancelled run.
    monkeypatch.delenv("FLEET_FAIL")
    agents = _app.agents()
    try:
        recovery = Recovery(_runtime(agents), agents, metrics=Metrics(CollectorRegistry()))
        report = await recovery.sweep()
        await recovery.wait()
        assert report.resumed == []
        assert report.states["failed"] == 1
        assert report.states["cancelled"] == 1
    finally:
        await close_agents(agents)
    assert tool_counts(ledger, "ship") == {}
