"""``loomflow demo``: crash a real worker mid-run, resume it, and show what the journal did."""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from ulid import ULID

from ..runtime import JournalRun, runtime_from_url
from ._demo_task import run_task, steps

USER = "alice@example.com"


def _spawn_until_step(url: str, ledger: Path, session: str, stop_after: int, timeout: float) -> int:
    """Start the worker, wait for its handshake after step ``stop_after``, SIGKILL it."""
    cmd = [
        sys.executable,
        "-m",
        "loomflow.cli._demo_task",
        url,
        str(ledger),
        session,
        USER,
        "--stop-after",
        str(stop_after),
    ]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        try:
            line = _readline(child, timeout)
            if line.strip() != f"STEP-DONE {stop_after}":
                raise RuntimeError(f"worker said {line!r} instead of its handshake")
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
        return child.pid


def _readline(child: subprocess.Popen[str], timeout: float) -> str:
    assert child.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"worker gave no handshake within {timeout:g}s")
    return child.stdout.readline()


def run_demo(*, postgres: str | None, workdir: Path | None, stop_after: int) -> int:
    """Run the demo story and print the report; returns the process exit code."""
    work = workdir or Path(tempfile.mkdtemp(prefix="loomflow-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ledger = work / "side-effects.jsonl"
    ledger.unlink(missing_ok=True)
    url = postgres or f"sqlite:///{(work / 'journal.db').resolve()}"
    if not postgres:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{work / 'journal.db'}{suffix}").unlink(missing_ok=True)
    session = f"order-A-1042-{ULID()}"  # a new session per demo, so old journals never replay
    total = len(steps(ledger))
    if not 1 <= stop_after < total:
        print(f"--kill-after must be between 1 and {total - 1}", file=sys.stderr)
        return 2

    backend = "PostgreSQL" if postgres else f"SQLite ({work / 'journal.db'})"
    print(f"loomflow demo — journal on {backend}\n")
    print(f"1. A worker process runs a {total}-step order task for {USER}, session {session}.")
    pid = _spawn_until_step(url, ledger, session, stop_after, timeout=60)
    print(f"2. After step {stop_after} the worker (pid {pid}) was killed with SIGKILL.")
    print("3. This process resumes the same session and user from the journal.\n")
    run = asyncio.run(_resume(url, ledger, session))

    effects = Counter(json.loads(line)["action"] for line in ledger.read_text().splitlines())
    print(f"{'step':<20} {'on resume':<22} {'side effects in total':>21}")
    print("-" * 65)
    for name, _, _ in steps(ledger):
        status = "replayed from journal" if name in run.stats.hit_steps else "ran fresh"
        print(f"{name:<20} {status:<22} {effects[name]:>21}")
    repeated = [name for name, count in effects.items() if count != 1]
    missing = [name for name, _, _ in steps(ledger) if effects[name] == 0]
    print()
    stats = run.stats
    ratio = stats.hits / max(stats.hits + stats.misses, 1)
    print(
        f"replay metrics: hits={stats.hits} misses={stats.misses} "
        f"divergences={stats.divergences} hit ratio={ratio:.0%}"
    )
    if repeated or missing:
        print(f"FAILED: repeated side effects {repeated}, missing {missing}")
        return 1
    print(f"No side effect ran twice: each of the {total} actions happened exactly once.")
    print(f"Journal and side-effect ledger kept in {work}")
    return 0


async def _resume(url: str, ledger: Path, session: str) -> JournalRun:
    runtime = runtime_from_url(url)
    try:
        return await run_task(runtime, ledger, session, USER)
    finally:
        await runtime.close()
