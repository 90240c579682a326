"""A worker process that dies inside a tool call whose argument nests a secret.

``python _nested_secret_worker.py JOURNAL`` runs an agent on the SQLite file JOURNAL (session
``s``, user ``ana``, a 1 s lease) whose model calls ``connect`` with :data:`ARGUMENTS`. When
the tool starts (the model's call is journaled, the tool's result is not) it prints ``{"event":
"in-tool"}`` and waits to be killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from loomflow.agent import Agent
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import tool

ARGUMENTS: dict[str, Any] = {
    "config": {"host": "dbhost1", "password": "hunter2-nested"},
    "headers": [],
    "retries": 0,
}


# The test's tool has this signature too: the resumed run's model call replays this one.
@tool
async def connect(config: dict[str, Any], headers: list[dict[str, Any]], retries: int) -> str:
    """Connect to a database."""
    print(json.dumps({"event": "in-tool"}), flush=True)
    await asyncio.Event().wait()
    return "never"


def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
    return [ToolCall(id="c0", name="connect", arguments=ARGUMENTS)]


async def main(journal: str) -> None:
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[connect],
        runtime=SqliteRuntime(journal, lease_seconds=1.0),
    )
    await agent.run("go", session_id="s", user_id="ana")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
