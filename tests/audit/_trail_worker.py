"""A worker for the audit execution test.

``python _trail_worker.py URL LEDGER first`` runs an agent whose refund tool records itself
in LEDGER, prints ``IN-TOOL`` and waits inside its body to be killed. ``... resume`` resumes
the session (the tool then runs to the end) and prints a JSON summary. The audit log lives in
the journal's database.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from loomflow.agent import Agent
from loomflow.audit import AuditLog, audit_store_beside
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import runtime_from_url


async def main(url: str, ledger: Path, mode: str) -> None:
    async def refund(order: str) -> str:
        """Refund an order."""
        with ledger.open("a") as fh:
            fh.write(f"{order}\n")
        if mode == "first":
            print("IN-TOOL", flush=True)
            await asyncio.Event().wait()
        return f"refunded {order}"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role != "tool":
            return [ToolCall(id="c1", name="refund", arguments={"order": "o-7"})]
        return f"done: {messages[-1].content}"

    runtime = runtime_from_url(url)
    audit = AuditLog(audit_store_beside(runtime.database))  # type: ignore[attr-defined]
    agent = Agent(
        "refunds", model=FunctionModel(decide), tools=[refund], runtime=runtime, audit=audit
    )
    try:
        if mode == "first":
            await agent.run("refund o-7", session_id="s", user_id="ana")
        else:
            result = await agent.resume("refund o-7", session_id="s", user_id="ana")
            print(json.dumps({"output": result.output}))
    finally:
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
