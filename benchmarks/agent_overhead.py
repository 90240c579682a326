"""What the agent loop costs per ReAct turn, with no journal and on each backend.

A turn is one model call that asks for one tool call, plus that tool call. The model is a
zero-latency scripted function and the tool returns at once, so the figures are loomflow's
own cost: building messages and schemas, fingerprinting, encoding, journaling, hooks.

For each backend it runs ``--runs`` runs of ``--turns`` turns (plus a final answer turn),
fresh, then resumes each finished run (every step replayed), and prints the median cost per
turn, beside the no-journal baseline measured in the same process run.

    python benchmarks/agent_overhead.py
    python benchmarks/agent_overhead.py --turns 20 --runs 30 --skip-postgres
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from ulid import ULID

from loomflow.agent import Agent
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime, JournalRuntime, PostgresRuntime, SqliteRuntime
from loomflow.tools import tool

# The server the test suite uses (tests/conftest.py), so a bare run needs no flags.
PG_DSN = os.environ.get("LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


@tool
def lookup(key: str, page: int) -> dict[str, Any]:
    """Look up a record."""
    return {"key": key, "page": page, "value": "x" * 120}


def script(turns: int) -> FunctionModel:
    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        done = sum(1 for m in messages if m.role == "tool")
        if done >= turns:
            return "finished"
        return [ToolCall(id=f"c{done}", name="lookup", arguments={"key": "k", "page": done})]

    return FunctionModel(decide)


async def per_turn(
    runtime: JournalRuntime | None, turns: int, runs: int
) -> tuple[float, float | None]:
    """Median seconds per turn for fresh runs and, with a journal, for full replays."""
    agent = Agent("bench", model=script(turns), tools=[lookup], runtime=runtime)
    fresh: list[float] = []
    replay: list[float] = []
    sessions = [f"bench-{ULID()}" for _ in range(runs)]
    await agent.run("warm up", session_id=f"warm-{ULID()}", user_id="u")
    for session in sessions:
        t0 = time.perf_counter()
        await agent.run("go", session_id=session, user_id="u")
        fresh.append((time.perf_counter() - t0) / (turns + 1))
    if runtime is not None:
        for session in sessions:
            t0 = time.perf_counter()
            result = await agent.resume("go", session_id=session, user_id="u")
            replay.append((time.perf_counter() - t0) / (turns + 1))
            assert result.fresh_steps == 0, "a replay ran something fresh"
    return statistics.median(fresh), statistics.median(replay) if replay else None


async def scratch_pg(admin_dsn: str) -> tuple[str, str] | None:
    import asyncpg

    name = f"loom_agent_bench_{str(ULID()).lower()}"
    try:
        conn = await asyncpg.connect(admin_dsn, timeout=5)
    except (OSError, asyncpg.PostgresError) as exc:
        print(f"postgres: skipped ({exc})")
        return None
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    parts = urllib.parse.urlsplit(admin_dsn)
    return name, urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


async def drop_pg(admin_dsn: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_dsn, timeout=5)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pg-dsn", default=PG_DSN)
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()

    rows: list[tuple[str, float, float | None]] = []
    base, _ = await per_turn(None, args.turns, args.runs)
    rows.append(("no journal", base, None))
    memory = InMemoryRuntime()
    rows.append(("memory", *await per_turn(memory, args.turns, args.runs)))
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = SqliteRuntime(Path(tmp) / "journal.db")
        try:
            rows.append(("sqlite", *await per_turn(sqlite, args.turns, args.runs)))
        finally:
            await sqlite.close()
    if not args.skip_postgres:
        scratch = await scratch_pg(args.pg_dsn)
        if scratch is not None:
            name, dsn = scratch
            pg = await PostgresRuntime.connect(dsn)
            try:
                rows.append(("postgres", *await per_turn(pg, args.turns, args.runs)))
            finally:
                await pg.close()
                await drop_pg(args.pg_dsn, name)

    print(
        f"agent loop cost per ReAct turn ({args.turns} tool turns + 1 answer, "
        f"median of {args.runs} runs; zero-latency scripted model)"
    )
    print(f"{'backend':<12} {'fresh us/turn':>14} {'vs no journal':>14} {'replay us/turn':>15}")
    print("-" * 58)
    for name, fresh, replay in rows:
        ratio = f"{fresh / base:.2f}x" if name != "no journal" else "1.00x"
        replay_text = f"{replay * 1e6:,.0f}" if replay is not None else "-"
        print(f"{name:<12} {fresh * 1e6:>14,.0f} {ratio:>14} {replay_text:>15}")


if __name__ == "__main__":
    asyncio.run(main())
