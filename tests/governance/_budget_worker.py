"""A worker process for the budget contention and crash tests.

``python _budget_worker.py runs <url> <json>``: open a budget on the store URL, print
``ready``, wait for ``go`` on stdin (so that every worker starts at once), run the agents
concurrently and print one JSON line per run.

``python _budget_worker.py hold <url> <json>``: reserve once, print ``held``, then sleep until
killed (a worker that dies with a call in flight).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from typing import Any

from loomflow.agent import Agent, Tuning
from loomflow.governance.budget import Cap, SqlBudgetStore, StandardBudget
from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec, Usage
from loomflow.models import FunctionModel
from loomflow.tools import tool


@tool
async def lookup(key: str) -> str:
    """Look a key up."""
    await asyncio.sleep(random.uniform(0, 0.003))  # interleave the runs
    return f"value of {key}"


def budget_for(url: str, config: dict[str, Any]) -> StandardBudget:
    return StandardBudget(
        [Cap("tokens_total", config["cap"])],
        store=SqlBudgetStore(url),
        mode=config.get("mode", "hard"),
        overhead_tokens=config["overhead"],
        lease_s=config.get("lease_s", 60.0),
    )


async def run_all(url: str, config: dict[str, Any]) -> None:
    budget = budget_for(url, config)
    await budget.store.open()
    usage = Usage(input_tokens=config["usage"][0], output_tokens=config["usage"][1])

    async def decide(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        await asyncio.sleep(random.uniform(0, 0.003))
        done = sum(1 for m in messages if m.role == "tool")
        if done < config["tool_turns"]:
            call = ToolCall(id=f"c{done}", name="lookup", arguments={"key": f"k{done}"})
            return ModelResponse(tool_calls=[call], usage=usage, finish_reason="tool_calls")
        return ModelResponse(text="done", usage=usage)

    agent = Agent(
        "You look things up.",
        model=FunctionModel(decide),
        tools=[lookup],
        budget=budget,
        tuning=Tuning(max_tokens=config["max_tokens"]),
        max_turns=config["tool_turns"] + 1,
    )
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    async def one(user: str) -> dict[str, Any]:
        result = await agent.run("look up the keys", user_id=user)
        return {
            "user": user,
            "interrupted": result.interrupted,
            "reason": result.interruption_reason,
            "turns": result.turns,
            "tokens": result.tokens_in + result.tokens_out,
        }

    results = await asyncio.gather(*(one(user) for user in config["users"]))
    for row in results:
        print(json.dumps(row), flush=True)
    await budget.close()


async def hold(url: str, config: dict[str, Any]) -> None:
    budget = budget_for(url, config)
    await budget.reserve(
        user_id=config["user"], model="scripted", max_tokens=config["max_tokens"], input_tokens=0
    )
    print("held", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    command, store_url, raw = sys.argv[1:4]
    main = run_all if command == "runs" else hold
    asyncio.run(main(store_url, json.loads(raw)))
