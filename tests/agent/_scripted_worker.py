"""A worker process for the ScriptedModel crash test.

``python _scripted_worker.py JOURNAL LEDGER first`` runs an order agent driven by a
:class:`~loomflow.models.ScriptedModel`; its third tool (``ship``) prints ``SHIPPING`` and waits
to be killed before doing anything. ``... resume`` resumes the run with a fresh ScriptedModel of
the same script and prints a JSON summary. Every tool appends one line to the ledger when it
runs, which is how the test counts executions.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from loomflow.agent import Agent
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import tool

PROMPT = "Fulfil order 7."
SCRIPT = [
    [ToolCall(id="c0", name="reserve", arguments={"sku": "LOOM-7"})],
    [
        ToolCall(id="c1", name="charge", arguments={"amount": 59}),
        ToolCall(id="c2", name="email", arguments={"to": "alice@example.com"}),
    ],
    [ToolCall(id="c3", name="ship", arguments={"order": 7})],
    "Order 7 is reserved, charged, confirmed and shipped.",
]


async def main(journal: Path, ledger: Path, mode: str) -> None:
    def record(line: str) -> str:
        with ledger.open("a") as fh:
            fh.write(line + "\n")
        return line

    @tool
    def reserve(sku: str) -> str:
        """Reserve stock."""
        return record(f"reserve {sku}")

    @tool
    def charge(amount: int) -> str:
        """Charge the card."""
        return record(f"charge {amount}")

    @tool
    def email(to: str) -> str:
        """Email the customer."""
        return record(f"email {to}")

    @tool
    async def ship(order: int) -> str:
        """Book the shipment."""
        if mode == "first":
            print("SHIPPING", flush=True)
            await asyncio.Event().wait()  # killed here: this call is never journaled
        return record(f"ship {order}")

    model = ScriptedModel(SCRIPT)
    runtime = SqliteRuntime(journal)
    agent = Agent("orders", model=model, tools=[reserve, charge, email, ship], runtime=runtime)
    try:
        if mode == "first":
            await agent.run(PROMPT, session_id="order-7", user_id="alice")
        else:
            result = await agent.resume(PROMPT, session_id="order-7", user_id="alice")
            print(
                json.dumps(
                    {
                        "model_calls": model.calls,
                        "output": result.output,
                        "turns": result.turns,
                        "replayed": result.replayed_steps,
                        "run_id": result.run_id,
                    }
                )
            )
    finally:
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
