"""A workflow and a debate the recovery tests run in real processes and kill.

Configured as ``_app`` is (``FLEET_URL``, ``FLEET_LEDGER``, ``FLEET_BLOCK``). The workflow
``pipeline`` reserves (a function node), ships (a function node that blocks with
``FLEET_BLOCK=1``) and sums up (an agent node); the debate ``debate`` has one debater whose
tools are ``_app``'s ``reserve`` and ``ship``, and a judge.

``python _arch_app.py start KIND SESSION`` starts one run of user ``ana`` (KIND is
``pipeline`` or ``debate``).
"""

from __future__ import annotations

import asyncio
import os
import sys

from _app import _mark, reserve, ship

from loomflow.agent import Agent
from loomflow.agent.architectures import Debate, Workflow
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.runtime import runtime_from_url

PROMPT = "Order 7: one LOOM-7."


def _reserve_node(text: str) -> str:
    _mark("reserve")
    return f"reserved for {text}"


async def _ship_node(text: str) -> str:
    return str(await ship.invoke({"order": 7}))


def architectures() -> dict[str, Workflow | Debate]:
    """The worker's registry, as ``_app.agents`` is for the order agent."""
    runtime = runtime_from_url(os.environ["FLEET_URL"])

    def agent(name: str, script: list[object], **options: object) -> Agent:
        return Agent(
            "You help with orders.",
            model=ScriptedModel(script),
            runtime=runtime,
            memory=False,
            telemetry=False,
            name=name,
            **options,  # type: ignore[arg-type]
        )

    pipeline = Workflow(
        [
            ("reserve", _reserve_node),
            ("ship", _ship_node),
            ("summary", agent("summary", [os.environ.get("FLEET_SUMMARY", "All done.")])),
        ],
        runtime=runtime,
        name="pipeline",
    )
    debater = agent(
        "clerk",
        [
            [ToolCall(id="r", name="reserve", arguments={"sku": "LOOM-7"})],
            [ToolCall(id="s", name="ship", arguments={"order": 7})],
            "Reserved and shipped, so we keep the order.",
        ],
        tools=[reserve, ship],
    )
    debate = Debate(
        [debater], agent("judge", ["Keep it."]), rounds=1, runtime=runtime, name="debate"
    )
    return {"pipeline": pipeline, "debate": debate}


async def start(kind: str, session: str) -> None:
    built = architectures()[kind]
    result = await built.run(PROMPT, session_id=session, user_id="ana")
    print(result.output, flush=True)


if __name__ == "__main__":
    asyncio.run(start(sys.argv[2], sys.argv[3]))
