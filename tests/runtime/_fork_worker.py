"""A process that builds a runtime and a budget, connects them, then forks (for test_leases.py).

Like a server that preloads its application: the objects are made and used in the parent,
and the forked child runs a journaled run with them. The child reserves once on the budget,
opens a run on (``--session``, ``--user``), runs step 1, prints ``holding`` and waits for a
line on stdin before running step 2 and closing the run.

``--cold``: build the objects but do not connect them before the fork.
``--parent exit``: the parent exits right after the fork (the child lives on).
``--parent wait``: the parent reaps the child (``reaped``), then waits for stdin to close.

Events are JSON lines on stdout, each with the writing process's pid; step bodies append
``{"pid", "step"}`` lines to ``--log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from loomflow.governance.budget import Cap, SqlBudgetStore, StandardBudget
from loomflow.runtime import JournalRuntime, PostgresRuntime, SqliteRuntime


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


def mark(log: str, step: int) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps({"pid": os.getpid(), "step": step}) + "\n").encode())
    finally:
        os.close(fd)


async def warm_up(runtime: JournalRuntime, budget: StandardBudget) -> None:
    """Connect and use both in the parent, so the child inherits live connections."""
    async with runtime.session("warm-up", "parent"):
        await runtime.step("warm", lambda: 1)
    ticket = await budget.reserve(user_id="parent", model="scripted", max_tokens=1, input_tokens=1)
    await budget.release(ticket)


async def child(runtime: JournalRuntime, budget: StandardBudget, args: argparse.Namespace) -> None:
    ticket = await budget.reserve(user_id=args.user, model="scripted", max_tokens=1, input_tokens=1)
    emit("reserved", owner=ticket.reservation.owner)
    await budget.release(ticket)

    def body(i: int) -> int:
        mark(args.log, i)
        return i

    async with runtime.session(args.session, args.user):
        await runtime.step("step-1", body, 1)
        emit("holding")
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            raise SystemExit(4)
        await runtime.step("step-2", body, 2)
    emit("done")
    await budget.close()
    await runtime.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("sqlite", "postgres"), required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--user", required=True)
    p.add_argument("--lease", type=float, default=30.0)
    p.add_argument("--parent", choices=("exit", "wait"), required=True)
    p.add_argument("--cold", action="store_true", help="build but do not connect before forking")
    args = p.parse_args()

    options: dict[str, Any] = {"lease_seconds": args.lease, "turn_timeout": 10.0}
    runtime: JournalRuntime
    if args.backend == "sqlite":
        runtime = SqliteRuntime(args.target, **options)
    else:
        runtime = PostgresRuntime(args.target, **options)
    budget = StandardBudget(
        [Cap("tokens_total", 10**9)], store=SqlBudgetStore(runtime.database), lease_s=args.lease
    )
    if not args.cold:
        asyncio.run(warm_up(runtime, budget))

    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            asyncio.run(child(runtime, budget, args))
        except SystemExit as exc:
            code = int(exc.code or 0)
        except BaseException as exc:
            emit("failed", error=f"{type(exc).__name__}: {exc}")
            code = 1
        os._exit(code)  # never run the parent's exit handlers in the child
    emit("forked", child=pid)
    if args.parent == "exit":
        os._exit(0)
    os.waitpid(pid, 0)
    emit("reaped", child=pid)
    sys.stdin.read()


if __name__ == "__main__":
    main()
