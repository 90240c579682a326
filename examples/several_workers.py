"""Several processes share one journal; a recovery worker finishes what a dead one left.

Two application processes split six orders. Process 1 dies (SIGKILL) in the middle of its
last order, after charging the card and before shipping: the run is left ``orphaned`` in the
journal. Then ``loomflow worker several_workers:agents --once`` (what a cron job or a
long-running ``loomflow worker`` does) finds the orphaned run, claims it and resumes it with
the prompt, session and user the run stored when it began: the charge is replayed from the
journal, only the shipping runs. Every order ends up charged and shipped exactly once, and no
code of ours had to list sessions or call ``resume()``.

In code, the same is ``loomflow.recovery.Recovery(runtime, agents).sweep()``; see
docs/operations/fleet.md for running a fleet of workers. With PostgreSQL
(``postgresql://...``) the processes can live on different machines.

    python examples/several_workers.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from loomflow import Agent, ToolCall, tool
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import runtime_from_url

ORDERS = [f"A-{n}" for n in range(1001, 1007)]
DIES_BEFORE_SHIPPING = "A-1006"  # process 1's last order


def prompt(order: str) -> str:
    return f"Charge and ship order {order}."


def record(action: str, order: str) -> None:
    """The outside world: one line per charge or shipment, in a file every process shares."""
    with Path(os.environ["ORDERS_LEDGER"]).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps({"action": action, "order": order, "pid": os.getpid()}) + "\n")


@tool(destructive=True)
def charge(order: str) -> str:
    """Charge the customer for an order."""
    record("charge", order)
    return f"charged {order}"


@tool
def ship(order: str) -> str:
    """Ship an order."""
    if os.environ.get("ORDERS_CRASH") == "1" and order == DIES_BEFORE_SHIPPING:
        os.kill(os.getpid(), signal.SIGKILL)  # the process dies mid-run
    record("ship", order)
    return f"shipped {order}"


def decide(messages: list[Message], tools: list[ToolSpec]) -> str | list[ToolCall]:
    order = messages[1].content.split()[-1].rstrip(".")
    turn = sum(1 for m in messages if m.role == "assistant")
    if turn < 2:
        name = ("charge", "ship")[turn]
        return [ToolCall(id=f"{name}-{order}", name=name, arguments={"order": order})]
    return f"{order} charged and shipped."


def agents() -> dict[str, Agent]:
    """The application's agents by name: what ``loomflow worker several_workers:agents`` loads.

    A run records its agent's ``name``; the worker resumes it through the agent registered
    under that name, with the same configuration.
    """
    orders = Agent(
        "You fulfil orders.",
        model=FunctionModel(decide, name="order-bot"),
        tools=[charge, ship],
        runtime=runtime_from_url(os.environ["ORDERS_URL"]),
        memory=False,
        name="orders",
    )
    return {"orders": orders}


async def serve(orders: list[str]) -> None:
    """An application process: runs its orders one after another."""
    agent = agents()["orders"]
    for order in orders:
        await agent.run(prompt(order), session_id=f"order-{order}", user_id="shop")
    await agent.runtime.close()  # type: ignore[union-attr]


async def states() -> dict[str, str]:
    runtime = runtime_from_url(os.environ["ORDERS_URL"])
    try:
        return {str(s.session_id): s.state for s in await runtime.sessions(limit=100)}
    finally:
        await runtime.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ORDERS_URL"] = f"sqlite:///{Path(tmp) / 'journal.db'}"
        os.environ["ORDERS_LEDGER"] = str(Path(tmp) / "ledger.jsonl")
        here = str(Path(__file__).resolve().parent)
        # The worker imports this file as the module several_workers.
        extra = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, extra])))

        processes = [
            subprocess.Popen(
                [sys.executable, __file__, "serve", *ORDERS[i::2]],
                env=dict(env, ORDERS_CRASH=str(i)),
            )
            for i in range(2)
        ]
        codes = [p.wait(timeout=60) for p in processes]
        print(f"application exit codes: {codes} (-9: killed)")
        assert codes == [0, -signal.SIGKILL]
        left = {s: state for s, state in asyncio.run(states()).items() if state != "finished"}
        print(f"left behind: {left}")
        assert left == {f"order-{DIES_BEFORE_SHIPPING}": "orphaned"}

        # One sweep of a recovery worker: claim the orphaned run, resume it, wait, exit.
        worker = subprocess.run(
            [sys.executable, "-m", "loomflow.cli", "worker", "several_workers:agents", "--once"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        print(f"loomflow worker --once: {worker.stdout.strip()}")
        assert worker.returncode == 0, worker.stderr
        assert set(asyncio.run(states()).values()) == {"finished"}

        lines = Path(os.environ["ORDERS_LEDGER"]).read_text().splitlines()
        effects = Counter((r["action"], r["order"]) for r in map(json.loads, lines))
        assert effects == Counter({(a, o): 1 for a in ("charge", "ship") for o in ORDERS})
        print(f"all {len(ORDERS)} orders charged and shipped, each exactly once")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        asyncio.run(serve(sys.argv[2:]))
    else:
        main()
