"""Several worker processes share one journal; when one dies, its work is resumed elsewhere.

Two worker processes split six orders. Worker 1 dies (SIGKILL) in the middle of its second
order, after charging the card and before shipping. The supervisor then reads the journal's
sessions, and calls ``agent.resume()`` for every order that is not finished: a crashed run
continues after its last journaled step, a run that never started simply runs. Every order
ends up charged and shipped exactly once.

With PostgreSQL (``runtime_from_url("postgresql://...")``) the workers can live on different
machines; on one machine a SQLite file is enough.

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
DIES_BEFORE_SHIPPING = "A-1004"  # worker 1's second order


def prompt(order: str) -> str:
    return f"Charge and ship order {order}."


def build_agent(url: str, ledger: Path, *, crash: bool) -> Agent:
    def record(action: str, order: str) -> None:
        with ledger.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"action": action, "order": order, "pid": os.getpid()}) + "\n")

    @tool(destructive=True)
    def charge(order: str) -> str:
        """Charge the customer for an order."""
        record("charge", order)
        return f"charged {order}"

    @tool
    def ship(order: str) -> str:
        """Ship an order."""
        if crash and order == DIES_BEFORE_SHIPPING:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-run
        record("ship", order)
        return f"shipped {order}"

    def decide(messages: list[Message], tools: list[ToolSpec]) -> str | list[ToolCall]:
        order = messages[1].content.split()[-1].rstrip(".")
        turn = sum(1 for m in messages if m.role == "assistant")
        if turn < 2:
            name = ("charge", "ship")[turn]
            return [ToolCall(id=f"{name}-{order}", name=name, arguments={"order": order})]
        return f"{order} charged and shipped."

    return Agent(
        "You fulfil orders.",
        model=FunctionModel(decide, name="order-bot"),
        tools=[charge, ship],
        runtime=runtime_from_url(url),
    )


async def work(url: str, ledger: Path, orders: list[str], *, crash: bool) -> None:
    """A worker: runs its orders one after another (in production, taken from a queue)."""
    agent = build_agent(url, ledger, crash=crash)
    for order in orders:
        await agent.run(prompt(order), session_id=f"order-{order}", user_id="shop")
    await agent.runtime.close()


async def supervise(url: str, ledger: Path) -> None:
    agent = build_agent(url, ledger, crash=False)
    runtime = agent.runtime
    sessions = {s.session_id: s for s in await runtime.sessions(user_id="shop", limit=1000)}
    for order in ORDERS:
        info = sessions.get(f"order-{order}")
        state = "never started" if info is None else ("open" if info.open else "finished")
        if state == "finished":
            print(f"{order}: finished by a worker")
            continue
        # resume() is safe whatever the state: it replays what is journaled and runs the rest.
        result = await agent.resume(prompt(order), session_id=f"order-{order}", user_id="shop")
        print(
            f"{order}: {state}; resumed here: {result.replayed_steps} steps replayed, "
            f"{result.fresh_steps} ran fresh"
        )
    await runtime.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'journal.db'}"
        ledger = Path(tmp) / "ledger.jsonl"
        ledger.touch()
        workers = [
            subprocess.Popen(
                [sys.executable, __file__, "worker", url, str(ledger), str(i), *ORDERS[i::2]]
            )
            for i in range(2)
        ]
        codes = [w.wait(timeout=60) for w in workers]
        print(f"worker exit codes: {codes} (-9: killed)")
        assert codes == [0, -signal.SIGKILL]

        asyncio.run(supervise(url, ledger))

        effects = Counter(
            (r["action"], r["order"]) for r in map(json.loads, ledger.read_text().splitlines())
        )
        assert effects == Counter({(a, o): 1 for a in ("charge", "ship") for o in ORDERS})
        print(f"all {len(ORDERS)} orders charged and shipped, each exactly once")


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        url, ledger, index, *orders = sys.argv[2:]
        asyncio.run(work(url, Path(ledger), orders, crash=index == "1"))
    else:
        main()
