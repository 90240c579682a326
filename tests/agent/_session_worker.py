"""One turn of the reference session example, in a process of its own.

``python _session_worker.py JOURNAL TURN`` builds an agent on the SQLite journal with no
``memory=`` argument and a :class:`~loomflow.models.ScriptedModel` holding both turns of the
conversation, runs turn ``TURN`` (0 or 1) of it on session ``conv_42`` for ``alice`` and prints a
JSON summary: the output and the user messages the model was sent.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from loomflow.agent import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime

PROMPTS = ("Hi, I'm Alice.", "What did I just say?")
ANSWERS = ("Hello, Alice.", "You said you're Alice.")


async def main(journal: Path, turn: int) -> None:
    model = ScriptedModel(list(ANSWERS))
    runtime = SqliteRuntime(journal)
    agent = Agent("You are a concise assistant.", model=model, runtime=runtime)
    try:
        result = await agent.run(PROMPTS[turn], session_id="conv_42", user_id="alice")
    finally:
        await runtime.close()
    sent = [m.content for m in model.requests[0] if m.role == "user"]
    print(json.dumps({"output": result.output, "user_messages_sent": sent}))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
