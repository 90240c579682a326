"""A worker process for the agent crash test.

``python _agent_worker.py URL LEDGER first`` runs an agent whose first turn charges a card;
when the model is asked for its second turn it prints ``TOOL-DONE`` and waits to be killed.
``... resume`` resumes the same session and prints a JSON summary.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from loomflow.agent import Agent
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import runtime_from_url
from loomflow.tools import tool


async def main(url: str, ledger: Path, mode: str) -> None:
    @tool
    def charge(amount: int) -> str:
        """Charge the card."""
        with ledger.open("a") as fh:
            fh.write(f"charge {amount}\n")
        return f"charged ${amount}"

    async def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role != "tool":
            return [ToolCall(id="first-call-id", name="charge", arguments={"amount": 7})]
        if mode == "first":
            print("TOOL-DONE", flush=True)
            await asyncio.Event().wait()
        return f"done: {messages[-1].content}"

    model = FunctionModel(decide)
    runtime = runtime_from_url(url)
    agent = Agent("billing", model=model, tools=[charge], runtime=runtime)
    try:
        if mode == "first":
            await agent.run("charge 7", session_id="crash", user_id="alice")
        else:
            result = await agent.resume("charge 7", session_id="crash", user_id="alice")
            print(
                json.dumps(
                    {
                        "model_calls": model.calls,
                        "output": result.output,
                        "replayed": result.replayed_steps,
                        "fresh": result.fresh_steps,
                    }
                )
            )
    finally:
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
