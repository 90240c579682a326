"""A worker process whose agent run stops between a journaled tool call and its snapshot.

``python _paused_worker.py URL`` streams a run (``Tuning(checkpoint=True)``, a 1 s lease) on
session ``s`` of user ``u``. When the tool call's result arrives it prints ``{"event":
"paused"}`` and waits for a line on stdin (the parent stops it past its lease meanwhile);
then it goes on, and prints ``{"event": "lost", "error": ...}`` if it lost its turn, else
``{"event": "finished"}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from loomflow.agent import Agent, ToolCallFinished, Tuning
from loomflow.errors import OwnershipLostError
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import runtime_from_url
from loomflow.tools import tool

PROMPT = "charge 7"


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


@tool
def charge(amount: int) -> str:
    """Charge the card."""
    return f"charged {amount} by {os.getpid()}"


async def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role != "tool":
        return [ToolCall(id="c1", name="charge", arguments={"amount": 7})]
    return f"done: {messages[-1].content}"


def agent(url: str) -> Agent:
    runtime = runtime_from_url(url, lease_seconds=1.0)
    return Agent(
        "billing",
        model=FunctionModel(decide),
        tools=[charge],
        runtime=runtime,
        memory=False,
        tuning=Tuning(checkpoint=True),
        name="billing",
    )


async def main(url: str) -> None:
    paused = agent(url)
    try:
        async for event in paused.stream(PROMPT, session_id="s", user_id="u"):
            if isinstance(event, ToolCallFinished):
                emit("paused")
                if not await asyncio.to_thread(sys.stdin.readline):
                    raise SystemExit(4)  # the parent is gone
        emit("finished")
    except OwnershipLostError as exc:
        emit("lost", error=str(exc))
    finally:
        assert paused.runtime is not None
        await paused.runtime.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
