"""A worker process for the checkpoint crash tests.

``python _checkpoint_worker.py URL LEDGER MODE`` runs a shopping agent with checkpoints and
memory on the journal at URL; every real purchase is appended to LEDGER.

- ``mid-run``: after two purchases, when the model is asked for its third turn, print
  ``PASS-2`` and wait to be killed.
- ``episode``: finish the run, but when the episode has been written to memory (and before
  the journal records that step) print ``EPISODE-WRITTEN`` and wait to be killed.
- ``fork``: finish the run, then fork it from its second pass into ``crash-fork``; when the
  fork's run has started (its hooks are being told), print ``FORK-STARTING`` and wait to be
  killed.
- ``half-fork``: finish the run, print ``RUN-DONE``, wait for a line on stdin, then fork it
  from its second pass into ``crash-fork`` (the test blocks the fork's first snapshot write
  and kills the worker there).
- ``resume`` / ``resume-fork``: resume the session (the fork) and print a JSON summary.
- ``recover``: once the dead worker's lease has run out, let a recovery worker resume what
  it left open, and print the same summary for the fork's session.
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
from loomflow.recovery import Recovery
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


class StopsAsItStarts(RunHooks):
    armed = False

    async def run_started(self, info: RunInfo) -> None:
        if self.armed:
            print("FORK-STARTING", flush=True)
            await asyncio.Event().wait()


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

    # A short lease where a recovery worker is to find the killed worker's run soon.
    short = mode in ("half-fork", "recover")
    runtime = runtime_from_url(url, **({"lease_seconds": 1} if short else {}))
    model = FunctionModel(decide)
    live = LiveTurns()
    starting = StopsAsItStarts()
    memory = memory_for(runtime)
    if mode == "episode":
        memory = StopsAfterWriting(memory.store)
    agent = Agent(
        "You shop.",
        name="shopper",
        model=model,
        tools=[buy],
        runtime=runtime,
        memory=memory,
        hooks=[live, starting],
        tuning=Tuning(checkpoint=True),
    )
    try:
        if mode not in ("resume", "resume-fork", "recover"):
            await agent.run("shop", session_id="crash", user_id="alice")
            if mode == "half-fork":
                print("RUN-DONE", flush=True)
                await asyncio.to_thread(sys.stdin.readline)
            if mode in ("fork", "half-fork"):
                listed = await agent.list_checkpoints("crash", user_id="alice")
                [second] = [c for c in listed if c.turn == 2]
                starting.armed = mode == "fork"
                await agent.resume(
                    "shop", session_id="crash", user_id="alice", from_checkpoint=second.id,
                    fork_session_id="crash-fork",
                )  # fmt: skip
            return
        session = "crash" if mode == "resume" else "crash-fork"
        if mode == "recover":
            await asyncio.sleep(1.5)  # the killed worker's lease runs out
            recovery = Recovery(runtime, {"shopper": agent}, worker_id="test")
            report = await recovery.sweep()
            await recovery.wait()
            [info] = await runtime.sessions(session_id=session, user_id="alice")
            print(
                json.dumps(
                    {
                        "resumed": [r.session_id for r in report.resumed],
                        "state": info.state,
                        "last_error": info.last_error,
                    }
                ),
                flush=True,
            )
            if info.state != "finished":
                return
            result = await agent.resume("shop", session_id=session, user_id="alice")
        else:
            result = await agent.resume("shop", session_id=session, user_id="alice")
        episodes = await memory.episodes(session, user_id="alice")
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
