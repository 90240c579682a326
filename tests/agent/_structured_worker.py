"""A worker process for the structured-output crash test.

``python _structured_worker.py JOURNAL LEDGER first`` runs an agent with ``output_type=Invoice``
whose model first answers with JSON that does not validate; when the agent asks again (the
retry), the model prints ``RETRYING`` and waits to be killed. ``... resume`` resumes the run
in a new process with a model that answers the retry correctly, and prints a JSON summary.
Every model call appends one line to the ledger, which is how the test counts them.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from loomflow.agent import Agent
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime

PROMPT = "Extract the invoice: ACME, 3 items, 59 EUR."


class Invoice(BaseModel):
    vendor: str
    items: int
    total_eur: float


async def main(journal: Path, ledger: Path, mode: str) -> None:
    async def answer(messages: list[Message], tools: list[ToolSpec]) -> str:
        retry = messages[-1].role == "user" and messages[-1].content != PROMPT
        with ledger.open("a") as fh:
            fh.write(f"{mode} {'retry' if retry else 'first-attempt'}\n")
        if not retry:
            return '{"vendor": "ACME", "items": "three"}'  # items not an int, total missing
        if mode == "first":
            print("RETRYING", flush=True)
            await asyncio.Event().wait()  # killed here: the retry is never journaled
        return '{"vendor": "ACME", "items": 3, "total_eur": 59}'

    model = FunctionModel(answer)
    runtime = SqliteRuntime(journal)
    agent = Agent("extract invoices", model=model, runtime=runtime, output_type=Invoice)
    try:
        if mode == "first":
            await agent.run(PROMPT, session_id="inv-1", user_id="alice")
        else:
            result = await agent.resume(PROMPT, session_id="inv-1", user_id="alice")
            assert isinstance(result.parsed, Invoice)
            print(
                json.dumps(
                    {
                        "model_calls": model.calls,
                        "parsed": result.parsed.model_dump(),
                        "turns": result.turns,
                        "replayed": result.replayed_steps,
                        "feedback": [m.content for m in result.messages if m.role == "user"],
                    }
                )
            )
    finally:
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
