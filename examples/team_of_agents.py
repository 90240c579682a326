"""A lead agent with a persistent research worker; the whole team resumes after a failure.

python examples/team_of_agents.py
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from loomflow import Agent, Message, ToolCall, tool
from loomflow.agent.architectures import Team
from loomflow.messages import ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime

searches: list[str] = []


@tool
def search(query: str) -> str:
    """Search the knowledge base."""
    searches.append(query)
    return f"3 documents about {query}"


def researcher(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role == "tool":
        return f"summary: {messages[-1].content}"
    return [ToolCall(id="s", name="search", arguments={"query": messages[-1].content})]


flaky = True


def lead(messages: list[Message], tools: list[ToolSpec]) -> Any:
    answers = [m.content for m in messages if m.role == "tool"]
    if not answers:
        return [ToolCall(id="a", name="ask_researcher", arguments={"task": "solar storms"})]
    if len(answers) == 1:
        if flaky:
            raise ConnectionError("the lead's provider dropped the connection")
        return [ToolCall(id="b", name="ask_researcher", arguments={"task": "grid impact"})]
    return "Brief: " + "; ".join(answers)


async def main() -> None:
    global flaky
    with tempfile.TemporaryDirectory() as tmp:
        runtime = SqliteRuntime(Path(tmp) / "journal.db")
        team = Team(
            Agent("You lead research.", model=FunctionModel(lead), runtime=runtime),
            [
                Agent(
                    "You research.",
                    model=FunctionModel(researcher),
                    tools=[search],
                    name="researcher",
                )
            ],
        )
        try:
            await team.run("Brief me on solar storms", session_id="brief-7", user_id="ops")
        except ConnectionError as exc:
            print("first attempt failed:", exc)
        flaky = False
        result = await team.resume("Brief me on solar storms", session_id="brief-7", user_id="ops")
        print(result.output)
        assert searches == ["solar storms", "grid impact"], searches  # no search repeated
        await runtime.close()


if __name__ == "__main__":
    asyncio.run(main())
