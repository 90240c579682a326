"""A many-user agent workload with a known replay mix, in-process or as a scraped process.

Every session runs one agent task: a tool call, then an answer (2 model steps, 1 tool step).
Sessions come in three kinds, by index:

- plain: runs once (3 misses);
- resumed: runs, then ``resume()`` replays it whole (3 misses, then 3 hits);
- failed: the provider fails on the second model call, the run raises and stays open; running
  it again replays the first two steps and runs the last (3 misses and 2 hits in all).

``python _telemetry_workload.py JOURNAL`` serves prometheus-client's default registry on a free
loopback port, prints ``PORT <n>``, waits for a ``go`` line on stdin, runs the workload on a
SQLite journal, prints ``DONE <json counts>`` and waits for stdin to close.

The expected step counts hold when no hook interrupts runs; the run ids, users and sessions
always do.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loomflow.agent import Agent
from loomflow.agent.hooks import RunHooks
from loomflow.context import get_run_context
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.telemetry import Telemetry
from loomflow.tools import tool


@dataclass
class Expected:
    """What the workload should have counted."""

    hits: dict[str, int] = field(default_factory=lambda: {"model": 0, "tool": 0})
    misses: dict[str, int] = field(default_factory=lambda: {"model": 0, "tool": 0})
    runs: dict[str, int] = field(default_factory=dict)
    users: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)

    def ratio(self, kind: str) -> float:
        return self.hits[kind] / (self.hits[kind] + self.misses[kind])

    @property
    def total(self) -> int:
        return sum(self.hits.values()) + sum(self.misses.values())


@tool
def lookup(order: int) -> str:
    """Look an order up."""
    return f"order {order} shipped"


class ProviderDown(RuntimeError):
    pass


def kind_of(index: int) -> str:
    return ("plain", "plain", "plain", "resumed", "failed")[index % 5]


async def run_workload(
    runtime: Any,
    telemetry: Telemetry,
    *,
    users: int = 4,
    sessions_per_user: int = 5,
    hooks: Sequence[RunHooks] = (),
) -> Expected:
    fail_once: set[str] = set()

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            session = get_run_context().session_id or ""
            if session in fail_once:
                fail_once.discard(session)
                raise ProviderDown("provider unavailable")
            return f"done: {messages[-1].content}"
        return [ToolCall(id="c1", name="lookup", arguments={"order": len(messages)})]

    agent = Agent(
        "support bot",
        model=FunctionModel(decide),
        tools=[lookup],
        runtime=runtime,
        telemetry=telemetry,
        hooks=hooks,
        memory=False,  # the step mix above is model and tool steps only: no episode writes
    )
    expected = Expected()

    def count(outcome: str) -> None:
        expected.runs[outcome] = expected.runs.get(outcome, 0) + 1

    for u in range(users):
        user = f"user-{u:04d}"
        expected.users.append(user)
        for s in range(sessions_per_user):
            session = f"{user}-session-{s}"
            expected.sessions.append(session)
            kind = kind_of(s)
            if kind == "failed":
                fail_once.add(session)
                try:
                    first = await agent.run("where is my order?", session_id=session, user_id=user)
                except ProviderDown:
                    count("failed")
                else:  # a hook interrupted the run before the provider could fail
                    fail_once.discard(session)
                    expected.run_ids.append(first.run_id)
                    count("interrupted" if first.interrupted else "finished")
            result = await agent.run("where is my order?", session_id=session, user_id=user)
            expected.run_ids.append(result.run_id)
            count("interrupted" if result.interrupted else "finished")
            expected.misses["model"] += 2
            expected.misses["tool"] += 1
            if kind == "failed":
                expected.hits["model"] += 1
                expected.hits["tool"] += 1
            if kind == "resumed":
                again = await agent.resume("where is my order?", session_id=session, user_id=user)
                expected.run_ids.append(again.run_id)
                count("interrupted" if again.interrupted else "finished")
                expected.hits["model"] += 2
                expected.hits["tool"] += 1
    return expected


async def _serve(journal: Path) -> None:
    from loomflow.runtime import SqliteRuntime
    from loomflow.telemetry import serve_metrics

    runtime = SqliteRuntime(journal)
    telemetry = Telemetry(tracing=False)  # metrics on prometheus-client's default registry
    telemetry.instrument(runtime)  # series exist (at 0) before the first scrape
    server = serve_metrics(0)
    print(f"PORT {server.port}", flush=True)
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    if line.strip() != "go":
        return
    expected = await run_workload(runtime, telemetry)
    await runtime.close()
    print("DONE " + json.dumps(asdict(expected)), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    server.close()


if __name__ == "__main__":
    signal.alarm(300)  # never outlive a test that forgot us
    asyncio.run(_serve(Path(sys.argv[1])))
