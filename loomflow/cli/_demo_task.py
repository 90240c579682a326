"""The demo's worker: an order-fulfilment agent whose tools have side effects.

Run as ``python -m loomflow.cli._demo_task URL LEDGER SESSION USER [--stop-after K] [--model M]``.
The model is scripted (offline, deterministic) unless ``--model`` names a provider's model. Every
tool appends one line to the ledger file, which is how the demo proves that no side effect ran
twice. With ``--stop-after K`` the worker prints ``STEP-DONE K`` when the model is asked for turn
K (so turns 0..K-1 and their tool results are journaled) and waits there to be killed. A worker
whose model finished before turn K prints ``RUN-DONE`` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..agent import Agent, RunResult
from ..audit import AuditLog, audit_store_beside
from ..errors import LoomflowError, UserError
from ..governance import Cap, SqlBudgetStore, StandardBudget
from ..messages import Message, ModelChunk, ModelSettings, ToolCall, ToolSpec
from ..models import Model, ScriptedModel, ScriptTurn
from ..models._resolve import SCRIPTED_SPECS, provider_model
from ..models.pricing import ModelPrice, price_for
from ..runtime import JournalRuntime, StepEvent, runtime_from_url
from ..tools import Tool, tool

ORDER = {"order_id": "A-1042", "sku": "LOOM-7", "quantity": 2, "amount_usd": 59.80}
PROMPT = "Fulfil order A-1042 for the customer and confirm by email."
INSTRUCTIONS = (
    "You fulfil customer orders with the tools you have. For an order: look it up, reserve its "
    "stock, charge the card for the order amount, book the shipment, then email the "
    "confirmation. Call each tool once, wait for its result before the next step, and finish "
    "with a one-line summary."
)

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


def _side_effect(ledger: Path, action: str, **args: Any) -> None:
    record = {"action": action, "args": args, "pid": os.getpid(), "at": round(time.time(), 3)}
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


def scripted_model() -> ScriptedModel:
    """The offline model: follows :data:`PLAN`, then answers :data:`FINAL`.

    A :class:`ScriptedModel` answers by the conversation it is sent, so the resuming process
    picks the plan up at the turn the killed worker had reached.
    """
    turns: list[ScriptTurn] = [
        [
            ToolCall(id=f"call_{turn}_{slot}", name=name, arguments=args)
            for slot, (name, args) in enumerate(calls)
        ]
        for turn, calls in enumerate(PLAN)
    ]
    return ScriptedModel([*turns, FINAL], name="scripted-order-bot")


class KillPoint:
    """Wraps the demo's model so the worker stops at a known place, whatever the model.

    When asked for turn ``stop_after`` it prints the handshake and waits to be killed: every
    earlier turn and its tool results are journaled, and nothing of this turn has run. (The
    budget has already reserved this call, as it would for a call in flight at a crash.)
    """

    def __init__(self, inner: Model, stop_after: int | None) -> None:
        self.inner = inner
        self.stop_after = stop_after

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def provider(self) -> str:
        return self.inner.provider

    async def stream(
        self, messages: list[Message], *, tools: list[ToolSpec], settings: ModelSettings
    ) -> AsyncIterator[ModelChunk]:
        turn = sum(1 for m in messages if m.role == "assistant")
        if turn == self.stop_after:
            print(f"STEP-DONE {turn}", flush=True)
            await asyncio.Event().wait()  # the parent kills us here
        async for chunk in self.inner.stream(messages, tools=tools, settings=settings):
            yield chunk


def build_model(spec: str | None) -> Model:
    """The scripted model, or the provider model ``spec`` names (``anthropic:…``, ``gpt-…``).

    Raises:
        UserError: ``spec`` names no provider model.
        ConfigurationError: the provider's SDK or API key is missing.
    """
    if spec is None:
        return scripted_model()
    if not spec.strip():
        raise UserError(
            "--model needs a model id, e.g. anthropic:claude-sonnet-4-5 or openai:gpt-5-mini"
        )
    if spec.strip().lower() in SCRIPTED_SPECS:
        raise UserError(
            f"--model {spec!r} is a scripted model; the demo's scripted model is the default, "
            "--model names a provider's model such as 'anthropic:claude-sonnet-4-5'"
        )
    return provider_model(spec)  # its errors offer only the forms --model takes


TOKEN_CAP = 50_000


def governance(
    runtime: JournalRuntime, model: Model | None = None
) -> tuple[AuditLog, StandardBudget]:
    """The audit log and budget of the demo, kept in the journal's own database.

    A provider model missing from the price table is charged $0 here (tokens are still capped),
    so the demo runs with any model id.
    """
    db = getattr(runtime, "database")  # noqa: B009 - SQL runtimes only
    prices = {}
    if model is not None and price_for(model.name, provider=model.provider) is None:
        prices[model.name] = ModelPrice(0.0, 0.0)
    budget = StandardBudget(
        [Cap("tokens_total", TOKEN_CAP)], store=SqlBudgetStore(db), prices=prices
    )
    return AuditLog(audit_store_beside(db)), budget


async def run_task(
    runtime: JournalRuntime,
    ledger: Path,
    session_id: str,
    user_id: str,
    *,
    model: Model,
    stop_after: int | None = None,
    resume: bool = False,
    steps: list[StepEvent] | None = None,
) -> RunResult:
    """Run (or resume) the order agent as one journaled run; collect step events if asked."""
    if steps is not None:
        runtime.add_observer(steps.append)
    audit, budget = governance(runtime, model)
    agent = Agent(
        INSTRUCTIONS,
        model=KillPoint(model, stop_after),
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
    parser.add_argument("--model")
    args = parser.parse_args(argv)
    try:
        model = build_model(args.model)
        runtime = runtime_from_url(args.url)
        try:
            await run_task(
                runtime,
                args.ledger,
                args.session,
                args.user,
                model=model,
                stop_after=args.stop_after,
            )
        finally:
            await runtime.close()
            await close_model(model)
    except (LoomflowError, ImportError) as exc:
        print(f"loomflow demo worker: error: {exc}", file=sys.stderr)
        return 1
    print("RUN-DONE", flush=True)
    return 0


async def close_model(model: Model) -> None:
    """Close a provider model's HTTP client (the scripted model has none)."""
    aclose = getattr(model, "aclose", None)
    if aclose is not None:
        await aclose()


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(_main(sys.argv[1:])))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole demo: the parent says what happened
        sys.exit(130)
