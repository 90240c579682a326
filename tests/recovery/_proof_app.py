"""The application of the fleet proof (test_fleet_proof.py), run by ``loomflow worker``.

One order agent: ``charge`` (whose payment is an idempotency-keyed step inside the tool),
then ``pack``, then ``ship``, then a final answer. Every side effect and every milestone is one
line appended to a ledger file (``O_APPEND``: lines from several processes never mix), with
the writing pid and the time, so the test can tell afterwards what ran where and when.

Configured by environment variables, as a deployed app is:

- ``PROOF_URL``: the journal (``sqlite:///...`` or ``postgresql://...``);
- ``PROOF_LEDGER``: the ledger file;
- ``PROOF_LEASE``: the run lease in seconds (short, so the proof is quick);
- ``PROOF_PAUSE``: seconds each tool takes after its effect (the window a kill lands in);
- ``PROOF_BLOCK=1``: the seeding process: even sessions stop for good inside ``charge`` after
  the payment, odd ones inside ``pack``, each writing a ``blocked`` line first.

``python _proof_app.py N`` (with ``PROOF_BLOCK=1``) starts sessions ``order-0`` ... at once; the
test kills it with SIGKILL once every run is blocked, which leaves N orphaned runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from loomflow.agent import Agent
from loomflow.context import get_run_context
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import JournalRuntime, runtime_from_url
from loomflow.tools import tool

PROMPT = "Charge, pack and ship the order."
SCRIPT = [
    [ToolCall(id="c0", name="charge", arguments={"amount": 40})],
    [ToolCall(id="c1", name="pack", arguments={"box": "M"})],
    [ToolCall(id="c2", name="ship", arguments={"carrier": "post"})],
    "Charged, packed and shipped.",
]
_runtime: JournalRuntime | None = None


def mark(event: str) -> None:
    """One ledger line: what happened, in which session, in which process, when."""
    line = json.dumps(
        {
            "event": event,
            "session": get_run_context().session_id,
            "pid": os.getpid(),
            "t": time.time(),
        }
    )
    fd = os.open(os.environ["PROOF_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


async def pause(where: str) -> None:
    """The tool's work after its effect; the seeder stops here for good (to be killed)."""
    session = get_run_context().session_id or ""
    blocks_in = "charge" if int(session.rsplit("-", 1)[1]) % 2 == 0 else "pack"
    if os.environ.get("PROOF_BLOCK") == "1" and where == blocks_in:
        mark("blocked")
        await asyncio.Event().wait()
    await asyncio.sleep(float(os.environ.get("PROOF_PAUSE", "1.0")))


def _take_payment(amount: int) -> str:
    mark("card")  # the payment: promised once, by its idempotency key
    return f"receipt {amount}"


@tool
async def charge(amount: int) -> str:
    """Take the payment for the order."""
    assert _runtime is not None
    session = get_run_context().session_id
    mark("charge.start")
    receipt = await _runtime.step(
        "take_payment", _take_payment, amount, idempotency_key=f"payment:{session}"
    )
    mark("charge.keyed")  # the payment's result is journaled under its key by now
    await pause("charge")
    return str(receipt)


@tool
async def pack(box: str) -> str:
    """Pack the order."""
    mark("pack")
    await pause("pack")
    return f"packed in {box}"


@tool
async def ship(carrier: str) -> str:
    """Hand the order to the carrier."""
    mark("ship")
    await pause("ship")
    mark("ship.done")
    return f"shipped by {carrier}"


def agents() -> dict[str, Agent]:
    """The worker's registry: ``loomflow worker _proof_app:agents``."""
    global _runtime
    lease = float(os.environ.get("PROOF_LEASE", "2"))
    _runtime = runtime_from_url(os.environ["PROOF_URL"], lease_seconds=lease)
    agent = Agent(
        "You fulfil orders.",
        model=ScriptedModel(SCRIPT),
        tools=[charge, pack, ship],
        runtime=_runtime,
        memory=False,
        telemetry=False,
        name="orders",
    )
    return {"orders": agent}


async def seed(count: int) -> None:
    agent = agents()["orders"]
    await asyncio.gather(
        *(agent.run(PROMPT, session_id=f"order-{i}", user_id="shop") for i in range(count))
    )


if __name__ == "__main__":
    asyncio.run(seed(int(sys.argv[1])))
