"""What the budget costs per model call, and how far concurrent workers overshoot a cap.

1. Latency: one reservation plus its commit (the budget's whole share of a model call), for a
   user with an all-time and a daily cap, one call after another; median and p95 over
   ``--calls`` calls, per backend (memory, SQLite with ``synchronous=FULL``, PostgreSQL).
2. Contention: ``--processes`` worker processes each run ``--runs`` agent runs at once, all for
   one user, against one store with a ``tokens_total`` cap that covers about a third of the
   demand. Every model call reports a fixed usage. Reported per mode (hard, soft): tokens spent
   against the cap, the overshoot, runs finished and interrupted, and the wall time.

Run it:

    python benchmarks/budget_contention.py
    python benchmarks/budget_contention.py --processes 8 --runs 25 --pg-dsn postgresql://...
    python benchmarks/budget_contention.py --skip-postgres

PostgreSQL work happens in a scratch database that the script creates and drops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from ulid import ULID

from loomflow.agent import Agent, Tuning
from loomflow.governance.budget import (
    Bucket,
    BudgetStore,
    Cap,
    InMemoryBudgetStore,
    SqlBudgetStore,
    StandardBudget,
)
from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec, Usage
from loomflow.models import FunctionModel
from loomflow.tools import tool

# The server the test suite uses (tests/conftest.py), so a bare run needs no flags.
PG_DSN = os.environ.get("LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

USAGE = (100, 20)  # tokens in, out of every model call
TOOL_TURNS = 2  # three model calls per run
MAX_TOKENS = 32
OVERHEAD = 150


# -- latency ---------------------------------------------------------------------------------


async def latency(store: BudgetStore, calls: int) -> tuple[float, float]:
    budget = StandardBudget(
        [Cap("tokens_total", 10**12), Cap("cost_usd", 10**6, window="day")], store=store
    )
    usage = Usage(input_tokens=100, output_tokens=20)
    await budget.store.open()
    for _ in range(20):  # warm up connections and statement caches
        ticket = await budget.reserve(user_id="u", model="gpt-4o", max_tokens=64, input_tokens=200)
        await budget.commit(ticket, usage)
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        ticket = await budget.reserve(user_id="u", model="gpt-4o", max_tokens=64, input_tokens=200)
        await budget.commit(ticket, usage)
        samples.append(time.perf_counter() - start)
    await budget.close()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.95)]


# -- contention ------------------------------------------------------------------------------


@tool
async def lookup(key: str) -> str:
    """Look a key up."""
    await asyncio.sleep(random.uniform(0, 0.003))
    return f"value of {key}"


async def worker(url: str, mode: str, cap: int, runs: int) -> None:
    budget = StandardBudget(
        [Cap("tokens_total", cap)], store=SqlBudgetStore(url), mode=mode, overhead_tokens=OVERHEAD
    )
    await budget.store.open()
    usage = Usage(input_tokens=USAGE[0], output_tokens=USAGE[1])

    async def decide(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        await asyncio.sleep(random.uniform(0, 0.003))
        done = sum(1 for m in messages if m.role == "tool")
        if done < TOOL_TURNS:
            call = ToolCall(id=f"c{done}", name="lookup", arguments={"key": f"k{done}"})
            return ModelResponse(tool_calls=[call], usage=usage, finish_reason="tool_calls")
        return ModelResponse(text="done", usage=usage)

    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[lookup],
        budget=budget,
        tuning=Tuning(max_tokens=MAX_TOKENS),
    )
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    results = await asyncio.gather(*(agent.run("go", user_id="alice") for _ in range(runs)))
    print(json.dumps([r.interrupted for r in results]), flush=True)
    await budget.close()


def contention(url: str, mode: str, processes: int, runs: int) -> dict[str, Any]:
    demand = processes * runs * (TOOL_TURNS + 1) * sum(USAGE)
    cap = demand // 3 + 70  # not a multiple of a call, so a soft cap can be overshot
    asyncio.run(_migrate(url))
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", url, mode, str(cap), str(runs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    for w in workers:
        assert w.stdout is not None
        assert w.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    for w in workers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    interrupted: list[bool] = []
    for w in workers:
        out, _ = w.communicate(timeout=600)
        interrupted += json.loads(out.strip().splitlines()[-1])
    elapsed = time.perf_counter() - start
    spent = asyncio.run(_spent(url))
    return {
        "mode": mode,
        "cap": cap,
        "spent": spent,
        "overshoot": max(0, spent - cap),
        "finished": interrupted.count(False),
        "interrupted": interrupted.count(True),
        "seconds": elapsed,
    }


async def _migrate(url: str) -> None:
    store = SqlBudgetStore(url)
    await store.migrate()
    await store.close()


async def _spent(url: str) -> int:
    store = SqlBudgetStore(url)
    bucket = Bucket("user", "alice")
    totals = (await store.totals([bucket.key]))[bucket.key]
    await store.close()
    return totals.tokens_in + totals.tokens_out


# -- scratch databases -----------------------------------------------------------------------


def _pg(admin_dsn: str, sql: str) -> None:
    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(admin_dsn, timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())


def _scratch_dsn(admin_dsn: str, database: str) -> str:
    parts = urllib.parse.urlsplit(admin_dsn)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{database}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=13)
    parser.add_argument("--pg-dsn", default=PG_DSN)
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        targets = {"sqlite": f"sqlite:///{Path(tmp) / 'budget.db'}"}
        scratch = None
        if not args.skip_postgres:
            scratch = f"loom_bench_{str(ULID()).lower()}"
            _pg(args.pg_dsn, f'CREATE DATABASE "{scratch}"')
            targets["postgres"] = _scratch_dsn(args.pg_dsn, scratch)
        try:
            print(f"reserve + commit per model call ({args.calls} calls, sequential)")
            rows = [("memory", asyncio.run(latency(InMemoryBudgetStore(), args.calls)))]
            for name, url in targets.items():
                rows.append((name, asyncio.run(latency(SqlBudgetStore(url), args.calls))))
            for name, (median, p95) in rows:
                print(f"  {name:<9} median {median * 1e3:7.3f} ms   p95 {p95 * 1e3:7.3f} ms")
            print(
                f"\n{args.processes} processes x {args.runs} runs for one user, "
                f"{TOOL_TURNS + 1} calls of {sum(USAGE)} tokens each"
            )
            for name, url in targets.items():
                for mode in ("hard", "soft"):
                    if name == "sqlite":
                        url = f"sqlite:///{Path(tmp) / f'contention-{mode}.db'}"
                    elif scratch is not None:
                        db = f"{scratch}_{mode}"
                        _pg(args.pg_dsn, f'CREATE DATABASE "{db}"')
                        url = _scratch_dsn(args.pg_dsn, db)
                    try:
                        r = contention(url, mode, args.processes, args.runs)
                    finally:
                        if name == "postgres":
                            _pg(args.pg_dsn, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
                    print(
                        f"  {name:<9} {mode:<5} spent {r['spent']:>6} of cap {r['cap']:>6}  "
                        f"overshoot {r['overshoot']:>4}  finished {r['finished']:>3}  "
                        f"interrupted {r['interrupted']:>3}  {r['seconds']:.2f} s"
                    )
        finally:
            if scratch is not None:
                _pg(args.pg_dsn, f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, store_url, run_mode, cap_text, runs_text = sys.argv
        asyncio.run(worker(store_url, run_mode, int(cap_text), int(runs_text)))
    else:
        main()
