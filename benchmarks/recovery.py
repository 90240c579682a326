"""Recovery: how long after a worker's death its runs are resumed, and what one sweep costs.

Per backend (SQLite file by default; PostgreSQL too unless ``--skip-postgres``), on a journal
holding ``--finished`` finished runs:

1. **Sweep cost.** A child process starts ``--orphaned`` runs of an order agent, each blocked
   inside a tool, and is killed with SIGKILL: that many orphaned runs. Timed: sweeps of a
   recoverer with no agent registered (it reads the run states and the orphans and leaves them
   alone: what every worker pays every interval), then the one sweep that claims them all.
2. **Time to recover.** A recoverer sweeps every ``--interval`` seconds, as ``loomflow worker``
   does. Another child starts ``--orphaned`` runs and is killed; for each run, the time from the
   kill to the recoverer resuming it (its tool starts again) and to the run finishing.

Same host: a dead owner's process is noticed at once, so the lease (``--lease``) is not waited
out; across hosts add up to one lease to the times to resume.

    python benchmarks/recovery.py
    python benchmarks/recovery.py --finished 10000 --orphaned 100 --interval 1 --skip-postgres
    python benchmarks/recovery.py --pg-dsn postgresql://postgres@127.0.0.1:5432/postgres

PostgreSQL work happens in a scratch database that the script creates and drops. Prints one
JSON object per backend; no figure is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from ulid import ULID

from loomflow.agent import Agent
from loomflow.context import get_run_context
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.recovery import Recovery
from loomflow.runtime import JournalRuntime, PostgresRuntime, runtime_from_url
from loomflow.telemetry import Metrics
from loomflow.tools import tool

# The server the test suite uses (tests/conftest.py), so a bare run needs no flags.
PG_DSN = os.environ.get("LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

PROMPT = "Pack the order."
SCRIPT = [[ToolCall(id="c0", name="pack", arguments={"box": "M"})], "Packed."]


# -- the application (the child that gets killed runs this too) ------------------------------


def _mark(event: str) -> None:
    line = json.dumps(
        {
            "event": event,
            "session": get_run_context().session_id,
            "pid": os.getpid(),
            "t": time.time(),
        }
    )
    fd = os.open(os.environ["BENCH_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@tool
async def pack(box: str) -> str:
    """Pack the order (the seeding child stops here for good, to be killed)."""
    _mark("pack")
    if os.environ.get("BENCH_BLOCK") == "1":
        await asyncio.Event().wait()
    return f"packed in {box}"


def build_agent(url: str, lease: float) -> Agent:
    return Agent(
        "You pack orders.",
        model=ScriptedModel(SCRIPT),
        tools=[pack],
        runtime=runtime_from_url(url, lease_seconds=lease),
        memory=False,
        telemetry=False,
        name="orders",
    )


async def seed_child(url: str, count: int, prefix: str, lease: float) -> None:
    agent = build_agent(url, lease)
    await asyncio.gather(
        *(agent.run(PROMPT, session_id=f"{prefix}-{i}", user_id="shop") for i in range(count))
    )


# -- the parent --------------------------------------------------------------------------------


def ledger(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def seed_and_kill(url: str, count: int, prefix: str, lease: float, path: Path) -> float:
    """Start ``count`` runs in a child, wait until all are inside the tool, SIGKILL it."""
    env = dict(os.environ, BENCH_LEDGER=str(path), BENCH_BLOCK="1")
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "seed", url, str(count), prefix, str(lease), env=env
    )
    try:
        async with asyncio.timeout(120):
            while sum(1 for x in ledger(path) if x["session"].startswith(prefix + "-")) < count:
                if child.returncode is not None:
                    raise SystemExit(f"the seeding child exited with {child.returncode}")
                await asyncio.sleep(0.02)
    finally:
        killed_at = time.time()
        if child.returncode is None:
            child.send_signal(signal.SIGKILL)
        await child.wait()
    return killed_at


def load_finished(runtime: JournalRuntime, count: int) -> Awaitable[None]:
    """Session rows of ``count`` finished runs, written directly (a sweep reads sessions only)."""
    now = time.time()
    rows = [
        (f"finished-{i:06d}", f"finished-{i:06d}", "shop", 1, 0, now, "orders", now)
        for i in range(count)
    ]
    columns = ["scope", "session_id", "user_id", "epoch", "open", "updated_at", "agent"]
    columns.append("created_at")

    async def into_postgres() -> None:
        pool = runtime.database.pool  # type: ignore[attr-defined]
        async with pool.acquire() as conn:
            await conn.copy_records_to_table("loom_sessions", records=rows, columns=columns)
            await conn.execute("ANALYZE loom_sessions")

    async def into_sqlite() -> None:
        with sqlite3.connect(runtime.path) as conn:  # type: ignore[attr-defined]
            marks = ", ".join("?" * len(columns))
            conn.executemany(
                f"INSERT INTO loom_sessions ({', '.join(columns)}) VALUES ({marks})", rows
            )
            conn.execute("ANALYZE")

    return into_postgres() if isinstance(runtime, PostgresRuntime) else into_sqlite()


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 4), "p99": round(p99, 4)}


async def measure(
    backend: str, url: str, workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    agent = build_agent(url, args.lease)
    runtime = agent.runtime
    assert isinstance(runtime, JournalRuntime)  # the recoverer resumes through its runtime
    await runtime.migrate()
    await load_finished(runtime, args.finished)
    metrics = Metrics(CollectorRegistry())
    result: dict[str, Any] = {
        "backend": backend,
        "finished_runs": args.finished,
        "orphaned_runs": args.orphaned,
    }

    # 1. the cost of a sweep: 10,000 finished and 100 orphaned runs in the journal
    first = workdir / "ledger-1.jsonl"
    os.environ["BENCH_LEDGER"] = str(first)  # where the tool writes, in this process too
    await seed_and_kill(url, args.orphaned, "cost", args.lease, first)
    idle = Recovery(runtime, {}, metrics=metrics, concurrency=args.orphaned)
    times = []
    for _ in range(args.sweeps):
        start = time.perf_counter()
        report = await idle.sweep()
        times.append(time.perf_counter() - start)
    assert len(report.unregistered) == args.orphaned, report
    assert report.states["orphaned"] == args.orphaned, report.states
    result["sweep_reading_s"] = quantiles(times)
    claiming = Recovery(runtime, {"orders": agent}, metrics=metrics, concurrency=args.orphaned)
    start = time.perf_counter()
    report = await claiming.sweep()
    result["sweep_claiming_all_s"] = round(time.perf_counter() - start, 4)
    assert len(report.resumed) == args.orphaned, report
    await claiming.wait()
    result["resuming_all_s"] = round(time.perf_counter() - start, 4)

    # 2. time to recover: a recoverer already sweeping when the worker dies
    second = workdir / "ledger-2.jsonl"
    os.environ["BENCH_LEDGER"] = str(second)
    worker = Recovery(
        runtime,
        {"orders": agent},
        metrics=metrics,
        interval=args.interval,
        concurrency=args.orphaned,
    )
    sweeping = asyncio.create_task(worker.run_forever())
    killed_at = await seed_and_kill(url, args.orphaned, "kill", args.lease, second)
    everything = args.finished + 2 * args.orphaned
    async with asyncio.timeout(120):
        while (await runtime.count_states())["finished"] < everything:  # noqa: ASYNC110
            await asyncio.sleep(0.02)  # polling the journal, as an operator's dashboard does
    finished_at = time.time()
    await worker.stop()
    await sweeping
    resumed: dict[str, float] = {}
    for line in ledger(second):
        if line["pid"] == os.getpid():  # the tool starting again, in the recoverer
            resumed[line["session"]] = min(
                resumed.get(line["session"], 1e12), line["t"] - killed_at
            )
    assert len(resumed) == args.orphaned, len(resumed)
    result["interval_s"] = args.interval
    result["kill_to_resumed_s"] = quantiles(list(resumed.values()))
    result["kill_to_all_finished_s"] = round(finished_at - killed_at, 4)
    await runtime.close()
    return result


async def with_sqlite(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loomflow-bench-") as tmp:
        return await measure("sqlite", f"sqlite:///{Path(tmp) / 'journal.db'}", Path(tmp), args)


async def with_postgres(args: argparse.Namespace) -> dict[str, Any]:
    import asyncpg

    name = f"loom_bench_{str(ULID()).lower()}"
    try:
        admin = await asyncpg.connect(args.pg_dsn, timeout=5)
    except (OSError, asyncpg.PostgresError) as exc:
        return {"backend": "postgres", "note": f"skipped: cannot connect to {args.pg_dsn}: {exc}"}
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        parts = urllib.parse.urlsplit(args.pg_dsn)
        dsn = urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))
        with tempfile.TemporaryDirectory(prefix="loomflow-bench-") as tmp:
            return await measure("postgres", dsn, Path(tmp), args)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--finished", type=int, default=10_000, help="finished runs (10000)")
    p.add_argument("--orphaned", type=int, default=100, help="orphaned runs (100)")
    p.add_argument("--sweeps", type=int, default=20, help="timed reading sweeps (20)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between sweeps (1)")
    p.add_argument("--lease", type=float, default=30.0, help="run lease in seconds (30)")
    p.add_argument("--pg-dsn", default=PG_DSN, help="server to create the scratch database on")
    p.add_argument("--skip-postgres", action="store_true")
    p.add_argument("--skip-sqlite", action="store_true")
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    runs: list[Callable[[argparse.Namespace], Awaitable[dict[str, Any]]]] = []
    if not args.skip_sqlite:
        runs.append(with_sqlite)
    if not args.skip_postgres:
        runs.append(with_postgres)
    for run in runs:
        print(json.dumps(await run(args)), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["seed"]:
        url, count, prefix, lease = sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
        asyncio.run(seed_child(url, count, prefix, lease))
    else:
        asyncio.run(main(parse()))
