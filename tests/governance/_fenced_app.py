"""An audited, budgeted agent whose second model call can be held up, for the fenced tests.

``python _fenced_app.py URL LEDGER GATE`` runs session ``s-0`` of user ``ana`` on the journal,
budget and audit log at ``URL`` (1 s lease): the model asks for ``pay``, then answers. Every
model call appends a line ``model`` to ``LEDGER``; the second adds ``blocked`` and waits for the
file ``GATE`` before it answers. The process prints how the run ended.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from loomflow.agent import Agent, Tuning
from loomflow.audit import AuditLog
from loomflow.governance.budget import Cap, SqlBudgetStore, StandardBudget
from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec, Usage
from loomflow.models import FunctionModel
from loomflow.runtime import runtime_from_url
from loomflow.tools import tool

USAGE = Usage(input_tokens=100, output_tokens=20)  # every call; it reserves far more
PROMPT = "Pay order 7."


def _mark(ledger: str, what: str) -> None:
    with open(ledger, "a") as log:  # one process at a time writes: no interleaving
        log.write(what + "\n")


@tool
def pay(order: int) -> str:
    """Pay an order."""
    return f"paid {order}"


def agent(url: str, ledger: str, gate: str | None) -> Agent:
    """The agent; with ``gate``, its second model call waits for that file."""

    async def decide(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        _mark(ledger, "model")
        if not any(m.role == "tool" for m in messages):
            call = ToolCall(id="c0", name="pay", arguments={"order": 7})
            return ModelResponse(tool_calls=[call], usage=USAGE, finish_reason="tool_calls")
        if gate is not None:
            _mark(ledger, "blocked")
            while not os.path.exists(gate):  # noqa: ASYNC110, ASYNC240 - another process makes it
                await asyncio.sleep(0.02)
        return ModelResponse(text="Paid.", usage=USAGE)

    return Agent(
        "You pay orders.",
        model=FunctionModel(decide),
        tools=[pay],
        runtime=runtime_from_url(url, lease_seconds=1.0),
        memory=False,
        audit=AuditLog(url, redact_logs=False),
        budget=StandardBudget([Cap("tokens_total", 100_000)], store=SqlBudgetStore(url)),
        tuning=Tuning(max_tokens=500),
        telemetry=False,
        name="payer",
    )


async def close(used: Agent) -> None:
    assert used.runtime is not None
    assert isinstance(used.audit, AuditLog)
    assert isinstance(used.budget, StandardBudget)
    await used.runtime.close()
    await used.audit.close()
    await used.budget.close()


async def main(url: str, ledger: str, gate: str) -> None:
    used = agent(url, ledger, gate)
    try:
        result = await used.run(PROMPT, session_id="s-0", user_id="ana")
        print(json.dumps({"output": result.output}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__}), flush=True)
    finally:
        await close(used)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
