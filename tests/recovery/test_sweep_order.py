"""Which open runs a sweep reads first: orphans are never hidden behind live runs.

A sweep reads at most ``batch`` open runs and skips those whose owner is alive. It used to read
them oldest first, live or not, so a fleet running as many runs as the batch holds (100 by
default), all started before a crash, filled every batch with runs it had to skip: the crashed
run stayed ``orphaned`` and the worker said it resumed nothing, until enough of the older runs
ended, far past the lease plus one sweep interval that the docs promise.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import _app
import pytest
from _fleet import app_env, start_and_kill, start_blocked, tool_counts

from loomflow.audit import AuditLog
from loomflow.recovery import Recovery


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return str(request.getfixturevalue("pg_dsn"))


async def test_a_batch_full_of_live_runs_does_not_hide_an_orphan(
    journal_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy_ledger, lost_ledger = tmp_path / "busy.jsonl", tmp_path / "lost.jsonl"
    gate = tmp_path / "gate"
    # Three runs going on in a live process, started first (so the oldest open rows) ...
    busy = await start_blocked(journal_url, busy_ledger, 3, "busy", gate)
    try:
        # ... and one whose process is killed, with a 1 s lease that then runs out.
        await start_and_kill(journal_url, lost_ledger, 1, "lost", FLEET_LEASE="1")
        await asyncio.sleep(1.5)
        for name, value in app_env(journal_url, lost_ledger).items():
            if name.startswith("FLEET_"):
                monkeypatch.setenv(name, value)
        agent = _app.agents()["orders"]
        assert agent.runtime is not None
        try:
            recovery = Recovery(agent.runtime, {"orders": agent}, batch=2)
            report = await recovery.sweep()
            await recovery.wait()
            assert report.states["running"] == 3
            assert report.states["orphaned"] == 1
            assert [ref.session_id for ref in report.resumed] == ["lost-0"]
            assert recovery.failures == 0
        finally:
            await agent.runtime.close()
            assert isinstance(agent.audit, AuditLog)
            await agent.audit.close()
        assert tool_counts(lost_ledger, "ship") == {"lost-0": 1}
        assert tool_counts(lost_ledger, "reserve") == {"lost-0": 1}
    finally:
        gate.touch()
        async with asyncio.timeout(60):
            await busy.communicate()
    assert busy.returncode == 0
    assert tool_counts(busy_ledger, "ship") == {f"busy-{i}": 1 for i in range(3)}
