"""A worker process for test_foreign_values: a tool whose result Python orders per process.

``python _foreign_worker.py JOURNAL KIND run|resume`` runs (or strictly resumes) an agent whose
one tool returns a set of strings, a dict with int keys, or an unregistered enum, and prints
a JSON line: the tool result's text, how many model calls and tool runs this process made.
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
from pathlib import Path
from typing import Any

from loomflow import Agent, ToolCall, Tuning, tool
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime


class Status(enum.Enum):
    SHIPPED = "shipped"


RESULTS: dict[str, Any] = {
    "set": {"gamma", "alpha", "beta", "eps", "delta", "zeta", "eta"},
    "intkeys": {2: "shipped", 1: "pending", 3: "lost"},
    "enum": Status.SHIPPED,
}


async def main(journal: Path, kind: str, mode: str) -> None:
    runs = 0

    @tool
    def look(order: str) -> Any:
        """Look an order up."""
        nonlocal runs
        runs += 1
        return RESULTS[kind]

    model = ScriptedModel([[ToolCall(id="c", name="look", arguments={"order": "7"})], "ok"])
    runtime = SqliteRuntime(journal)
    agent = Agent(
        "x",
        model=model,
        tools=[look],
        runtime=runtime,
        tuning=Tuning(strict_replay=mode == "resume"),
    )
    call = agent.run if mode == "run" else agent.resume
    result = await call("look", session_id="s", user_id="u")
    text = [m.content for m in result.messages if m.role == "tool"]
    print(json.dumps({"text": text, "model_calls": model.calls, "tool_runs": runs}))
    await runtime.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
