"""The demo's worker: an order-fulfilment agent whose tools have side effects.

Run as ``python -m loomflow.cli._demo_task URL LEDGER SESSION USER [--stop-after K]``. The model
is scripted (offline, deterministic). Every tool appends one line to the ledger file, which is
how the demo proves that no side effect ran twice. With ``--stop-after K`` the worker prints
``STEP-DONE K`` once the K-th model turn's tool results are journaled, then waits to be killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..agent import Agent, RunResult
from ..audit import AuditLog, SqliteAuditStore
from ..governance import Cap, SqlBudgetStore, StandardBudget
from ..messages import Message, ToolCall, ToolSpec
from ..models import FunctionModel
from ..runtime import JournalRuntime, StepEvent, runtime_from_url
from ..tools import Tool, tool

ORDER = {"order_id": "A-1042", "sku": "LOOM-7", "quantity": 2, "amount_usd": 59.80}
PROMPT = "Fulfil order A-1042 for the customer and confirm by email."
INSTRUCTIONS = "You fulfil customer orders with the tools you have, one careful step at a time."

# The scripted model's plan: the tool calls of each turn, then a final answer.
PLAN: list[list[tuple[str, dict[str, Any]]]] = [
    [("lookup_order", {"order_id": "A-1042"})],
    [
        ("reserve_stock", {"sku": "LOOM-7", "quantity": 2}),
        ("charge_card", {"order_id": "A-1042", "amount_usd": 59.80}),
    ],
    [("create_shipment", {"order_id": "A-1042"})],
    [("send_confirmation", {"order_id": "A-1042"})],
]
FINAL = "Order A-1042 is reserved, paid ($59.80), shipped (TRK-A-1042) and confirmed."
TOOL_NAMES = [name for turn in PLAN for name, _ in turn]


def _side_effect(ledger: Path, action: str, **details: Any) -> None:
    record = {"action": action, "pid": os.getpid(), "at": round(time.time(), 3), **details}
    with ledger.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def tools(ledger: Path) -> list[Tool[..., Any]]:
    """The agent's tools; each writes one ledger line per execution."""

    @tool
    async def lookup_order(order_id: str) -> dict[str, Any]:
        """Fetch an order."""
        _side_effect(ledger, "lookup_order", order_id=order_id)
        return dict(ORDER)

    @tool
    async def reserve_stock(sku: str, quantity: int) -> str:
        """Reserve stock for an order line."""
        _side_effect(ledger, "reserve_stock", sku=sku, quantity=quantity)
        return f"reserved R-{sku}-{quantity}"

    @tool(destructive=True)
    async def charge_card(order_id: str, amount_usd: float) -> str:
        """Charge the customer's card."""
        _side_effect(ledger, "charge_card", order_id=order_id, amount_usd=amount_usd)
        return f"charged ${amount_usd:.2f} as CH-{order_id}"

    @tool
    async def create_shipment(order_id: str) -> str:
        """Book the shipment."""
        _side_effect(ledger, "create_shipment", order_id=order_id)
        return f"shipment TRK-{order_id} booked"

    @tool
    async def send_confirmation(order_id: str) -> str:
        """Email the customer."""
        _side_effect(ledger, "send_confirmation", order_id=order_id)
        return "confirmation sent"

    return [lookup_order, reserve_stock, charge_card, create_shipment, send_confirmation]


def model(stop_after: int | None) -> FunctionModel:
    """The scripted model; with ``stop_after`` it hangs when asked for that turn."""

    async def decide(messages: list[Message], specs: list[ToolSpec]) -> Any:
        turn = sum(1 for m in messages if m.role == "assistant")
        if stop_after is not None and turn == stop_after:
            print(f"STEP-DONE {stop_after}", flush=True)  # turn k's results are journaled
            await asyncio.Event().wait()  # the parent kills us here
        if turn < len(PLAN):
            return [
                ToolCall(id=f"call_{turn}_{i}", name=name, arguments=args)
                for i, (name, args) in enumerate(PLAN[turn])
            ]
        return FINAL

    return FunctionModel(decide, name="scripted-order-bot")


TOKEN_CAP = 20_000


def governance(runtime: JournalRuntime) -> tuple[AuditLog, StandardBudget]:
    """The audit log and budget of the demo, kept in the journal's own database."""
    db = getattr(runtime, "database")  # noqa: B009 - SQL runtimes only
    if db.backend == "sqlite":
        store: Any = SqliteAuditStore(db)
    else:
        from ..audit import PostgresAuditStore

        store = PostgresAuditStore(db)
    budget = StandardBudget([Cap("tokens_total", TOKEN_CAP)], store=SqlBudgetStore(db))
    return AuditLog(store), budget


async def run_task(
    runtime: JournalRuntime,
    ledger: Path,
    session_id: str,
    user_id: str,
    *,
    stop_after: int | None = None,
    resume: bool = False,
    steps: list[StepEvent] | None = None,
) -> RunResult:
    """Run (or resume) the order agent as one journaled run; collect step events if asked."""
    if steps is not None:
        runtime.add_observer(steps.append)
    audit, budget = governance(runtime)
    agent = Agent(
        INSTRUCTIONS,
        model=model(stop_after),
        tools=tools(ledger),
        runtime=runtime,
        audit=audit,
        budget=budget,
        name="order-bot",
    )
    if resume:
        return await agent.resume(PROMPT, session_id=session_id, user_id=user_id)
    return await agent.run(PROMPT, session_id=session_id, user_id=user_id)


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
