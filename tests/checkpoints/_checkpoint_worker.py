"""A worker process for the checkpoint crash tests.

``python _checkpoint_worker.py URL LEDGER MODE`` runs a shopping agent with checkpoints and
memory on the journal at URL; every real purchase is appended to LEDGER.

- ``mid-run``: after two purchases, when the model is asked for its third turn, print
  ``PASS-2`` and wait to be killed.
- ``episode``: finish the run, but when the episode has been written to memory (and before
  the journal records that step) print ``EPISODE-WRITTEN`` and wait to be killed.
- ``resume``: resume the session and print a JSON summary.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from loomflow.agent import Agent, Tuning
from loomflow.agent.hooks import RunHooks, RunInfo
from loomflow.memory import Episode, Memory, memory_for
from loomflow.messages import Message, ModelSettings, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import runtime_from_url
from loomflow.tools import tool

ITEMS = ("apples", "bread", "cheese")


class LiveTurns(RunHooks):
    def __init__(self) -> None:
        self.turns: list[int] = []

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        self.turns.append(turn)
        return None


class StopsAfterWriting(Memory):
    async def record_episode(self, *args: Any, **kwargs: Any) -> Episode:
        episode = await super().record_episode(*args, **kwargs)
        print("EPISODE-WRITTEN", flush=True)
        await asyncio.Event().wait()
        return episode


async def main(url: str, ledger: Path, mode: str) -> None:
    @tool
    def buy(item: str) -> str:
        """Buy one item."""
        with ledger.open("a") as fh:
            fh.write(f"{item}\n")
        return f"bought {item}"

    async def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        done = sum(1 for m in messages if m.role == "tool")
        if done == 2 and mode == "mid-run":
            print("PASS-2", flush=True)
            await asyncio.Event().wait()
        if done < 3:
            return [ToolCall(id=f"call-{done}", name="buy", arguments={"item": ITEMS[done]})]
        return "bought everything"

    runtime = runtime_from_url(url)
    model = FunctionModel(decide)
    live = LiveTurns()
    memory = memory_for(runtime)
    if mode == "episode":
        memory = StopsAfterWriting(memory.store)
    agent = Agent(
        "You shop.",
        model=model,
        tools=[buy],
        runtime=runtime,
        memory=memory,
        hooks=[live],
        tuning=Tuning(checkpoint=True),
    )
    try:
        if mode != "resume":
            await agent.run("shop", session_id="crash", user_id="alice")
            return
        result = await agent.resume("shop", session_id="crash", user_id="alice")
        episodes = await memory.episodes("crash", user_id="alice")
        print(
            json.dumps(
                {
                    "output": result.output,
                    "model_calls": model.calls,
                    "live_turns": live.turns,
                    "restored": result.restored_from is not None,
                    "turns": result.turns,
                    "tokens_in": result.tokens_in,
                    "replayed": result.replayed_steps,
                    "fresh": result.fresh_steps,
                    "episodes": len(episodes),
                    "episode_messages": len(episodes[0].messages) if episodes else 0,
                }
            )
        )
    finally:
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
