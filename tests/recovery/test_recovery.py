"""Recovery of runs whose worker was SIGKILLed: true states, claims, attempts, dead letters.

Each test starts the app's runs in a real child process, blocks them inside a tool, kills the
child with SIGKILL, and recovers in this process through :class:`loomflow.recovery.Recovery`
on a real SQLite file or a real PostgreSQL database. The ledger (one line per tool execution)
says what ran where.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import _app
import pytest
from _fleet import app_env as fleet_env
from _fleet import close_agents, start_and_kill, tool_counts, wait_for
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from loomflow.agent import Agent
from loomflow.audit import AuditLog
from loomflow.errors import ConfigurationError, CorruptEntryError, InvalidArgumentError, UserError
from loomflow.models import ScriptedModel
from loomflow.recovery import Recovery, cancel_run, default_backoff
from loomflow.runtime import JournalRuntime, SqliteRuntime, decode_record, runtime_from_url
from loomflow.runtime.codec import CODEC_VERSION
from loomflow.telemetry import Metrics


@pytest.fixture
def app_env(monkeypatch: pytest.MonkeyPatch, journal_url: str, ledger: Path) -> Iterator[None]:
    monkeypatch.setenv("FLEET_URL", journal_url)
    monkeypatch.setenv("FLEET_LEDGER", str(ledger))
    monkeypatch.delenv("FLEET_BLOCK", raising=False)
    monkeypatch.delenv("FLEET_FAIL", raising=False)
    return


@pytest.fixture
async def worker(app_env: None) -> AsyncIterator[dict[str, Agent]]:
    """The app's agents in this process (a recovering worker), closed afterwards."""
    built = _app.agents()
    yield built
    await close_agents(built)


def _runtime(agents: dict[str, Agent]) -> JournalRuntime:
    runtime = agents["orders"].runtime
    assert runtime is not None
    return runtime


def _metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def _file_bytes(folder: Path, pattern: str) -> bytes:
    return b"".join(p.read_bytes() for p in folder.glob(pattern))


async def _states(runtime: JournalRuntime) -> dict[str | None, str]:
    return {s.session_id: s.state for s in await runtime.sessions(limit=1000)}


async def test_a_sigkilled_owner_shows_orphaned_and_is_recovered_once(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    await start_and_kill(journal_url, ledger, 3, "order")
    runtime = _runtime(worker)
    states = await _states(runtime)
    # The killed process's leases have not run out (30 s): liveness says they are orphans.
    assert states == {f"order-{i}": "orphaned" for i in range(3)}
    listed = await runtime.sessions(state="orphaned")
    assert {s.session_id for s in listed} == {f"order-{i}" for i in range(3)}
    assert all(s.agent == "orders" and s.user_id == "ana" for s in listed)
    assert await runtime.sessions(state="running") == []

    metrics = _metrics()
    audit = worker["orders"].audit
    assert isinstance(audit, AuditLog)
    recovery = Recovery(runtime, worker, metrics=metrics, worker_id="test", audit=audit)
    report = await recovery.sweep()
    assert sorted(r.session_id or "" for r in report.resumed) == [f"order-{i}" for i in range(3)]
    assert report.states["orphaned"] == 3
    await recovery.wait()
    assert await _states(runtime) == {f"order-{i}": "finished" for i in range(3)}
    # reserve ran once per run (before the kill; replayed after), ship once (after).
    assert tool_counts(ledger, "reserve") == {f"order-{i}": 1 for i in range(3)}
    assert tool_counts(ledger, "ship") == {f"order-{i}": 1 for i in range(3)}
    sample = metrics.registry.get_sample_value
    assert sample("loomflow_recoveries_total", {"outcome": "resumed"}) == 3
    assert sample("loomflow_recoveries_total", {"outcome": "finished"}) == 3
    assert sample("loomflow_recoveries_total", {"outcome": "dead_lettered"}) == 0
    assert sample("loomflow_recovery_delay_seconds_count", {}) == 3
    backend = runtime.backend
    assert sample("loomflow_runs_by_state", {"state": "orphaned", "backend": backend}) == 3
    # Audited with the worker as actor.
    entries = (await audit.query(user_id="ana", action="run.recover")).entries
    assert {e.actor for e in entries} == {"worker:test"}
    assert sum(1 for e in entries if e.payload.get("outcome") == "finished") == 3
    # Nothing left to do.
    again = await recovery.sweep()
    assert again.resumed == []
    assert again.states["finished"] == 3


async def test_two_recoverers_sweeping_at_once_never_resume_one_run_twice(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    await start_and_kill(journal_url, ledger, 6, "race")
    other = _app.agents()  # a second worker: its own runtime and connection
    try:
        first = Recovery(_runtime(worker), worker, metrics=_metrics(), worker_id="a")
        second = Recovery(_runtime(other), other, metrics=_metrics(), worker_id="b")
        reports = await asyncio.gather(first.sweep(), second.sweep())
        await asyncio.gather(first.wait(), second.wait())
    finally:
        await close_agents(other)
    mine = {r.session_id for r in reports[0].resumed}
    theirs = {r.session_id for r in reports[1].resumed}
    assert not mine & theirs
    assert mine | theirs == {f"race-{i}" for i in range(6)}
    assert tool_counts(ledger, "ship") == {f"race-{i}": 1 for i in range(6)}
    assert set((await _states(_runtime(worker))).values()) == {"finished"}


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_attempts_backoff_and_dead_letter(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await start_and_kill(journal_url, ledger, 1, "fail")
    monkeypatch.setenv("FLEET_FAIL", "1")
    runtime = _runtime(worker)
    metrics = _metrics()
    slow = Recovery(runtime, worker, max_attempts=2, backoff=60, metrics=metrics)
    assert len((await slow.sweep()).resumed) == 1
    await slow.wait()
    [info] = await runtime.sessions()
    assert (info.state, info.attempts) == ("orphaned", 1)
    assert info.last_error == "ConfigurationError: the carrier is down"
    # The retry is not due for 60 s: a sweep now leaves it.
    assert (await slow.sweep()).resumed == []
    fast = Recovery(runtime, worker, max_attempts=2, backoff=0, metrics=metrics)
    # Backoff 0 from here on, but the pending retry_at was set by the first claim.
    assert isinstance(runtime, SqliteRuntime)
    await runtime.database.execute("UPDATE loom_sessions SET retry_at = 0")
    assert len((await fast.sweep()).resumed) == 1
    await fast.wait()
    [info] = await runtime.sessions()
    assert (info.state, info.attempts) == ("failed", 2)
    assert info.last_error == "ConfigurationError: the carrier is down"
    assert (await fast.sweep()).resumed == []  # a dead letter stays put, visible
    assert [s.session_id for s in await runtime.sessions(state="failed")] == ["fail-0"]
    assert tool_counts(ledger, "failed") == {"fail-0": 2}
    sample = metrics.registry.get_sample_value
    assert sample("loomflow_recoveries_total", {"outcome": "retry_failed"}) == 1
    assert sample("loomflow_recoveries_total", {"outcome": "dead_lettered"}) == 1
    assert fast.failures == 1


@pytest.mark.parametrize("max_attempts", [1, 2])
async def test_a_run_cancelled_while_its_attempt_fails_counts_as_cancelled(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    max_attempts: int,
) -> None:
    # A run cancelled while a worker resumed it, whose step then raised, was counted and
    # audited as a dead letter (or a failed attempt, failing `worker --once`) while
    # `runs list` showed it cancelled: the metrics an SRE reads disagreed with the journal.
    await start_and_kill(journal_url, ledger, 1, "gone")
    gate = tmp_path / "gate"
    monkeypatch.setenv("FLEET_BLOCK", "1")
    monkeypatch.setenv("FLEET_GATE", str(gate))
    monkeypatch.setenv("FLEET_FAIL", "1")
    runtime = _runtime(worker)
    metrics = _metrics()
    recovery = Recovery(runtime, worker, max_attempts=max_attempts, backoff=0, metrics=metrics)
    assert len((await recovery.sweep()).resumed) == 1
    await wait_for(ledger, "blocked", 2)  # the killed run's, then the resumed attempt's
    other = runtime_from_url(journal_url)  # the operator's `runs cancel`, another process
    try:
        assert await cancel_run(other, "gone-0", user_id="ana")
    finally:
        await other.close()
    gate.touch()  # ship now raises
    with caplog.at_level("INFO", logger="loomflow.recovery"):
        await recovery.wait()
    assert await _states(runtime) == {"gone-0": "cancelled"}
    sample = metrics.registry.get_sample_value
    counted = {
        o: sample("loomflow_recoveries_total", {"outcome": o})
        for o in ("dead_lettered", "retry_failed", "cancelled")
    }
    assert counted == {"dead_lettered": 0, "retry_failed": 0, "cancelled": 1}
    assert recovery.failures == 0
    assert not [r for r in caplog.records if "gave up" in r.getMessage()]


async def test_a_last_attempt_that_raises_is_logged_as_given_up(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A run given up at a sweep logged "gave up on session ..." as an error; one whose last
    # attempt raised (the usual dead letter) only logged the attempt's warning.
    await start_and_kill(journal_url, ledger, 1, "last")
    monkeypatch.setenv("FLEET_FAIL", "1")
    runtime = _runtime(worker)
    recovery = Recovery(runtime, worker, max_attempts=1, metrics=_metrics())
    with caplog.at_level("WARNING", logger="loomflow.recovery"):
        await recovery.sweep()
        await recovery.wait()
    assert await _states(runtime) == {"last-0": "failed"}
    [line] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert line.getMessage() == (
        "gave up on session 'last-0' of user 'ana': ConfigurationError: the carrier is down"
    )


@pytest.mark.parametrize("attempts", [-5, -(2**31)])
async def test_a_negative_attempt_count_is_retried_up_to_the_dead_letter_limit(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    monkeypatch: pytest.MonkeyPatch,
    attempts: int,
) -> None:
    # Counted up from a negative number, the run's count stayed at or below 0 after a failed
    # attempt: no sweep looked at it again (only runs with attempts are retried), so it was
    # listed as open, never retried and never dead-lettered.
    await start_and_kill(journal_url, ledger, 1, "count")
    monkeypatch.setenv("FLEET_FAIL", "1")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute(f"UPDATE loom_sessions SET attempts = {attempts}")
    recovery = Recovery(runtime, worker, max_attempts=2, backoff=0, metrics=_metrics())
    for _ in range(4):
        await recovery.sweep()
        await recovery.wait()
    [info] = await runtime.sessions()
    assert (info.state, info.attempts) == ("failed", 2)
    assert tool_counts(ledger, "failed") == {"count-0": 2}


async def test_a_dead_letter_out_of_attempts_says_how_its_last_attempt_ended(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every run given up at a sweep was "given up after N attempts; its worker died during the
    # last", also one whose last attempt had raised (swept by a recoverer allowed fewer
    # attempts, a lowered --max-attempts): and the error it raised, its last error until then,
    # was overwritten by that message.
    raised = "ConfigurationError: the carrier is down"
    runtime = _runtime(worker)
    await start_and_kill(journal_url, ledger, 1, "raised")
    monkeypatch.setenv("FLEET_FAIL", "1")
    failing = Recovery(runtime, worker, max_attempts=5, backoff=0, metrics=_metrics())
    assert len((await failing.sweep()).resumed) == 1
    await failing.wait()
    report = await Recovery(runtime, worker, max_attempts=1, metrics=_metrics()).sweep()
    assert [(r.session_id, r.reason) for r in report.dead_lettered] == [
        ("raised-0", f"gave up after 1 attempt; the last raised {raised}")
    ]
    # A run whose first attempt raised and whose second one's worker was killed holding it.
    ledger = ledger.with_name("died.jsonl")
    monkeypatch.setenv("FLEET_LEDGER", str(ledger))
    await start_and_kill(journal_url, ledger, 1, "died")
    assert len((await failing.sweep()).resumed) == 1
    await failing.wait()
    dying = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "loomflow.cli", "worker", "_app:agents", "--once"),
        env=fleet_env(journal_url, ledger, FLEET_BLOCK="1"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        async with asyncio.timeout(60):
            while tool_counts(ledger, "blocked")["died-0"] < 2:  # noqa: ASYNC110 - a file
                await asyncio.sleep(0.05)
    finally:
        dying.kill()
        await dying.wait()
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET retry_at = 0")  # its backoff, not waited out
    report = await Recovery(runtime, worker, max_attempts=2, metrics=_metrics()).sweep()
    assert [(r.session_id, r.reason) for r in report.dead_lettered] == [
        (
            "died-0",
            f"gave up after 2 attempts; its worker died during the last (an earlier one "
            f"raised {raised})",
        )
    ]
    errors = {s.session_id: s.last_error for s in await runtime.sessions(state="failed")}
    assert errors == {
        "raised-0": f"gave up after 1 attempt; the last raised {raised}",
        "died-0": report.dead_lettered[0].reason,
    }
    assert tool_counts(ledger, "ship") == {}


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_unregistered_and_changed_agents_are_left_alone(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await start_and_kill(journal_url, ledger, 1, "alone")
    runtime = _runtime(worker)
    other = worker["orders"].clone(name="billing")
    report = await Recovery(runtime, {"billing": other}, metrics=_metrics()).sweep()
    assert report.resumed == []
    [left] = report.unregistered
    assert left.session_id == "alone-0"
    assert "no agent registered as 'orders'" in left.reason
    changed = worker["orders"].clone(instructions="You fulfil orders, differently.")
    report = await Recovery(runtime, {"orders": changed}, metrics=_metrics()).sweep()
    assert report.resumed == []
    assert "another configuration" in report.unregistered[0].reason
    assert (await _states(runtime)) == {"alone-0": "orphaned"}
    assert tool_counts(ledger, "ship") == {}


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_a_prompt_holding_a_secret_is_not_journaled_and_is_left_to_the_app(
    worker: dict[str, Agent], journal_url: str, ledger: Path, tmp_path: Path
) -> None:
    secret = "sk-live0123456789abcdefSECRET"
    await start_and_kill(journal_url, ledger, 1, "key", FLEET_PROMPT=f"Fulfil it. Key {secret}")
    # Nor in the audit log, which shares the file here.
    assert secret.encode() not in _file_bytes(tmp_path, "journal.db*")
    runtime = _runtime(worker)
    [orphan] = await runtime.orphans()
    assert decode_record(orphan.record) == {"withheld": ["prompt"]}  # withheld whole
    report = await Recovery(runtime, worker, metrics=_metrics()).sweep()
    assert report.resumed == []
    [left] = report.unregistered
    assert left.session_id == "key-0"
    assert "prompt held a secret" in left.reason
    assert (await _states(runtime)) == {"key-0": "orphaned"}
    # The application, which still has the prompt, resumes it as usual.
    result = await worker["orders"].resume(
        f"Fulfil it. Key {secret}", session_id="key-0", user_id="ana"
    )
    assert not result.interrupted
    assert tool_counts(ledger, "reserve") == {"key-0": 1}
    assert tool_counts(ledger, "ship") == {"key-0": 1}


async def test_a_per_call_output_type_needs_an_agent_that_gives_it(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    await start_and_kill(journal_url, ledger, 1, "typed", FLEET_OUTPUT="1")
    runtime = _runtime(worker)
    [orphan] = await runtime.orphans()
    assert decode_record(orphan.record)["output"]["type"] == "Note"
    # The plain agent would resume without the format, diverge and pay for its calls again.
    report = await Recovery(runtime, worker, metrics=_metrics()).sweep()
    assert report.resumed == []
    assert "asked for output_type 'Note'" in report.unregistered[0].reason

    class Note(BaseModel):  # the same name, another shape: still refused
        text: str

    lookalike = worker["orders"].clone(output_type=Note)
    report = await Recovery(runtime, {"orders": lookalike}, metrics=_metrics()).sweep()
    assert report.resumed == []
    typed = worker["orders"].clone(model=ScriptedModel(_app.JSON_SCRIPT), output_type=_app.Note)
    recovery = Recovery(runtime, {"orders": typed}, metrics=_metrics())
    report = await recovery.sweep()
    assert [r.session_id for r in report.resumed] == ["typed-0"]
    await recovery.wait()
    assert (await _states(runtime)) == {"typed-0": "finished"}
    assert tool_counts(ledger, "reserve") == {"typed-0": 1}  # replayed, not run again
    assert tool_counts(ledger, "ship") == {"typed-0": 1}
    result = await typed.resume(_app.PROMPT, session_id="typed-0", user_id="ana")
    assert result.parsed == _app.Note(note="Reserved and shipped.")
    assert result.fresh_steps == 0


async def test_a_huge_recorded_agent_name_is_cut_short_where_the_sweep_names_it(
    worker: dict[str, Agent], journal_url: str, ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A hand-edited name of 100,000 characters went whole into the sweep's reason and its log
    # line (the worker's output), once per run.
    await start_and_kill(journal_url, ledger, 1, "named")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET agent = $1", "orders" + "\u202e" * 100_000)
    with caplog.at_level("WARNING", logger="loomflow.recovery"):
        report = await Recovery(runtime, worker, metrics=_metrics()).sweep()
    [left] = report.unregistered
    assert left.reason.startswith("no agent registered as 'orders\\u202e")
    assert len(left.reason) < 200
    [line] = [r.getMessage() for r in caplog.records if "left orphaned" in r.getMessage()]
    assert len(line) < 300
    assert (await _states(runtime)) == {"named-0": "orphaned"}


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_a_worker_killed_too_often_is_dead_lettered(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    await start_and_kill(journal_url, ledger, 1, "dies")
    runtime = _runtime(worker)
    assert isinstance(runtime, SqliteRuntime)
    # As if two recoverers had claimed it and died: attempts are counted at the claim.
    await runtime.database.execute("UPDATE loom_sessions SET attempts = 2")
    report = await Recovery(runtime, worker, max_attempts=2, metrics=_metrics()).sweep()
    [dead] = report.dead_lettered
    assert "gave up after 2 attempts" in dead.reason
    [info] = await runtime.sessions()
    assert info.state == "failed"
    assert info.last_error == dead.reason


async def test_crafted_rows_never_break_the_listing_or_the_sweep(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    await start_and_kill(journal_url, ledger, 3, "bad")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET status = 'exploded' WHERE session_id = 'bad-0'")
    await db.execute("UPDATE loom_sessions SET record = $1 WHERE session_id = 'bad-1'", b"\x00\xff")
    await db.execute(
        "UPDATE loom_sessions SET record = $1 WHERE session_id = 'bad-2'",
        b'{"__t": "os.system", "v": ["rm -rf /"]}',
    )
    states = await _states(runtime)
    assert states["bad-0"] == "unreadable"
    assert [s.session_id for s in await runtime.sessions(state="unreadable")] == ["bad-0"]
    report = await Recovery(runtime, worker, metrics=_metrics()).sweep()
    assert report.resumed == []
    assert {r.session_id for r in report.dead_lettered} == {"bad-1", "bad-2"}
    assert all("unreadable run record" in r.reason for r in report.dead_lettered)
    assert (await _states(runtime))["bad-1"] == "failed"
    with pytest.raises(InvalidArgumentError, match="state must be one of"):
        await runtime.sessions(state="zombie")


async def test_a_token_at_the_top_of_bigint_fails_its_own_run_not_the_sweep(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    # PostgreSQL failed the whole claim statement ("bigint out of range") for one such row,
    # as a StoreUnavailableError, and no orphan behind it was ever recovered.
    await start_and_kill(journal_url, ledger, 2, "top")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute(f"UPDATE loom_sessions SET token = {2**63 - 1} WHERE session_id = 'top-0'")
    recovery = Recovery(runtime, worker, metrics=_metrics())
    report = await recovery.sweep()
    await recovery.wait()
    assert [r.session_id for r in report.resumed] == ["top-1"]
    assert [r.session_id for r in report.dead_lettered] == ["top-0"]
    assert "lease row is damaged" in report.dead_lettered[0].reason
    with pytest.raises(CorruptEntryError, match="lease row is damaged"):
        await worker["orders"].resume("again", session_id="top-0", user_id="ana")


async def test_a_negative_token_is_reported_damaged_not_claimed_sweep_after_sweep(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    # A hand-edited token of -3: each sweep claimed the row (-2, -1, 0), found the new token
    # unfenceable, and reported the run as lost to another worker, using up an attempt each
    # time; the gauge counted it orphaned while `runs list` said unreadable.
    await start_and_kill(journal_url, ledger, 2, "neg")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET token = -3 WHERE session_id = 'neg-0'")
    recovery = Recovery(runtime, worker, metrics=_metrics())
    for _ in range(2):
        report = await recovery.sweep()
        await recovery.wait()
        assert report.claim_lost == []
        assert [r.session_id for r in report.unregistered] == ["neg-0"]
        assert "token -3" in report.unregistered[0].reason
        assert "repair or delete it" in report.unregistered[0].reason
    assert report.states["unreadable"] == 1
    assert report.states["orphaned"] == 0
    assert (await _states(runtime))["neg-0"] == "unreadable"
    rows = await db.fetch("SELECT token, attempts FROM loom_sessions WHERE session_id = 'neg-0'")
    assert [tuple(r) for r in rows] == [(-3, 0)]  # untouched
    assert tool_counts(ledger, "ship") == {"neg-1": 1}


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_a_text_token_is_reported_damaged_not_lost_to_another_worker(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    # SQLite keeps text in the number column: the claim bound the -1 it read as and never
    # matched, so every sweep called the run lost to another worker.
    await start_and_kill(journal_url, ledger, 1, "text")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET token = 'tok' WHERE session_id = 'text-0'")
    report = await Recovery(runtime, worker, metrics=_metrics()).sweep()
    assert report.claim_lost == []
    assert [r.session_id for r in report.unregistered] == ["text-0"]
    assert "token 'tok'" in report.unregistered[0].reason
    assert (report.states["unreadable"], report.states["orphaned"]) == (1, 0)


async def test_a_closed_run_with_a_damaged_epoch_is_counted_as_runs_list_shows_it(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    await start_and_kill(journal_url, ledger, 1, "ep")
    runtime = _runtime(worker)
    recovery = Recovery(runtime, worker, metrics=_metrics())
    await recovery.sweep()
    await recovery.wait()
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET epoch = -7 WHERE session_id = 'ep-0'")
    assert (await _states(runtime))["ep-0"] == "unreadable"
    states = await runtime.count_states()
    assert (states["unreadable"], states["finished"]) == (1, 0)


async def test_the_runs_by_state_gauge_counts_unreadable_runs_as_runs_list_shows_them(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    # `runs list` shows a hand-edited row as "unreadable", but the gauge an SRE reads dropped
    # it: the journal's runs did not add up, and no series showed that rows were damaged.
    await start_and_kill(journal_url, ledger, 1, "odd")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET open = 0, status = 'zombie'")
    assert await _states(runtime) == {"odd-0": "unreadable"}
    metrics = _metrics()
    await Recovery(runtime, worker, metrics=metrics).sweep()
    gauge = {
        labels["state"]: value
        for family in metrics.registry.collect()
        if family.name == "loomflow_runs_by_state"
        for _name, labels, value, *_ in family.samples
    }
    assert gauge["unreadable"] == 1
    assert sum(gauge.values()) == 1


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_agents_of_another_journal_are_refused_before_any_claim(
    worker: dict[str, Agent], journal_url: str, ledger: Path, tmp_path: Path
) -> None:
    await start_and_kill(journal_url, ledger, 1, "elsewhere")
    runtime = _runtime(worker)
    other = SqliteRuntime(tmp_path / "other.db")
    stray = worker["orders"].clone(runtime=other)
    try:
        with pytest.raises(ConfigurationError, match=r"agents\['orders'\] journals to"):
            await Recovery(runtime, {"orders": stray}, metrics=_metrics()).sweep()
        assert (await _states(runtime)) == {"elsewhere-0": "orphaned"}  # nothing claimed
        # A second runtime object on the same file is the same journal: accepted.
        same = SqliteRuntime(Path(journal_url.removeprefix("sqlite:///")))
        try:
            twin = worker["orders"].clone(runtime=same)
            recovery = Recovery(runtime, {"orders": twin}, metrics=_metrics())
            assert [r.session_id for r in (await recovery.sweep()).resumed] == ["elsewhere-0"]
            await recovery.wait()
            assert (await _states(runtime)) == {"elsewhere-0": "finished"}
        finally:
            await same.close()
    finally:
        await other.close()


async def test_bad_registrations_are_refused(worker: dict[str, Agent]) -> None:
    runtime = _runtime(worker)
    agent = worker["orders"]
    with pytest.raises(UserError, match="is named 'orders'"):
        Recovery(runtime, {"shipping": agent})
    with pytest.raises(UserError, match="no runtime"):
        Recovery(runtime, {"orders": agent.clone(runtime=None)})
    with pytest.raises(UserError, match="not a loomflow Agent"):
        Recovery(runtime, {"orders": object()})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError, match="max_attempts"):
        Recovery(runtime, worker, max_attempts=0)
    with pytest.raises(UserError, match="journaled runtime"):
        Recovery(object(), worker)  # type: ignore[arg-type]
    assert [default_backoff(n) for n in (1, 2, 3, 20)] == [1.0, 2.0, 4.0, 300.0]


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_run_forever_resumes_and_stop_hands_the_run_over_at_once(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await start_and_kill(journal_url, ledger, 1, "loop")
    runtime = _runtime(worker)
    monkeypatch.setenv("FLEET_BLOCK", "1")  # the resumed run blocks in ship again
    audit = worker["orders"].audit
    assert isinstance(audit, AuditLog)
    first = Recovery(
        runtime, worker, interval=0.05, metrics=_metrics(), backoff=300, audit=audit, worker_id="a"
    )
    loop = asyncio.create_task(first.run_forever())
    async with asyncio.timeout(30):
        while sum(tool_counts(ledger, "blocked").values()) < 2:  # noqa: ASYNC110 - a file
            await asyncio.sleep(0.05)
    assert first.active == 1
    assert await _states(runtime) == {"loop-0": "running"}
    await first.stop()
    await loop
    assert first.active == 0
    # Released and due now, although the backoff after this claim was 300 s.
    [info] = await runtime.sessions()
    assert (info.state, info.owner, info.attempts) == ("orphaned", None, 1)
    # The hand-over ends the attempt in the audit log, as every other ending does (it wrote
    # nothing: the claim's run.recover read as an attempt that never concluded).
    entries = (await audit.query(user_id="ana", action="run.recover")).entries
    assert [(e.actor, e.payload.get("attempt"), e.payload.get("outcome")) for e in entries] == [
        ("worker:a", 1, None),
        ("worker:a", 1, "handed_over"),
    ]
    monkeypatch.delenv("FLEET_BLOCK")
    second = Recovery(runtime, worker, metrics=_metrics())
    assert [r.session_id for r in (await second.sweep()).resumed] == ["loop-0"]
    await second.wait()
    assert await _states(runtime) == {"loop-0": "finished"}
    assert tool_counts(ledger, "ship") == {"loop-0": 1}
    assert (await first.sweep()).resumed == []  # a stopped recoverer takes no more work


@pytest.mark.parametrize("journal_url", ["sqlite"], indirect=True)
async def test_orphans_of_other_agents_never_crowd_out_this_recoverers_own(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    await start_and_kill(journal_url, ledger, 3, "crowd")
    runtime = _runtime(worker)
    assert isinstance(runtime, SqliteRuntime)
    await runtime.database.execute(
        "UPDATE loom_sessions SET agent = 'billing', retry_at = -1 WHERE session_id != 'crowd-2'"
    )
    report = await Recovery(runtime, worker, batch=1, metrics=_metrics()).sweep()
    assert [r.session_id for r in report.resumed] == ["crowd-2"]


async def test_a_retry_time_no_backoff_writes_is_due_not_never(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    # A hand-edited retry_at (text, infinity, NaN) never compared as due: the run was never
    # retried and no sweep said a word about it. Now it is due, and the claim rewrites it.
    damaged = (
        ["'soon'", "9e999", "1e300"]
        if journal_url.startswith("sqlite")
        else ["'Infinity'", "'NaN'", "1e300"]
    )
    await start_and_kill(journal_url, ledger, len(damaged), "late")
    runtime = _runtime(worker)
    for i, value in enumerate(damaged):
        await runtime.database.execute(  # type: ignore[attr-defined]
            f"UPDATE loom_sessions SET retry_at = {value} WHERE session_id = 'late-{i}'"
        )
    recovery = Recovery(runtime, worker, metrics=_metrics(), worker_id="t")
    report = await recovery.sweep()
    await recovery.wait()
    assert sorted(r.session_id or "" for r in report.resumed) == [
        f"late-{i}" for i in range(len(damaged))
    ]
    assert set((await _states(runtime)).values()) == {"finished"}
    assert tool_counts(ledger, "ship") == {f"late-{i}": 1 for i in range(len(damaged))}


async def test_a_session_row_whose_ids_no_longer_match_its_key_is_left_alone(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    # The claim finds a run by its key; a row whose session or user column was edited since
    # names a run the key does not. Every sweep counted it "lost to another worker" before,
    # for ever, though no worker had it.
    await start_and_kill(journal_url, ledger, 3, "moved")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute("UPDATE loom_sessions SET session_id = NULL WHERE session_id = 'moved-0'")
    await db.execute("UPDATE loom_sessions SET user_id = 'mallory' WHERE session_id = 'moved-1'")
    metrics = _metrics()
    for _ in range(2):
        recovery = Recovery(runtime, worker, metrics=metrics)
        report = await recovery.sweep()
        await recovery.wait()
        assert report.claim_lost == []
        reasons = {r.session_id: r.reason for r in report.unregistered}
        assert set(reasons) == {None, "moved-1"}
        assert all("session row is damaged" in why for why in reasons.values()), reasons
    assert (await _states(runtime))["moved-2"] == "finished"
    assert tool_counts(ledger, "ship").get("moved-1", 0) == 0  # never resumed as mallory's


async def test_a_run_record_a_newer_loomflow_wrote_is_left_to_a_newer_worker(
    worker: dict[str, Agent], journal_url: str, ledger: Path
) -> None:
    # A newer release's run record read as damage: the old worker dead-lettered a sound run
    # that a worker of the newer release would have finished.
    await start_and_kill(journal_url, ledger, 1, "record")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    [raw] = [r[0] for r in await db.fetch("SELECT record FROM loom_sessions")]
    newer = b'{"codec_version":%d,' % (CODEC_VERSION + 1) + bytes(raw)[1:]
    await db.execute("UPDATE loom_sessions SET record = $1", newer)
    old = Recovery(runtime, worker, metrics=_metrics(), worker_id="old")
    for _ in range(2):
        report = await old.sweep()
        await old.wait()
        assert (report.resumed, report.dead_lettered) == ([], [])
        [left] = report.unregistered
        assert (left.session_id, "newer loomflow" in left.reason) == ("record-0", True)
    [info] = await runtime.sessions()
    assert (info.state, info.attempts, info.last_error) == ("orphaned", 0, None)
    # Read by a release of that codec version (here: the mark taken off), it is resumed.
    await db.execute("UPDATE loom_sessions SET record = $1", bytes(raw))
    new = Recovery(runtime, worker, metrics=_metrics(), worker_id="new")
    assert [r.session_id for r in (await new.sweep()).resumed] == ["record-0"]
    await new.wait()
    assert await _states(runtime) == {"record-0": "finished"}


@pytest.mark.parametrize("entries", ["", "WHERE name NOT LIKE 'model%'"])  # all, or a tool's
async def test_a_run_a_newer_loomflow_journaled_is_left_to_a_newer_worker(
    worker: dict[str, Agent],
    journal_url: str,
    ledger: Path,
    caplog: pytest.LogCaptureFixture,
    entries: str,
) -> None:
    # A rolling upgrade: a newer loomflow journaled the run's steps in a codec this worker
    # cannot read. Each replay raised NewerEntryError, counted as a failed attempt, and after
    # max_attempts the old worker dead-lettered a sound run that a newer worker would finish.
    await start_and_kill(journal_url, ledger, 1, "newer")
    runtime = _runtime(worker)
    db = runtime.database  # type: ignore[attr-defined]
    await db.execute(f"UPDATE loom_entries SET codec_version = {CODEC_VERSION + 1} {entries}")
    await db.execute("UPDATE loom_sessions SET attempts = 1")  # one attempt raised before
    metrics = _metrics()
    old = Recovery(runtime, worker, max_attempts=2, backoff=300, metrics=metrics, worker_id="old")
    with caplog.at_level("WARNING", logger="loomflow.recovery"):
        assert [r.session_id for r in (await old.sweep()).resumed] == ["newer-0"]
        await old.wait()
        for _ in range(3):  # left alone from now on: not claimed sweep after sweep
            report = await old.sweep()
            await old.wait()
            assert report.resumed == []
            [left] = report.unregistered
            assert left.session_id == "newer-0"
            assert "newer loomflow" in left.reason
    [info] = await runtime.sessions()
    # Not failed, no error noted, and the attempt given back.
    assert (info.state, info.attempts, info.last_error) == ("orphaned", 1, None)
    [line] = [r.getMessage() for r in caplog.records if "newer" in r.getMessage()]
    assert "'newer-0'" in line
    sample = metrics.registry.get_sample_value
    counted = {
        o: sample("loomflow_recoveries_total", {"outcome": o})
        for o in ("unregistered", "retry_failed", "dead_lettered")
    }
    assert counted == {"unregistered": 1, "retry_failed": 0, "dead_lettered": 0}
    assert old.failures == 0
    # A newer worker (here: the entries made readable again) takes it over at once, although
    # the old worker's claim set a retry 300 s away.
    await db.execute(f"UPDATE loom_entries SET codec_version = {CODEC_VERSION}")
    new = Recovery(runtime, worker, max_attempts=2, metrics=_metrics(), worker_id="new")
    assert [r.session_id for r in (await new.sweep()).resumed] == ["newer-0"]
    await new.wait()
    assert await _states(runtime) == {"newer-0": "finished"}
    assert tool_counts(ledger, "reserve") == {"newer-0": 1}
    assert tool_counts(ledger, "ship") == {"newer-0": 1}
