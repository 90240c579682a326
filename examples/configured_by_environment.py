"""A service configured only by ``LOOMFLOW_*`` variables: journal, audit log and budget.

``Agent.from_settings`` takes every store from the settings; here they all share one SQLite
file, as they would share one PostgreSQL database with ``LOOMFLOW_RUNTIME_URL=postgresql://...``
(``LOOMFLOW_METRICS_PORT`` and ``LOOMFLOW_OTLP_ENDPOINT`` would add metrics and spans). A
per-user cap stops the second request, and the audit trail shows both runs.

    python examples/configured_by_environment.py
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from loomflow import Agent, ToolCall, Tuning, tool
from loomflow.config import Settings
from loomflow.governance import Cap
from loomflow.messages import Message, ModelResponse, ToolSpec, Usage
from loomflow.models import FunctionModel


@tool
def order_status(order_id: str) -> str:
    """Look up where an order is."""
    return f"{order_id} left the warehouse this morning"


def decide(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
    # A scripted model that reports token usage, so the budget has something to count.
    usage = Usage(input_tokens=400, output_tokens=60)
    if messages[-1].role == "tool":
        return ModelResponse(text=f"Good news: {messages[-1].content}.", usage=usage)
    order = messages[-1].content.split()[-1]
    call = ToolCall(id="c1", name="order_status", arguments={"order_id": order})
    return ModelResponse(tool_calls=[call], usage=usage, finish_reason="tool_calls")


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # In a deployment these come from the environment or a .env file.
        os.environ["LOOMFLOW_RUNTIME_URL"] = f"sqlite:///{Path(tmp) / 'loomflow.db'}"
        settings = Settings()
        async with Agent.from_settings(
            "You answer questions about orders.",
            model=FunctionModel(decide, name="support-bot"),
            tools=[order_status],
            caps=[Cap("tokens_total", 2_500)],  # per user, all time
            # A call reserves its input (estimated from above) plus max_tokens of output.
            tuning=Tuning(max_tokens=512),
            settings=settings,
        ) as agent:
            first = await agent.run("Where is A-17", session_id="chat-1", user_id="dana")
            print("first:", first.output)
            second = await agent.run("And A-18", session_id="chat-2", user_id="dana")
            print("second:", second.output or "-", "| stopped by", second.interruption_reason)
            assert second.interruption_reason == "budget:user.tokens_total"

            assert agent.audit is not None
            page = await agent.audit.query(user_id="dana")
            print("audit trail of dana:", ", ".join(e.action for e in page.entries))
            assert (await agent.audit.verify(user_id="dana")).ok
            assert agent.budget is not None
            [cap] = await agent.budget.status("dana")
            print(f"budget: {cap.used:,.0f} of {cap.limit:,.0f} tokens used")


if __name__ == "__main__":
    asyncio.run(main())
