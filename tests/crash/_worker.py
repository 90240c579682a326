"""A journaled worker process, driven by the crash and two-process tests.

It opens a SQLite or PostgreSQL runtime, runs ``--steps`` journaled steps of one run on
(``--session``, ``--user``) and reports to its parent as JSON lines on stdout. Where the parent
must act at an exact point (kill, stop, let two workers race) the worker prints an event and
then blocks until the parent writes a line on its stdin: a handshake, never a sleep.

Every step body, and the run's open/close, appends a line to ``--log`` with this process id
and a wall-clock time, so the parent can count side effects and check ordering.

Exit codes: 0 the run finished, 3 it lost its turn (``OwnershipLostError``), 4 the parent
closed stdin while the worker waited for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Any

from loomflow.errors import OwnershipLostError
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime

PID = os.getpid()


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "pid": PID, "t": time.time(), **fields}), flush=True)


def mark(log_path: str, what: str, **fields: Any) -> None:
    line = json.dumps({"pid": PID, "what": what, "t": time.time(), **fields}) + "\n"
    # O_APPEND with one write() per line: lines from concurrent processes never mix.
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


async def wait_for_parent() -> None:
    line = await asyncio.to_thread(sys.stdin.readline)
    if not line:  # the parent is gone: do not linger as an orphan
        raise SystemExit(4)


async def open_runtime(args: argparse.Namespace) -> JournalRuntime:
    options: dict[str, Any] = {"lease_seconds": args.lease, "turn_timeout": args.turn_timeout}
    if args.backend == "sqlite":
        runtime: JournalRuntime = SqliteRuntime(args.target, **options)
        await runtime.migrate()  # connect and migrate now, before any handshake
        return runtime
    return await PostgresRuntime.connect(args.target, **options)


async def main(args: argparse.Namespace) -> int:
    runtime = await open_runtime(args)
    try:
        if args.wait_go:
            emit("ready")
            await wait_for_parent()

        async def body(i: int) -> dict[str, Any]:
            mark(args.log, "begin", step=i)
            if i == args.pause_inside:
                emit("inside", step=i)
                await wait_for_parent()
            if args.gap:
                await asyncio.sleep(args.gap)
            mark(args.log, "end", step=i)
            return {"step": i, "by": args.tag, "pid": PID}

        mark(args.log, "want")
        asked = time.monotonic()
        async with runtime.session(args.session, args.user) as run:
            claim_s = time.monotonic() - asked
            mark(args.log, "open", epoch=run.epoch)
            for i in range(1, args.steps + 1):
                # Only the step number is an input, so every worker's step i has one key.
                await runtime.step(f"step-{i}", body, i)
                if i == args.pause_after:
                    emit("paused", step=i)
                    await wait_for_parent()
                if args.gap:
                    await asyncio.sleep(args.gap)
            mark(args.log, "close", epoch=run.epoch)
        emit(
            "done",
            epoch=run.epoch,
            claim_s=claim_s,
            hits=run.stats.hit_steps,
            fresh=run.stats.fresh_steps,
        )
        return 0
    except OwnershipLostError as exc:
        emit("lost", error=str(exc))
        return 3
    finally:
        await runtime.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", choices=("sqlite", "postgres"), required=True)
    p.add_argument("--target", required=True, help="SQLite file path or PostgreSQL DSN")
    p.add_argument("--log", required=True, help="file that step bodies append to")
    p.add_argument("--session", default="session-1")
    p.add_argument("--user", default="user-1")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tag", default="", help="put into every step result")
    p.add_argument("--lease", type=float, default=30.0, help="lease_seconds")
    p.add_argument("--turn-timeout", type=float, default=10.0)
    p.add_argument("--pause-after", type=int, default=0, help="block after this step")
    p.add_argument("--pause-inside", type=int, default=0, help="block inside this step's body")
    p.add_argument("--wait-go", action="store_true", help="block before opening the run")
    p.add_argument("--gap", type=float, default=0.0, help="seconds awaited in and between steps")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(asyncio.run(main(parse())))
