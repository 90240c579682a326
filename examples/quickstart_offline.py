"""An agent with a tool, journaled in SQLite, run and then resumed — offline.

The scripted model stands in for a real one: swap ``model=`` for ``"claude-opus-4-7"`` (with
the anthropic extra and ``ANTHROPIC_API_KEY``) and nothing else changes.

    python examples/quickstart_offline.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from loomflow import Agent, ToolCall, tool
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime

rates_fetched = 0


@tool
def exchange_rate(base: str, quote: str) -> float:
    """Today's exchange rate.

    Args:
        base: Currency to convert from, e.g. "EUR".
        quote: Currency to convert to, e.g. "USD".
    """
    global rates_fetched
    rates_fetched += 1
    return 1.08 if (base, quote) == ("EUR", "USD") else 1.0


async def main() -> None:
    model = ScriptedModel(
        [
            [ToolCall(id="c1", name="exchange_rate", arguments={"base": "EUR", "quote": "USD"})],
            "120 EUR is about 129.60 USD at today's rate of 1.08.",
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        runtime = SqliteRuntime(Path(tmp) / "journal.db")
        agent = Agent(
            "You convert currencies.", model=model, tools=[exchange_rate], runtime=runtime
        )
        first = await agent.run("How much is 120 EUR in USD?", session_id="fx-1", user_id="ana")
        print("answer:", first.output)
        print(f"turns={first.turns} tokens_in={first.tokens_in} tokens_out={first.tokens_out}")

        # Resuming the finished run replays it from the journal: no model call, no tool call.
        again = await agent.resume("How much is 120 EUR in USD?", session_id="fx-1", user_id="ana")
        assert again.output == first.output
        assert model.calls == 2
        assert rates_fetched == 1
        print(f"resumed: {again.replayed_steps} steps replayed, {again.fresh_steps} ran fresh")
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main())
