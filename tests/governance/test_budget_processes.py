"""Real worker processes against one budget store: no overshoot, and dead workers reclaimed."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loomflow.governance.budget import Bucket, SqlBudgetStore

WORKER = Path(__file__).with_name("_budget_worker.py")

CAP = 6_000
CONFIG = {
    "cap": CAP,
    "usage": [100, 20],  # every call spends 120 tokens
    "max_tokens": 32,
    "overhead": 150,  # the reservation must cover the 100 input tokens the model reports
    "tool_turns": 2,  # three model calls per run
}


def spawn(command: str, url: str, config: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), command, url, json.dumps(config)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def contend(url: str, *, processes: int, alice_runs: int, mode: str) -> list[dict[str, Any]]:
    """Start the workers, release them together, and gather every run's result."""
    per_process = [alice_runs // processes + (i < alice_runs % processes) for i in range(processes)]
    workers = [
        spawn("runs", url, {**CONFIG, "mode": mode, "users": ["alice"] * n + ["bob"]})
        for n in per_process
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            line = worker.stdout.readline()
            assert line.strip() == "ready", worker.stderr.read() if worker.stderr else line
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        rows: list[dict[str, Any]] = []
        for worker in workers:
            out, err = worker.communicate(timeout=120)
            assert worker.returncode == 0, err
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
    assert len(rows) == alice_runs + processes
    return rows


async def spent(url: str, user: str) -> tuple[int, int, int]:
    """(tokens spent, tokens still held, reservations left) of ``user``."""
    store = SqlBudgetStore(url)
    try:
        bucket = Bucket("user", user)
        totals = (await store.totals([bucket.key]))[bucket.key]
        left = [r for r in await store.reservations() if bucket in r.buckets]
        used = totals.tokens_in + totals.tokens_out
        return used, totals.reserved_in + totals.reserved_out, len(left)
    finally:
        await store.close()


def check_contention(url: str, rows: list[dict[str, Any]]) -> int:
    alice = [r for r in rows if r["user"] == "alice"]
    bob = [r for r in rows if r["user"] == "bob"]
    used, held, left = asyncio.run(spent(url, "alice"))
    overshoot = max(0, used - CAP)
    print(f"\nalice: {used} of {CAP} tokens spent, overshoot {overshoot}")
    assert overshoot == 0
    assert (held, left) == (0, 0)
    # Every token a run reports was charged once, and nothing else was.
    assert used == sum(r["tokens"] for r in alice)
    assert {r["reason"] for r in alice if r["interrupted"]} == {"budget:user.tokens_total"}
    assert any(r["interrupted"] for r in alice)
    # The cap was spent, not refused early. (Whether some run of alice's also finished depends
    # on scheduling: 50 first calls of 120 tokens spend exactly the 6,000, and with quick
    # store writes they can all come before any second call, so every run stops at its second.)
    assert used > CAP // 2, f"alice spent {used} of {CAP}: calls were refused with room left"
    # bob spends on his own cap: every one of his runs finished, whatever alice did.
    assert all(not r["interrupted"] and r["turns"] == 3 for r in bob)
    assert asyncio.run(spent(url, "bob"))[0] == sum(r["tokens"] for r in bob) == 360 * len(bob)
    return overshoot


@pytest.mark.postgres
def test_fifty_runs_in_four_processes_never_overshoot_a_hard_cap(pg_dsn: str) -> None:
    asyncio.run(_migrate(pg_dsn))
    rows = contend(pg_dsn, processes=4, alice_runs=50, mode="hard")
    check_contention(pg_dsn, rows)


def test_processes_sharing_a_sqlite_budget_never_overshoot(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'budget.db'}"
    asyncio.run(_migrate(url))
    rows = contend(url, processes=3, alice_runs=24, mode="hard")
    check_contention(url, rows)


async def _migrate(url: str) -> None:
    store = SqlBudgetStore(url)
    await store.migrate()
    await store.close()


@pytest.mark.crash
@pytest.mark.postgres
def test_a_killed_workers_reservation_is_charged_at_once(pg_dsn: str) -> None:
    asyncio.run(_migrate(pg_dsn))
    worker = spawn("hold", pg_dsn, {**CONFIG, "user": "carol", "lease_s": 3600})
    assert worker.stdout is not None
    assert worker.stdout.readline().strip() == "held"
    assert asyncio.run(spent(pg_dsn, "carol")) == (0, 32, 1)
    worker.send_signal(signal.SIGKILL)
    worker.communicate(timeout=10)  # reaped, and its pipes closed
    # The lease has an hour to run, but the owner's process is gone from this host: a worker
    # reclaims the hold on its next sweep, charged in full (the call may have been billed).
    assert asyncio.run(_reclaim(pg_dsn)) == 1
    assert asyncio.run(spent(pg_dsn, "carol")) == (32, 0, 0)


async def _reclaim(url: str) -> int:
    store = SqlBudgetStore(url)
    try:
        return await store.reclaim()
    finally:
        await store.close()
