"""How long ``journal prune`` takes, in batches and as one statement, with rows it must keep.

Loads sessions of 1,000 entries each: most belong to open runs (kept), the rest to finished
runs (deleted), spread evenly through the key order as in a live journal. Then prunes once as
a single statement (``batch_size`` larger than the table) and, on a fresh copy of the same
data, in batches, and reports the total time of each and the longest batch — how long writers
can wait behind the prune.

    python benchmarks/journal_prune.py --backend sqlite --keep 500000 --delete 100000
    python benchmarks/journal_prune.py --backend postgres --dsn postgresql://postgres@127.0.0.1/postgres

Prints one JSON object per backend.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime

# The server the test suite uses (tests/conftest.py), so a bare run needs no flags.
PG_DSN = os.environ.get("LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

PER_SESSION = 1000


def sessions(keep: int, delete: int) -> list[tuple[str, int]]:
    """(scope, open) per session: one finished session after every ``keep/delete`` open ones."""
    total = (keep + delete) // PER_SESSION
    every = max(1, round((keep + delete) / max(delete, 1)))
    return [(f"s{i:07d}", 0 if i % every == every - 1 else 1) for i in range(total)]


def entries(scopes: list[tuple[str, int]], now: float) -> Iterator[tuple[Any, ...]]:
    for scope, _ in scopes:
        for n in range(PER_SESSION):
            yield (scope, 0, "", f"step_{n}", "f" * 16, "step", "json", 1, b"{}", 2, n, now - 60)


async def load(runtime: JournalRuntime, scopes: list[tuple[str, int]]) -> None:
    await runtime.migrate()
    now = time.time()
    session_rows = [(s, s, "bench", 0, o, now) for s, o in scopes]
    if isinstance(runtime, PostgresRuntime):
        pool = runtime.database.pool  # type: ignore[attr-defined]
        async with pool.acquire() as conn:
            await conn.copy_records_to_table(
                "loom_sessions",
                records=session_rows,
                columns=["scope", "session_id", "user_id", "epoch", "open", "updated_at"],
            )
            await conn.copy_records_to_table("loom_entries", records=list(entries(scopes, now)))
            await conn.execute("ANALYZE")
        return
    path = runtime.path  # type: ignore[attr-defined]
    await runtime.close()
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO loom_sessions (scope, session_id, user_id, epoch, open, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            session_rows,
        )
        conn.executemany(
            "INSERT INTO loom_entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            entries(scopes, now),
        )
        conn.execute("ANALYZE")


async def prune(runtime: JournalRuntime, batch_size: int) -> dict[str, float]:
    marks: list[float] = []

    def tick(done: int, total: int | None) -> None:
        marks.append(time.perf_counter())

    start = time.perf_counter()
    deleted = await runtime.prune(batch_size=batch_size, on_progress=tick)
    elapsed = time.perf_counter() - start
    # The first mark follows the up-front count; the gaps after it are the batches.
    gaps = [b - a for a, b in itertools.pairwise(marks[1:])] or [elapsed]
    return {"deleted": deleted, "seconds": round(elapsed, 3), "longest_batch_s": max(gaps)}


async def run_sqlite(args: argparse.Namespace, scopes: list[tuple[str, int]]) -> dict[str, Any]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, batch in (("single", 10**9), ("batched", args.batch)):
            path = Path(tmp) / f"{label}.db"
            await load(SqliteRuntime(path), scopes)
            runtime = SqliteRuntime(path)
            try:
                results[label] = await prune(runtime, batch)
            finally:
                await runtime.close()
    return results


async def run_postgres(args: argparse.Namespace, scopes: list[tuple[str, int]]) -> dict[str, Any]:
    import asyncpg

    admin = await asyncpg.connect(args.dsn)
    results = {}
    try:
        for label, batch in (("single", 10**9), ("batched", args.batch)):
            name = f"loom_bench_prune_{label}"
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
            dsn = args.dsn.rsplit("/", 1)[0] + f"/{name}"
            runtime = await PostgresRuntime.connect(dsn)
            try:
                await load(runtime, scopes)
                results[label] = await prune(runtime, batch)
            finally:
                await runtime.close()
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--dsn", default=PG_DSN)
    parser.add_argument("--keep", type=int, default=500_000)
    parser.add_argument("--delete", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=5000)
    args = parser.parse_args()
    scopes = sessions(args.keep, args.delete)
    run = run_sqlite if args.backend == "sqlite" else run_postgres
    results = asyncio.run(run(args, scopes))
    single, batched = results["single"], results["batched"]
    print(
        json.dumps(
            {
                "backend": args.backend,
                "kept": sum(PER_SESSION for _, o in scopes if o),
                "deleted": batched["deleted"],
                "single_statement_s": single["seconds"],
                "batched_s": batched["seconds"],
                "batched_over_single": round(batched["seconds"] / single["seconds"], 2),
                "longest_batch_s": round(batched["longest_batch_s"], 3),
                "batch_size": args.batch,
            }
        )
    )


if __name__ == "__main__":
    main()
