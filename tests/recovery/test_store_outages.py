"""Attempts that an outage of our own stores ended are not the run's failures.

The resumed attempt is blocked in a tool while another connection takes the SQLite journal's
write lock (a real outage of the file: every write of the worker fails with
``StoreLockedError``); then the tool returns, the attempt cannot journal it, and the lock is
let go a moment later. With ``max_attempts=1`` the run used to be a dead letter for it.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any

import _app
import pytest
from _fleet import start_and_kill, tool_counts, wait_for
from prometheus_client import CollectorRegistry

from loomflow.audit import AuditLog
from loomflow.errors import StorageError
from loomflow.recovery import Recovery
from loomflow.runtime import SqliteRuntime
from loomflow.telemetry import Metrics

pytestmark = pytest.mark.timeout(120)


_LOST = "does not count toward max_attempts"
_COUNTED = ("gave up on session", "recovery bookkeeping failed")


async def _told(caplog: pytest.LogCaptureFixture, *texts: str) -> None:
    """Until the worker has logged a line holding one of ``texts``: the attempt met the
    outage (a lost attempt is then given back for seconds, a counted one dead-lettered or
    left for the next sweep), so the outage may end. Waited for, not slept for: a loaded
    machine may take longer than a fixed pause to reach the failed write."""
    async with asyncio.timeout(60):
        while not any(t in r.getMessage() for r in caplog.records for t in texts):  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # log records: nothing to wait on but a poll


@pytest.fixture
def journal(tmp_path: Path, ledger: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "journal.db"
    monkeypatch.setenv("FLEET_URL", f"sqlite:///{path}")
    monkeypatch.setenv("FLEET_LEDGER", str(ledger))
    monkeypatch.setenv("FLEET_AUDIT_URL", f"sqlite:///{tmp_path / 'audit.db'}")
    monkeypatch.setenv("LOOMFLOW_SQLITE_BUSY_TIMEOUT_MS", "200")
    monkeypatch.delenv("FLEET_FAIL", raising=False)
    return path


def _blocked_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, dict[str, Any], SqliteRuntime, AuditLog]:
    """The fleet app with its tool held at a gate file: its gate, agents, journal and audit."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("FLEET_BLOCK", "1")
    monkeypatch.setenv("FLEET_GATE", str(gate))
    agents = _app.agents()
    runtime, audit = agents["orders"].runtime, agents["orders"].audit
    assert isinstance(runtime, SqliteRuntime)
    assert isinstance(audit, AuditLog)
    return gate, agents, runtime, audit


class _SaysNothing:
    """A third-party journal store around the real one whose ``requeue`` does its work but
    returns None (``JournalStore.requeue`` says True or False)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def requeue(self, scope: Any) -> None:
        await self._store.requeue(scope)


@pytest.mark.parametrize("store", ["sound", "requeue_says_nothing"])
async def test_an_attempt_a_journal_outage_ended_does_not_count(
    store: str,
    journal: Path,
    ledger: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="loomflow.recovery")
    await start_and_kill(f"sqlite:///{journal}", ledger, 1, "blip")
    gate, agents, runtime, audit = _blocked_app(tmp_path, monkeypatch)
    if store == "requeue_says_nothing":
        runtime._store = _SaysNothing(runtime._store)  # type: ignore[assignment]
    metrics = Metrics(CollectorRegistry())
    recovery = Recovery(
        runtime, agents, max_attempts=1, backoff=0, audit=audit, metrics=metrics, worker_id="w"
    )
    holder = sqlite3.connect(journal, isolation_level=None)
    try:
        assert len((await recovery.sweep()).resumed) == 1
        await wait_for(ledger, "blocked", 2)  # the killed run's, then the resumed attempt's
        holder.execute("BEGIN IMMEDIATE")  # the journal is down for its writers
        gate.touch()
        await wait_for(ledger, "ship", 1)
        await _told(caplog, _LOST)
        holder.execute("ROLLBACK")  # back a moment later
        await recovery.wait()
        [info] = await runtime.sessions()
        assert (info.state, info.last_error) == ("orphaned", None)
        counted = {
            outcome: metrics.registry.get_sample_value(
                "loomflow_recoveries_total", {"outcome": outcome}
            )
            for outcome in ("resumed", "retry_failed", "dead_lettered", "store_unavailable")
        }
        # An outcome of its own: dashboards tell an outage from a failing run.
        assert counted == {
            "resumed": 1,
            "retry_failed": 0,
            "dead_lettered": 0,
            "store_unavailable": 1,
        }
        assert (
            metrics.registry.get_sample_value(
                "loomflow_store_unavailable_total", {"store": "journal"}
            )
            or 0
        ) >= 1
        assert recovery.failures == 1  # `worker --once` says the work was not done
        # The next attempt is allowed (it was not a dead letter) and finishes the run.
        await runtime.database.execute("UPDATE loom_sessions SET retry_at = 0")
        assert len((await recovery.sweep()).resumed) == 1
        await recovery.wait()
        [info] = await runtime.sessions()
        assert info.state == "finished"
        outcomes = [
            e.payload.get("outcome")
            for e in (await audit.query(user_id="ana", action="run.recover")).entries
        ]
        assert "store_unavailable" in outcomes
        assert outcomes[-1] == "finished"
        if store == "requeue_says_nothing":
            # Not known to be given back in the journal: this worker left the attempt out of
            # its own count (the run above was resumed, not dead-lettered), and said why.
            gave = "giving back an attempt failed"
            said = [r for r in caplog.records if r.getMessage() == gave]
            assert said
            # The exception rides on the record, or (once log redaction is installed in the
            # process, which drops it) as its redacted one-line form.
            record = said[0]
            named = str(record.exc_info[1]) if record.exc_info else getattr(record, "exc_line", "")
            assert "not True or False" in named
            with pytest.raises(StorageError, match="_SaysNothing answered requeue"):
                await runtime.requeue("blip-0", "ana")
    finally:
        holder.close()
        await runtime.close()
        await audit.close()


async def test_a_run_that_breaks_the_store_every_time_still_ends_as_a_dead_letter(
    journal: Path,
    ledger: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="loomflow.recovery")
    # The bound: a worker gives back as many lost attempts of a run as max_attempts, then
    # counts them, so a run that fails a store on every attempt is not retried forever.
    await start_and_kill(f"sqlite:///{journal}", ledger, 1, "every")
    gate, agents, runtime, audit = _blocked_app(tmp_path, monkeypatch)
    recovery = Recovery(runtime, agents, max_attempts=1, backoff=0, audit=audit, worker_id="w")
    holder = sqlite3.connect(journal, isolation_level=None)
    try:
        for attempt in (1, 2):
            gate.unlink(missing_ok=True)
            await runtime.database.execute("UPDATE loom_sessions SET retry_at = 0")
            assert len((await recovery.sweep()).resumed) == 1
            await wait_for(ledger, "blocked", 1 + attempt)
            holder.execute("BEGIN IMMEDIATE")
            gate.touch()
            await wait_for(ledger, "ship", attempt)
            # The first is given back; the second is past the bound and counts.
            await _told(caplog, _LOST) if attempt == 1 else await _told(caplog, *_COUNTED)
            holder.execute("ROLLBACK")
            await recovery.wait()
        # The second attempt counted: out of attempts, given up (at once, or by the next
        # sweep if the journal was still locked when the attempt ended).
        await runtime.database.execute("UPDATE loom_sessions SET retry_at = 0")
        report = await recovery.sweep()
        assert report.resumed == []
        [info] = await runtime.sessions()
        assert (info.state, info.attempts) == ("failed", 2)
    finally:
        holder.close()
        await runtime.close()
        await audit.close()


async def test_the_entry_of_a_failed_attempt_waits_for_an_audit_log_that_was_down(
    journal: Path, ledger: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The audit log refused the entry ending a failed attempt (its store was down at that
    # moment): the entry was dropped with a warning, and compliance saw an attempt begin and
    # never end. It is now retried, then kept and recorded once the audit log answers.
    await start_and_kill(f"sqlite:///{journal}", ledger, 1, "quiet")
    gate = tmp_path / "gate"
    monkeypatch.setenv("FLEET_BLOCK", "1")
    monkeypatch.setenv("FLEET_GATE", str(gate))
    monkeypatch.setenv("FLEET_FAIL", "1")
    agents = _app.agents()
    runtime, audit = agents["orders"].runtime, agents["orders"].audit
    assert isinstance(runtime, SqliteRuntime)
    assert isinstance(audit, AuditLog)
    recovery = Recovery(runtime, agents, max_attempts=3, backoff=60, audit=audit, worker_id="w")
    holder = sqlite3.connect(tmp_path / "audit.db", isolation_level=None)
    try:
        assert len((await recovery.sweep()).resumed) == 1
        await wait_for(ledger, "blocked", 2)
        holder.execute("BEGIN IMMEDIATE")  # the audit store is down, the journal is not
        gate.touch()  # ship raises: a failed attempt
        await recovery.wait()  # its retries (a few seconds) gave up
        holder.execute("ROLLBACK")
        [info] = await runtime.sessions()
        assert (info.state, info.attempts) == ("orphaned", 1)
        await recovery.sweep()  # the retry is not due; the kept entry is written now
        entries = (await audit.query(user_id="ana", action="run.recover")).entries
        ended = [e.payload for e in entries if "outcome" in e.payload]
        assert len(ended) == 1
        assert ended[0]["outcome"] == "retry_failed"
        assert ended[0]["recorded_late"] is True
        assert "the carrier is down" in ended[0]["error"]
    finally:
        holder.close()
        await runtime.close()
        await audit.close()


async def test_an_attempt_the_audit_log_refused_to_start_is_counted_as_an_outage(
    journal: Path, ledger: Path, tmp_path: Path
) -> None:
    # The audit log refuses the entry that starts the recovery (its store is down): the run
    # is not started and the claim is given back. That attempt is an outage's, and the
    # recoveries counter says so, beside which store failed.
    await start_and_kill(f"sqlite:///{journal}", ledger, 1, "mute")
    agents = _app.agents()
    runtime, audit = agents["orders"].runtime, agents["orders"].audit
    assert isinstance(runtime, SqliteRuntime)
    assert isinstance(audit, AuditLog)
    metrics = Metrics(CollectorRegistry())
    recovery = Recovery(
        runtime, agents, max_attempts=1, backoff=0, audit=audit, metrics=metrics, worker_id="w"
    )
    holder = sqlite3.connect(tmp_path / "audit.db", isolation_level=None)
    try:
        await audit.verify()  # the audit store's tables exist before it goes down
        holder.execute("BEGIN IMMEDIATE")
        assert len((await recovery.sweep()).resumed) == 1
        await recovery.wait()
        holder.execute("ROLLBACK")
        sample = metrics.registry.get_sample_value
        assert sample("loomflow_recoveries_total", {"outcome": "store_unavailable"}) == 1
        assert sample("loomflow_recoveries_total", {"outcome": "retry_failed"}) == 0
        assert sample("loomflow_store_unavailable_total", {"store": "audit"}) == 1
        assert recovery.failures == 1
        [info] = await runtime.sessions()
        assert (info.state, info.attempts) == ("orphaned", 1)  # given back, not below one
        assert tool_counts(ledger, "ship") == {}  # the run did not start
    finally:
        holder.close()
        await runtime.close()
        await audit.close()
