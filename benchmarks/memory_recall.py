"""What a run's recall costs on a session with a long past, against one with a short past.

Every run on a session starts by recalling the session's last ``history_episodes`` (20)
episodes. Its cost should follow those 20, not the session's length: a chat that has run
for a year must start its next run as fast as one that began today. Each backend gets two
sessions of one user, a short one (20 episodes) and a long one (``--episodes``, 20,000 by
default), bulk-loaded from one episode written through the store; then ``--rounds`` rounds
alternate timing the two recalls, and the median ratio long/short is held against the target.

Target: a recall on the long session <= 2x one on the short session.

    python benchmarks/memory_recall.py
    python benchmarks/memory_recall.py --episodes 100000 --skip-postgres
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

from ulid import ULID

from loomflow.memory import Memory, PostgresMemory, SqliteMemory
from loomflow.messages import Message

sys.path.insert(0, str(Path(__file__).parent))
from runtime_overhead import PG_DSN

TARGET = 2.0
SHORT = 20  # the default history_episodes: a session whose whole past is recalled


async def seed(memory: Memory, session: str) -> None:
    """One real episode, written through the store, for the bulk load to copy."""
    prompt = [Message(role="user", content="what is the status of order 1234?")]
    answer = Message(role="assistant", content="It shipped this morning. " * 8)
    await memory.record_episode(
        session,
        user_id="u",
        run_id="r0",
        epoch=0,
        key=f"{session}-0",
        messages=[*prompt, answer],
        output=answer.content,
    )


def copy_sqlite(path: Path, session: str, count: int) -> None:
    db = sqlite3.connect(path)
    try:
        cursor = db.execute("SELECT * FROM loom_memory_episodes WHERE session_id = ?", (session,))
        names = [d[0] for d in cursor.description]
        first = dict(zip(names, cursor.fetchone(), strict=True))
        rows = []
        for epoch in range(1, count):
            row = first | {"seq": None, "episode_id": str(ULID()), "epoch": epoch}
            row["episode_key"] = f"{session}-{epoch}"
            rows.append(tuple(row[n] for n in names))
        marks = ", ".join("?" * len(names))
        db.executemany(f"INSERT INTO loom_memory_episodes VALUES ({marks})", rows)
        db.commit()
    finally:
        db.close()


async def copy_postgres(dsn: str, session: str, count: int) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO loom_memory_episodes (episode_id, user_key, scope, session_id, user_id,"
            " episode_key, run_id, epoch, output, codec_version, messages, created_at,"
            " updated_at) SELECT 'bench-' || g || '-' || episode_key, user_key, scope,"
            " session_id, user_id, session_id || '-' || g, run_id, g, output, codec_version,"
            " messages, created_at, updated_at FROM loom_memory_episodes,"
            " generate_series(1, $2::int - 1) AS g WHERE session_id = $1",
            session,
            count,
        )
        await conn.execute("ANALYZE loom_memory_episodes")
    finally:
        await conn.close()


async def timed(memory: Memory, session: str, count: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        recalled = await memory.history(session, user_id="u", before_epoch=count)
        times.append(time.perf_counter() - t0)
        assert len(recalled) == 2 * SHORT, "a recall brings back the last 20 episodes"
    return statistics.median(times)


async def measure(memory: Memory, args: argparse.Namespace) -> tuple[float, float, list[float]]:
    short, long = [], []
    for _ in range(args.rounds):
        short.append(await timed(memory, "short", SHORT, args.repeat))
        long.append(await timed(memory, "long", args.episodes, args.repeat))
    ratios = [lo / sh for lo, sh in zip(long, short, strict=True)]
    return statistics.median(short), statistics.median(long), ratios


def report(backend: str, figures: tuple[float, float, list[float]], episodes: int) -> bool:
    short, long, ratios = figures
    ratio = statistics.median(ratios)
    ok = ratio <= TARGET
    spread = ", ".join(f"{r:.2f}" for r in ratios)
    print(
        f"{backend:<9} recall of {SHORT} episodes: {short * 1e3:.2f} ms on a session of {SHORT}, "
        f"{long * 1e3:.2f} ms on one of {episodes:,}; {ratio:.2f}x (rounds: {spread}) "
        f"<= {TARGET}x: {'ok' if ok else 'MISSED'}"
    )
    return ok


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=20, help="recalls timed per round")
    parser.add_argument("--pg-dsn", default=PG_DSN)
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.db"
        memory = SqliteMemory(path)
        try:
            for session, count in (("short", SHORT), ("long", args.episodes)):
                await seed(memory, session)
                copy_sqlite(path, session, count)
            verdicts.append(report("sqlite", await measure(memory, args), args.episodes))
        finally:
            await memory.close()
    if not args.skip_postgres:
        import asyncpg

        name = f"loom_recall_bench_{str(ULID()).lower()}"
        admin = await asyncpg.connect(args.pg_dsn, timeout=5)
        await admin.execute(f'CREATE DATABASE "{name}"')
        dsn = urllib.parse.urlunsplit(urllib.parse.urlsplit(args.pg_dsn)._replace(path=f"/{name}"))
        pg = PostgresMemory(dsn)
        try:
            for session, count in (("short", SHORT), ("long", args.episodes)):
                await seed(pg, session)
                await copy_postgres(dsn, session, count)
            verdicts.append(report("postgres", await measure(pg, args), args.episodes))
        finally:
            await pg.close()
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.close()
    print(f"all targets met: {'yes' if all(verdicts) else 'NO'}")


if __name__ == "__main__":
    asyncio.run(main())
