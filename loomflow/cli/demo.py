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

from ..agent import RunResult
from ..runtime import StepEvent, runtime_from_url
from ._demo_task import PLAN, TOOL_NAMES, governance, run_task

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
    journal = work / "journal.db"
    url = postgres or f"sqlite:///{journal.resolve()}"
    if not postgres:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{journal}{suffix}").unlink(missing_ok=True)
    session = f"order-A-1042-{ULID()}"  # a new session per demo, so old journals never replay
    if not 1 <= stop_after < len(PLAN):
        print(f"--kill-after must be between 1 and {len(PLAN) - 1}", file=sys.stderr)
        return 2

    backend = "PostgreSQL" if postgres else f"SQLite ({journal})"
    print(f"loomflow demo: journal on {backend}\n")
    print(f"1. A worker process runs the order agent for {USER} (session {session}).")
    pid = _spawn_until_step(url, ledger, session, stop_after, timeout=60)
    print(
        f"2. After model turn {stop_after} and its tool calls, the worker (pid {pid}) was "
        "killed with SIGKILL."
    )
    print("3. This process resumes the run: agent.resume(prompt, session_id, user_id).\n")
    steps: list[StepEvent] = []
    result = asyncio.run(_resume(url, ledger, session, steps))

    effects = Counter(json.loads(line)["action"] for line in ledger.read_text().splitlines())
    print(f"{'journaled step':<34} {'on resume':<22} {'side effects':>12}")
    print("-" * 70)
    for event in steps:
        if event.path:
            continue
        label = _label(event.name)
        status = "replayed from journal" if event.outcome == "hit" else "ran fresh"
        count = str(effects[label]) if label in effects else "-"
        print(f"{label:<34} {status:<22} {count:>12}")
    print(f"\nfinal answer: {result.output}")
    trail, budget_lines = asyncio.run(_governance_report(url, session))
    print(f"\naudit trail of {USER} for this session ({len(trail)} entries, both processes):")
    for line in trail:
        print(f"  {line}")
    print("budget:", "; ".join(budget_lines))
    print(f"tokens: {result.tokens_in} in, {result.tokens_out} out; cost ${result.cost_usd:.4f}")
    hits = sum(1 for e in steps if e.outcome == "hit")
    misses = sum(1 for e in steps if e.outcome != "hit")
    divergences = sum(1 for e in steps if e.outcome == "divergence")
    print(
        f"replay metrics: hits={hits} misses={misses} divergences={divergences} "
        f"hit ratio={hits / max(hits + misses, 1):.0%}"
    )
    repeated = sorted(name for name, count in effects.items() if count != 1)
    missing = sorted(name for name in TOOL_NAMES if effects[name] == 0)
    if repeated or missing or result.interrupted:
        print(f"FAILED: repeated side effects {repeated}, missing {missing}")
        return 1
    print(
        f"No side effect ran twice: each of the {len(TOOL_NAMES)} tool actions happened "
        "exactly once."
    )
    print(f"Journal and side-effect ledger kept in {work}")
    return 0


def _label(step_name: str) -> str:
    """``tool_call_1_0_<hash>`` -> the tool it called; model calls keep their name."""
    if step_name.startswith("tool_call_"):
        turn, slot = (int(x) for x in step_name.split("_")[2:4])
        return PLAN[turn][slot][0]
    return step_name


async def _governance_report(url: str, session: str) -> tuple[list[str], list[str]]:
    runtime = runtime_from_url(url)
    try:
        await runtime.open()
        audit, budget = governance(runtime)
        page = await audit.query(user_id=USER, session_id=session, limit=500)
        trail = []
        for entry in page.entries:
            detail = entry.payload.get("tool") or entry.payload.get("outcome") or ""
            trail.append(f"#{entry.seq:<3} {entry.action:<16} {detail}")
        report = await audit.verify(user_id=USER)
        trail.append(f"chain verified: {'ok' if report.ok else 'PROBLEMS FOUND'}")
        caps = [
            f"{c.cap} used {c.used:,.0f} of {c.limit:,.0f} ({c.fraction:.1%})"
            for c in await budget.status(USER)
        ]
        return trail, caps
    finally:
        await runtime.close()


async def _resume(url: str, ledger: Path, session: str, steps: list[StepEvent]) -> RunResult:
    runtime = runtime_from_url(url)
    try:
        return await run_task(runtime, ledger, session, USER, resume=True, steps=steps)
    finally:
        await runtime.close()
