"""The demo's worker: an order-fulfilment task whose steps have side effects.

Run as ``python -m loomflow.cli._demo_task URL LEDGER SESSION USER [--stop-after K]``. Every step
body appends one line to the ledger file, which is how the demo proves that no side effect ran
twice. With ``--stop-after K`` the worker announces ``STEP-DONE K`` on stdout after the K-th step
and then waits to be killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..runtime import JournalRun, JournalRuntime, runtime_from_url

ORDER = {"order_id": "A-1042", "sku": "LOOM-7", "quantity": 2, "amount_usd": 59.80}


def _side_effect(ledger: Path, action: str, **details: Any) -> dict[str, Any]:
    record = {"action": action, "pid": os.getpid(), "at": round(time.time(), 3), **details}
    with ledger.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return record


def steps(ledger: Path) -> list[tuple[str, Callable[..., Awaitable[Any]], dict[str, Any]]]:
    """The task: (step name, body, inputs). Bodies are async; each writes to the ledger."""

    async def lookup_order(order_id: str) -> dict[str, Any]:
        _side_effect(ledger, "lookup_order", order_id=order_id)
        return dict(ORDER)

    async def reserve_stock(sku: str, quantity: int) -> dict[str, Any]:
        _side_effect(ledger, "reserve_stock", sku=sku, quantity=quantity)
        return {"reservation": f"R-{sku}-{quantity}"}

    async def charge_card(order_id: str, amount_usd: float) -> dict[str, Any]:
        _side_effect(ledger, "charge_card", order_id=order_id, amount_usd=amount_usd)
        return {"charge": f"CH-{order_id}", "amount_usd": amount_usd}

    async def create_shipment(order_id: str) -> dict[str, Any]:
        _side_effect(ledger, "create_shipment", order_id=order_id)
        return {"tracking": f"TRK-{order_id}"}

    async def send_confirmation(order_id: str) -> dict[str, Any]:
        _side_effect(ledger, "send_confirmation", order_id=order_id)
        return {"email": "sent"}

    async def close_ticket(order_id: str) -> dict[str, Any]:
        _side_effect(ledger, "close_ticket", order_id=order_id)
        return {"ticket": "closed"}

    oid = ORDER["order_id"]
    return [
        ("lookup_order", lookup_order, {"order_id": oid}),
        ("reserve_stock", reserve_stock, {"sku": ORDER["sku"], "quantity": ORDER["quantity"]}),
        ("charge_card", charge_card, {"order_id": oid, "amount_usd": ORDER["amount_usd"]}),
        ("create_shipment", create_shipment, {"order_id": oid}),
        ("send_confirmation", send_confirmation, {"order_id": oid}),
        ("close_ticket", close_ticket, {"order_id": oid}),
    ]


async def run_task(
    runtime: JournalRuntime,
    ledger: Path,
    session_id: str,
    user_id: str,
    *,
    stop_after: int | None = None,
    resume: bool = False,
) -> JournalRun:
    """Run the whole task as one journaled run; return the run (its stats say what replayed)."""
    async with runtime.session(session_id, user_id, resume=resume) as run:
        for index, (name, body, inputs) in enumerate(steps(ledger), start=1):
            await runtime.step(name, body, **inputs)
            if stop_after == index:
                print(f"STEP-DONE {index}", flush=True)
                await asyncio.Event().wait()  # the parent kills us here
    return run


async def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="loomflow-demo-worker")
    parser.add_argument("url")
    parser.add_argument("ledger", type=Path)
    parser.add_argument("session")
    parser.add_argument("user")
    parser.add_argument("--stop-after", type=int)
    args = parser.parse_args(argv)
    runtime = runtime_from_url(args.url)
    try:
        await run_task(runtime, args.ledger, args.session, args.user, stop_after=args.stop_after)
    finally:
        await runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1:])))
