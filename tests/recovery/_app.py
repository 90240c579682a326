"""The application the recovery tests run in real processes: one order agent on a journal.

Configured by environment variables, as a deployed app would be:

- ``FLEET_URL``: the journal (``sqlite:///...`` or ``postgresql://...``);
- ``FLEET_LEDGER``: a file every tool call appends one JSON line to (pid, tool, session), which
  is how the tests count side effects;
- ``FLEET_BLOCK=1``: ``ship`` writes a ``blocked`` line and then waits forever (to be killed),
  or, with ``FLEET_GATE=<path>``, until that file exists;
- ``FLEET_SLOW_RESERVE=<seconds>``: ``reserve`` (a sync tool, run in a thread) writes a
  ``blocked`` line, sleeps that long, then writes a ``reserved`` line;
- ``FLEET_FAIL=1``: ``ship`` raises (a run that cannot succeed), with the message
  ``FLEET_FAIL_MESSAGE`` if set (backslash escapes decoded: ``\\x00`` is a NUL);
- ``FLEET_WEDGE=1``: ``ship`` writes a ``wedged`` line and blocks the whole event loop (a
  blocking call in an async tool) until the file ``FLEET_GATE`` exists;
- ``FLEET_AUDIT_URL``: the audit log's store (by default the journal's);
- ``FLEET_INSTRUCTIONS``: the agent's instructions (changing them changes its fingerprint);
- ``FLEET_OUTPUT=1``: ``start`` asks each run for ``output_type=Note`` (the model answers JSON).

``python _app.py start N PREFIX`` starts N runs (sessions ``PREFIX-0`` ...) of user ``ana`` at
once and prints ``started``; with ``FLEET_BLOCK=1`` they block in ``ship`` until killed.
``loomflow worker _app:agents`` serves them (with this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from pydantic import BaseModel

from loomflow.agent import Agent
from loomflow.audit import AuditLog
from loomflow.errors import ConfigurationError
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import runtime_from_url
from loomflow.tools import tool

PROMPT = "Fulfil the order."
SCRIPT = [
    [ToolCall(id="c0", name="reserve", arguments={"sku": "LOOM-7"})],
    [ToolCall(id="c1", name="ship", arguments={"order": 7})],
    "Reserved and shipped.",
]
JSON_SCRIPT = [*SCRIPT[:2], '{"note": "Reserved and shipped."}']


class Note(BaseModel):
    """The structured answer of a run started with ``FLEET_OUTPUT=1``."""

    note: str


def _mark(tool_name: str) -> None:
    from loomflow.context import get_run_context

    ctx = get_run_context()
    line = json.dumps(
        {"pid": os.getpid(), "tool": tool_name, "session": ctx.session_id, "t": time.time()}
    )
    fd = os.open(os.environ["FLEET_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@tool
def reserve(sku: str) -> str:
    """Reserve stock."""
    _mark("reserve")
    slow = os.environ.get("FLEET_SLOW_RESERVE")
    if slow:
        _mark("blocked")
        time.sleep(float(slow))  # a sync tool: this runs in a thread no cancel can stop
        _mark("reserved")
    return f"reserved {sku}"


@tool
async def ship(order: int) -> str:
    """Book the shipment."""
    if os.environ.get("FLEET_BLOCK") == "1":
        _mark("blocked")
        gate = os.environ.get("FLEET_GATE")
        # Polled: the gate is a file another process creates, there is no event to wait on.
        while gate is None or not os.path.exists(gate):  # noqa: ASYNC110, ASYNC240
            await asyncio.sleep(0.05)
    if os.environ.get("FLEET_WEDGE") == "1":
        _mark("wedged")
        while not os.path.exists(os.environ["FLEET_GATE"]):  # noqa: ASYNC240
            time.sleep(0.05)  # noqa: ASYNC251 - the point: nothing else in the loop runs
    if os.environ.get("FLEET_FAIL") == "1":
        _mark("failed")
        # ConfigurationError stops the run (other tool errors go back to the model).
        message = os.environ.get("FLEET_FAIL_MESSAGE", "the carrier is down")
        raise ConfigurationError(message.encode().decode("unicode_escape"))
    _mark("ship")
    return f"shipped {order}"


def agents() -> dict[str, Agent]:
    """The worker's registry (a factory: ``loomflow worker _app:agents``)."""
    lease = float(os.environ.get("FLEET_LEASE", "30"))
    runtime = runtime_from_url(os.environ["FLEET_URL"], lease_seconds=lease)
    audit = AuditLog(os.environ.get("FLEET_AUDIT_URL", os.environ["FLEET_URL"]), redact_logs=False)
    agent = Agent(
        os.environ.get("FLEET_INSTRUCTIONS", "You fulfil orders."),
        model=ScriptedModel(SCRIPT),
        tools=[reserve, ship],
        runtime=runtime,
        memory=False,
        audit=audit,
        telemetry=None if os.environ.get("FLEET_TELEMETRY") else False,
        name="orders",
    )
    return {"orders": agent}


async def start(count: int, prefix: str) -> None:
    agent = agents()["orders"]
    options = {}
    if os.environ.get("FLEET_OUTPUT") == "1":
        agent = agent.clone(model=ScriptedModel(JSON_SCRIPT))
        options["output_type"] = Note
    tasks = [
        asyncio.create_task(
            agent.run(
                os.environ.get("FLEET_PROMPT", PROMPT),
                session_id=f"{prefix}-{i}",
                user_id="ana",
                **options,
            )
        )
        for i in range(count)
    ]
    print("started", flush=True)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps([repr(r) if isinstance(r, BaseException) else r.output for r in results]))


if __name__ == "__main__":
    asyncio.run(start(int(sys.argv[2]), sys.argv[3]))
