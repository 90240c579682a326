"""A worker process for the deferred-approval crash test.

``python _approval_worker.py URL LEDGER MODE [REQUEST_ID]``:

- ``ask``: run an agent whose model asks to delete a record (needs approval) and to read one
  (does not); print the result as JSON, and wait to be killed (a server holding the request).
- ``approve-and-die REQUEST_ID``: resume with that request approved by ``carol``; the delete
  tool prints ``IN_TOOL`` and waits to be killed before doing anything.
- ``resume``: resume without decisions; print the result as JSON.
- ``recover``: sweep once as a recovery worker serving the agent, wait for the runs it
  resumed, and print the session's state and the sweep's counts as JSON.

Every tool appends one line to the ledger when it really runs: that is how the test counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.governance import Approve, StandardPermissions
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.recovery import Recovery
from loomflow.runtime import runtime_from_url
from loomflow.telemetry import Metrics
from loomflow.telemetry._metrics import RECOVERY_OUTCOMES
from loomflow.tools import Tool

PROMPT = "Tidy up the records."
SCRIPT = [
    [
        ToolCall(id="c0", name="delete_record", arguments={"name": "alpha"}),
        ToolCall(id="c1", name="read_record", arguments={"name": "beta"}),
    ],
    "Done tidying.",
]
# APPROVAL_SCRIPT=twice: after the first delete the model asks for a second one, which needs
# another approval.
TWICE = [
    SCRIPT[0],
    [ToolCall(id="c2", name="delete_record", arguments={"name": "gamma"})],
    "Done tidying.",
]


async def main(url: str, ledger: Path, mode: str, request_id: str) -> None:
    def record(line: str) -> str:
        with ledger.open("a") as fh:
            fh.write(line + "\n")
        return line

    async def delete_record(name: str) -> str:
        """Delete a record."""
        if mode == "approve-and-die":
            print("IN_TOOL", flush=True)
            await asyncio.Event().wait()  # killed here, after the decision was journaled
        return record(f"deleted {name}")

    def read_record(name: str) -> str:
        """Read a record."""
        return record(f"read {name}")

    runtime = runtime_from_url(url)
    agent = Agent(
        "records",
        model=ScriptedModel(TWICE if os.environ.get("APPROVAL_SCRIPT") == "twice" else SCRIPT),
        tools=[Tool(delete_record, destructive=True), Tool(read_record)],
        runtime=runtime,
        permissions=StandardPermissions(approval="defer"),
        memory=False,
    )
    try:
        if mode == "recover":
            registry = CollectorRegistry()
            recovery = Recovery(
                runtime, {agent.name: agent}, worker_id="approvals-test", metrics=Metrics(registry)
            )
            report = await recovery.sweep()
            await recovery.wait()
            [session] = await runtime.sessions(session_id="tidy", user_id="ana")
            counted = {
                outcome: registry.get_sample_value(
                    "loomflow_recoveries_total", {"outcome": outcome}
                )
                for outcome in RECOVERY_OUTCOMES
            }
            shown = {
                "resumed": len(report.resumed),
                "state": session.state,
                "outcomes": sorted(o for o, n in counted.items() if n),
            }
            print(json.dumps(shown), flush=True)
            return
        if mode == "ask":
            result = await agent.run(PROMPT, session_id="tidy", user_id="ana")
        elif mode == "approve-and-die":
            result = await agent.resume(
                PROMPT,
                session_id="tidy",
                user_id="ana",
                approvals={request_id: Approve()},
                decided_by="carol",
            )
        else:
            result = await agent.resume(PROMPT, session_id="tidy", user_id="ana")
        shown = {"output", "interruption_reason", "pending_approvals"}
        print(result.model_dump_json(include=shown), flush=True)
        if mode == "ask":
            await asyncio.Event().wait()  # a server holding the request: killed here
    finally:
        await runtime.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0], Path(args[1]), args[2], args[3] if len(args) > 3 else ""))
