"""Real worker processes killed with SIGKILL; another process resumes from the checkpoint."""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("_checkpoint_worker.py")


def _kill_after(url: str, ledger: Path, mode: str, line: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), url, str(ledger), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(60):
                raise AssertionError(f"no {line!r} from the worker within 60s")
        got = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
    assert got == line, stderr


def _worker(url: str, ledger: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), url, str(ledger), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _resume(url: str, ledger: Path, mode: str = "resume") -> dict[str, Any]:
    done = _worker(url, ledger, mode)
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_dsn"))
    return f"sqlite:///{tmp_path / 'journal.db'}"


@pytest.mark.crash
def test_killed_mid_run_resumes_from_the_snapshot(url: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.txt"
    _kill_after(url, ledger, "mid-run", "PASS-2")
    assert ledger.read_text().splitlines() == ["apples", "bread"]
    summary = _resume(url, ledger)
    assert summary["output"] == "bought everything"
    assert summary["restored"]
    assert summary["live_turns"] == [2, 3]  # the two earlier turns were restored, not re-run
    assert summary["model_calls"] == 2
    assert summary["replayed"] == 0  # no replay walk
    assert summary["turns"] == 4
    assert summary["episodes"] == 1
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]


@pytest.mark.crash
def test_killed_after_the_episode_write_leaves_one_episode(url: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.txt"
    _kill_after(url, ledger, "episode", "EPISODE-WRITTEN")
    summary = _resume(url, ledger)
    assert summary["output"] == "bought everything"
    assert summary["restored"]  # the final snapshot: no model call at all
    assert summary["model_calls"] == 0
    assert summary["fresh"] == 1  # only the episode step, whose journal entry was lost
    assert summary["episodes"] == 1  # rewritten in place, not duplicated
    assert summary["episode_messages"] == 8
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]


@pytest.mark.crash
def test_killed_as_a_fork_starts_resumes_the_fork_from_its_fork_point(
    url: str, tmp_path: Path
) -> None:
    """Killed after the fork's run opened (its session claimed) but while its hooks were
    being told: the resume continues the fork after bread, instead of shopping afresh."""
    ledger = tmp_path / "ledger.txt"
    _kill_after(url, ledger, "fork", "FORK-STARTING")
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]
    summary = _resume(url, ledger, "resume-fork")
    assert summary["restored"]
    assert summary["output"] == "bought everything"
    assert summary["live_turns"] == [2, 3]  # the fork's own turns: cheese, then the answer
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese", "cheese"]


async def _kill_in_the_fork_window(dsn: str, ledger: Path) -> None:
    """Fork in a worker whose first snapshot of the fork cannot be written (another session
    holds loom_checkpoints), and SIGKILL it there: the fork's run is open, and its session
    has no snapshot."""
    import asyncpg

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        dsn,
        str(ledger),
        "half-fork",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    blocker = await asyncpg.connect(dsn)
    watcher = await asyncpg.connect(dsn)  # pg_stat_activity stays put inside a transaction
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.decode().strip() == "RUN-DONE"
        locked = blocker.transaction()
        await locked.start()
        # Reads go on (the fork finds its source); the snapshot insert waits.
        await blocker.execute("LOCK TABLE loom_checkpoints IN EXCLUSIVE MODE")
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        for _ in range(600):
            waiting = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query ILIKE '%loom_checkpoints%'"
            )
            if waiting:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the fork never reached its first snapshot write")
        proc.kill()
        await proc.wait()
        await locked.rollback()
        # The window: the fork's run is open, its session holds no snapshot.
        assert await blocker.fetchval(
            "SELECT count(*) FROM loom_checkpoints WHERE session_id LIKE '%crash-fork%'"
        ) == 0  # fmt: skip
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await blocker.close()
        await watcher.close()


@pytest.mark.crash
@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["resume-fork", "recover"])
async def test_a_fork_killed_before_its_first_snapshot_resumes_from_its_source(
    pg_dsn: str, tmp_path: Path, mode: str
) -> None:
    """The fork's run opened, the process died before its first snapshot: the resume (by
    agent.resume, or by a recovery worker) seeds the fork from the checkpoint it was forked
    from (its record names it) instead of shopping afresh from the prompt."""
    ledger = tmp_path / "ledger.txt"
    await _kill_in_the_fork_window(pg_dsn, ledger)
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]
    summary = await asyncio.to_thread(_resume, pg_dsn, ledger, mode)
    assert summary["output"] == "bought everything"
    assert summary["live_turns"] == [2, 3]  # the fork's own turns: cheese, then the answer
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese", "cheese"]


async def _drop_the_source(dsn: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DELETE FROM loom_checkpoints WHERE session_id = 'crash'")
    finally:
        await conn.close()


@pytest.mark.crash
@pytest.mark.postgres
async def test_a_half_fork_whose_source_is_gone_is_refused_not_run_again(
    pg_dsn: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    await _kill_in_the_fork_window(pg_dsn, ledger)
    await _drop_the_source(pg_dsn)
    done = await asyncio.to_thread(_worker, pg_dsn, ledger, "resume-fork")
    assert done.returncode != 0
    assert "CheckpointNotFoundError" in done.stderr
    assert "stopped before its first snapshot" in done.stderr
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]  # nothing re-run
    # A recovery worker meets the same error, which no later attempt could mend: the run is
    # a dead letter at once (the default allows 5 attempts), and nothing shops again.
    summary = await asyncio.to_thread(_resume, pg_dsn, ledger, "recover")
    assert summary["resumed"] == ["crash-fork"]
    assert summary["state"] == "failed"
    assert summary["last_error"].startswith("CheckpointNotFoundError: session 'crash-fork'")
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]
