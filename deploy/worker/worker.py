"""A demo worker that keeps the dashboard busy: scripted agent runs, crashes and resumes.

Everything comes from the environment: the journal (``LOOMFLOW_RUNTIME_URL``), span export
(the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``, or ``LOOMFLOW_OTLP_ENDPOINT``) and the metrics
port (``LOOMFLOW_METRICS_PORT``). The model
is scripted, so no API key or network is needed. Each iteration picks one of 20 users and:

- mostly runs a fresh task (a tool call, then an answer);
- sometimes has the "provider" fail mid-run and runs it again (the journal replays the
  finished steps);
- sometimes resumes a finished run (everything replays);
- rarely resumes a run with another prompt (a replay divergence, to see the alert fire).

    python deploy/worker/worker.py --iterations 50 --pause 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
from typing import Any

from loomflow.agent import Agent
from loomflow.config import Settings
from loomflow.context import get_run_context
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import runtime_from_url
from loomflow.telemetry import Telemetry, setup_telemetry
from loomflow.tools import tool


class ProviderDown(RuntimeError):
    """The scripted provider failing mid-run."""


@tool
def order_status(order: int) -> str:
    """Look up an order."""
    return f"order {order} shipped"


async def main(iterations: int | None, pause: float, seed: int) -> None:
    settings = Settings()
    setup = setup_telemetry(settings)
    runtime = runtime_from_url(settings.runtime_url, settings=settings)
    rng = random.Random(seed)
    failing: set[str] = set()

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            session = get_run_context().session_id or ""
            if session in failing:
                failing.discard(session)
                raise ProviderDown("scripted provider outage")
            return f"Your {messages[-1].content}."
        order = sum(len(m.content) for m in messages) % 1000
        return [ToolCall(id=f"call-{order}", name="order_status", arguments={"order": order})]

    agent = Agent(
        "You answer questions about orders.",
        model=FunctionModel(decide),
        tools=[order_status],
        runtime=runtime,
        telemetry=Telemetry(),
        name="orders",
    )
    finished: list[tuple[str, str, str]] = []
    n = 0
    try:
        while iterations is None or n < iterations:
            n += 1
            user = f"user-{rng.randrange(20):02d}"
            roll = rng.random()
            if roll < 0.1 and finished:
                session, owner, prompt = rng.choice(finished)
                if roll < 0.01:
                    prompt += " (edited)"  # another prompt on a journaled run: divergence
                await agent.resume(prompt, session_id=session, user_id=owner)
            else:
                session = f"{user}-{n}"
                prompt = f"Where is my order {n}?"
                if roll < 0.3:
                    failing.add(session)
                    # The run raises and stays open; running it again replays what finished.
                    with contextlib.suppress(ProviderDown):
                        await agent.run(prompt, session_id=session, user_id=user)
                await agent.run(prompt, session_id=session, user_id=user)
                finished.append((session, user, prompt))
            await asyncio.sleep(pause)
    finally:
        await runtime.close()
        setup.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, help="stop after this many (default: never)")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between runs")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.iterations, args.pause, args.seed))
