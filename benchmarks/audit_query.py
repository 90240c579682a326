"""How fast one user's audit query is when the log holds a million entries of other users.

Bulk-loads valid, hash-chained entries (PostgreSQL with ``COPY``, SQLite with one
``executemany`` transaction), then times the queries a compliance team runs for one user:
the first page, a page deep into the user's trail, an action family, and a time range.
The heads table is left to the database's head trigger (audit migration 2), which checks
each loaded entry extends its user's chain and moves the head, as in production.

    python benchmarks/audit_query.py --backend sqlite --rows 1000000
    python benchmarks/audit_query.py --backend postgres --dsn postgresql://postgres@127.0.0.1/db

Prints one JSON object per backend with the load time and the median and p95 latency of each
query. With ``--dsn`` pointing at the server's admin database, a scratch database is created
and dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from loomflow.audit import AuditEntry, AuditRecord, AuditStore, PostgresAuditStore, SqliteAuditStore
from loomflow.audit._entry import GENESIS, canonical_json, user_key

# The server the test suite uses (tests/conftest.py), so a bare run needs no flags.
PG_DSN = os.environ.get("LOOMFLOW_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")

TARGET = "target-user"
ACTIONS = ("run.start", "model.call", "tool.call", "tool.result", "run.end")


def rows(
    total: int, users: int, start_us: int, heads: dict[int, tuple[int, str]]
) -> Iterator[tuple[Any, ...]]:
    """``total`` chained entries spread over ``users`` users, in insertion order (the head
    trigger accepts each one as it arrives); ``heads`` tracks every user's last (seq, hash)."""
    for i in range(total):
        u = i % users
        seq, prev = heads.get(u, (0, GENESIS))
        name = f"user-{u:06d}"
        record = AuditRecord(
            user_id=name,
            session_id=f"s-{u}-{seq // 20}",
            run_id=f"r-{u}-{seq // 5}",
            actor="agent:bench",
            action=ACTIONS[seq % len(ACTIONS)],
            payload={"turn": seq % 5, "tool": "lookup", "ok": True},
        )
        entry = AuditEntry.seal(record, seq=seq + 1, time_us=start_us + i * 1000, prev_hash=prev)
        heads[u] = (seq + 1, entry.hash)
        yield (
            user_key(name),
            name,
            entry.seq,
            entry.time_us,
            entry.session_id,
            entry.run_id,
            entry.actor,
            entry.action,
            canonical_json(entry.payload),
            entry.schema_version,
            entry.prev_hash,
            entry.hash,
            entry.hash_version,
            entry.payload_digest,
            entry.payload_salt,
        )


COLUMNS = (
    "user_key",
    "user_id",
    "seq",
    "time_us",
    "session_id",
    "run_id",
    "actor",
    "action",
    "payload",
    "schema_version",
    "prev_hash",
    "hash",
    "hash_version",
    "payload_digest",
    "payload_salt",
)


async def load_sqlite(store: SqliteAuditStore, path: Path, total: int, users: int) -> None:
    await store.open()  # creates the schema
    start_us = time.time_ns() // 1000 - total * 1000
    heads: dict[int, tuple[int, str]] = {}
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA synchronous = OFF")
        marks = ", ".join("?" * len(COLUMNS))
        conn.executemany(
            f"INSERT INTO loom_audit ({', '.join(COLUMNS)}) VALUES ({marks})",
            rows(total, users, start_us, heads),
        )
        conn.execute("ANALYZE")


async def load_postgres(store: PostgresAuditStore, total: int, users: int) -> None:
    await store.open()
    start_us = time.time_ns() // 1000 - total * 1000
    heads: dict[int, tuple[int, str]] = {}
    pool = store.db.pool  # type: ignore[attr-defined]
    batch: list[tuple[Any, ...]] = []
    async with pool.acquire() as conn:
        for row in rows(total, users, start_us, heads):
            batch.append(row)
            if len(batch) == 100_000:
                await conn.copy_records_to_table("loom_audit", records=batch, columns=COLUMNS)
                batch = []
        if batch:
            await conn.copy_records_to_table("loom_audit", records=batch, columns=COLUMNS)
        await conn.execute("ANALYZE loom_audit")


async def timed(fn: Callable[[], Awaitable[Any]], repeat: int) -> dict[str, float]:
    await fn()  # warm the cache: we measure the index, not the first disk read
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    return {
        "median_ms": round(statistics.median(samples), 3),
        "p95_ms": round(samples[int(len(samples) * 0.95) - 1], 3),
    }


async def measure(store: AuditStore, repeat: int) -> dict[str, Any]:
    # The target user's own trail: 500 entries written through the store (real appends).
    for i in range(50):
        await store.append(
            [
                AuditRecord(
                    user_id=TARGET,
                    session_id=f"t-{i // 10}",
                    run_id=f"tr-{i}",
                    actor="agent:bench",
                    action=ACTIONS[j % len(ACTIONS)],
                    payload={"i": i, "j": j},
                )
                for j in range(10)
            ]
        )
    first = await store.query(user_id=TARGET, limit=100)
    assert len(first.entries) == 100
    assert all(e.user_id == TARGET for e in first.entries)
    deep = await store.query(user_id=TARGET, limit=100, cursor=first.next_cursor)
    middle = first.entries[50].time

    async def console_users_page() -> None:  # what the console's users page reads
        heads = store.iter_heads()
        await anext(heads)  # the first page of heads
        await heads.aclose()

    results = {
        "first_page_100": await timed(lambda: store.query(user_id=TARGET, limit=100), repeat),
        "second_page_100": await timed(
            lambda: store.query(user_id=TARGET, limit=100, cursor=first.next_cursor), repeat
        ),
        "action_family": await timed(
            lambda: store.query(user_id=TARGET, action="tool.*", limit=100), repeat
        ),
        "time_range": await timed(
            lambda: store.query(user_id=TARGET, since=middle, limit=100), repeat
        ),
        "one_user_verify_500": await timed(lambda: store.verify(user_id=TARGET), 5),
        # The console's users page reads a page of heads (1,000) where it read every head.
        "users_page_heads": await timed(console_users_page, repeat),
        "all_heads": await timed(store.heads, 5),
    }
    assert len(deep.entries) == 100
    return results


async def run(backend: str, total: int, users: int, dsn: str | None, repeat: int) -> None:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "audit.db"
            sqlite_store = SqliteAuditStore(path)
            t0 = time.perf_counter()
            await load_sqlite(sqlite_store, path, total, users)
            load_s = time.perf_counter() - t0
            result = await measure(sqlite_store, repeat)
            await sqlite_store.close()
    else:
        import asyncpg

        assert dsn is not None, "--dsn is required for postgres"
        scratch = f"loom_audit_bench_{int(time.time())}"
        admin = await asyncpg.connect(dsn)
        await admin.execute(f'CREATE DATABASE "{scratch}"')
        try:
            pg_store = PostgresAuditStore(dsn.rsplit("/", 1)[0] + "/" + scratch)
            t0 = time.perf_counter()
            await load_postgres(pg_store, total, users)
            load_s = time.perf_counter() - t0
            result = await measure(pg_store, repeat)
            await pg_store.close()
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')
            await admin.close()
    print(
        json.dumps(
            {
                "backend": backend,
                "other_users_entries": total,
                "other_users": users,
                "target_entries": 500,
                "load_s": round(load_s, 1),
                "queries": result,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="sqlite")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--dsn", default=PG_DSN)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    for backend in ("sqlite", "postgres") if args.backend == "both" else (args.backend,):
        asyncio.run(run(backend, args.rows, args.users, args.dsn, args.repeat))


if __name__ == "__main__":
    main()
