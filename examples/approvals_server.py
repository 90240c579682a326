"""Human approvals in a web service: answer "202 pending", resume from the approval endpoint.

Two handlers stand for two HTTP endpoints (any framework will do; none is needed here):

- ``POST /tasks`` runs the agent. When a tool call needs a person, the run stops at once and
  the handler answers ``202 Accepted`` with the request ids; no worker waits.
- ``POST /approvals/<session>`` records a person's decisions and resumes the run, in whatever
  worker gets the request (here: a second agent object on the same SQLite journal, as a second
  process would have). The approved call runs once; a denied one reaches the model.

The scripted model stands in for a real one, so this runs offline:

    python examples/approvals_server.py
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from loomflow import Agent, ToolCall
from loomflow.governance import Approve, Deny, StandardPermissions
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import Tool

PROMPT = "Refund order 42 and close the ticket."
refunds: list[int] = []


def refund(order: int, cents: int) -> str:
    """Refund part of an order.

    Args:
        order: The order number.
        cents: How much to refund, in cents.
    """
    refunds.append(cents)
    return f"refunded {cents} cents on order {order}"


def close_ticket(ticket: int) -> str:
    """Close a support ticket."""
    return f"ticket {ticket} closed"


def build_agent(journal: Path) -> Agent:
    """What every worker of the service builds at start-up."""
    return Agent(
        "You handle refunds.",
        model=ScriptedModel(
            [
                [
                    ToolCall(id="c1", name="refund", arguments={"order": 42, "cents": 5000}),
                    ToolCall(id="c2", name="close_ticket", arguments={"ticket": 7}),
                ],
                "Refund handled and ticket closed.",
            ]
        ),
        # Refunds move money: nobody runs one without a person's yes.
        tools=[Tool(refund, destructive=True), Tool(close_ticket, edits=True)],
        runtime=SqliteRuntime(journal),
        permissions=StandardPermissions("acceptEdits", approval="defer"),
    )


async def post_task(agent: Agent, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``POST /tasks``: 200 with the answer, or 202 with what waits for a person."""
    result = await agent.run(body["prompt"], session_id=body["session"], user_id=body["user"])
    if result.interruption_reason == "approval":
        return 202, {
            "status": "pending",
            "session": result.session_id,
            "approvals": [
                {"id": p.request_id, "tool": p.tool, "arguments": p.arguments, "why": p.reason}
                for p in result.pending_approvals
            ],
        }
    return 200, {"status": "done", "output": result.output}


async def post_approvals(agent: Agent, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``POST /approvals/<session>``: record the decisions and continue the run."""
    decisions: dict[str, Any] = {}
    for request_id, answer in body["decisions"].items():
        if answer["allow"]:
            decisions[request_id] = Approve(arguments=answer.get("arguments"))
        else:
            decisions[request_id] = Deny(answer.get("reason", ""))
    result = await agent.resume(
        body["prompt"],
        session_id=body["session"],
        user_id=body["user"],
        approvals=decisions,
        decided_by=body["approver"],
    )
    if result.interruption_reason == "approval":  # some requests are still open
        return 202, {
            "status": "pending",
            "approvals": [p.request_id for p in result.pending_approvals],
        }
    return 200, {"status": "done", "output": result.output}


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        journal = Path(tmp) / "journal.db"
        worker_a, worker_b = build_agent(journal), build_agent(journal)
        task = {"prompt": PROMPT, "session": "ticket-7", "user": "ana"}

        status, reply = await post_task(worker_a, task)
        print(status, json.dumps(reply, indent=1))
        assert status == 202
        assert refunds == []

        # Hours later, another worker: the waiting requests come from the journal.
        waiting = await worker_b.pending_approvals("ticket-7", user_id="ana")
        print("waiting:", [(p.request_id, p.tool) for p in waiting])

        # The supervisor approves half the amount (an edit of the arguments).
        decision = {"allow": True, "arguments": {"order": 42, "cents": 2500}}
        status, reply = await post_approvals(
            worker_b,
            {**task, "approver": "supervisor-kim", "decisions": {waiting[0].request_id: decision}},
        )
        print(status, json.dumps(reply))
        assert status == 200
        assert refunds == [2500]

        # A replayed resume does not refund again.
        again = await worker_b.resume(PROMPT, session_id="ticket-7", user_id="ana")
        print("resumed again:", again.output, "| refunds made:", refunds)
        assert refunds == [2500]
        for agent in (worker_a, worker_b):
            assert agent.runtime is not None
            await agent.runtime.close()


if __name__ == "__main__":
    asyncio.run(main())
