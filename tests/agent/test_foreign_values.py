"""What comes from outside a run and is not what it seems: text that is no Unicode, results
Python orders differently in every process, tool calls without an id.

Each must leave a run that finishes, resumes without calling the model again and without
running a tool twice, on every backend; a resume in another process (another hash seed)
included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from loomflow import Agent, ToolCall, Tuning, tool
from loomflow.audit import AuditLog
from loomflow.audit.sqlite import SqliteAuditStore
from loomflow.messages import Message, ToolSpec
from loomflow.models import FunctionModel, ScriptedModel
from loomflow.runtime import JournalRuntime
from loomflow.testing.providers import FakeOpenAIAPI, Reply

Factory = Callable[..., Awaitable[JournalRuntime]]
LONE = json.loads('"caf\\udce9"')  # a lone surrogate: json.loads of a "\udce9" escape
WORKER = Path(__file__).with_name("_foreign_worker.py")


async def test_a_lone_surrogate_anywhere_leaves_a_run_that_finishes_and_replays(
    runtime_factory: Factory, tmp_path: Path
) -> None:
    calls: list[str] = []

    @tool
    def fetch(url: str) -> str:
        """Fetch a page."""
        calls.append(url)
        return "page " + LONE

    runtime = await runtime_factory()
    audit = AuditLog(SqliteAuditStore(tmp_path / "audit.db"))
    script = [[ToolCall(id="c", name="fetch", arguments={"url": "u" + LONE})], "done " + LONE]
    agent = Agent("x", model=ScriptedModel(script), tools=[fetch], runtime=runtime, audit=audit)
    result = await agent.run("go " + LONE, session_id="s", user_id="u")
    assert result.output == "done caf\ufffd"
    assert calls == ["ucaf\ufffd"]  # the model's arguments, made valid before the tool ran
    assert [m.content for m in result.messages if m.role == "tool"] == ["page caf\ufffd"]
    replay = await Agent(
        "x", model=ScriptedModel(script), tools=[fetch], runtime=runtime, audit=audit
    ).resume("go " + LONE, session_id="s", user_id="u")
    assert (replay.output, replay.fresh_steps, calls) == (result.output, 0, ["ucaf\ufffd"])
    report = await audit.verify()
    assert report.ok, report.problems
    await audit.close()


async def test_a_tool_name_or_call_id_with_a_lone_surrogate_is_an_unknown_tool(
    runtime_factory: Factory, tmp_path: Path
) -> None:
    # The name and id are the model's text too: with a budget sizing the call, the run
    # raised UnicodeEncodeError from the budget's estimate instead of telling the model.
    from loomflow.governance import Cap, InMemoryBudgetStore, StandardBudget

    @tool
    def fetch(url: str) -> str:
        """Fetch a page."""
        raise AssertionError("not this tool")

    runtime = await runtime_factory()
    audit = AuditLog(SqliteAuditStore(tmp_path / "audit.db"))
    budget = StandardBudget([Cap("tokens_total", 1_000_000)], store=InMemoryBudgetStore())
    script = [[ToolCall(id="c" + LONE, name="fetch" + LONE, arguments={"url": "u"})], "done"]

    def build() -> Agent:
        return Agent(
            "x", model=ScriptedModel(script), tools=[fetch], runtime=runtime, audit=audit,
            budget=budget,
        )  # fmt: skip

    result = await build().run("go", session_id="s", user_id="u")
    assert result.output == "done"
    (answer,) = [m for m in result.messages if m.role == "tool"]
    assert answer.tool_call_id == "ccaf\ufffd"
    assert "fetchcaf\ufffd" in answer.content  # no such tool, and the model is told so
    replay = await build().resume("go", session_id="s", user_id="u")
    assert (replay.output, replay.fresh_steps) == ("done", 0)
    report = await audit.verify()
    assert report.ok, report.problems
    await audit.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_nul_in_the_prompt_or_the_answer_leaves_a_run_that_finishes_and_replays(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # PostgreSQL text cannot hold NUL: a checkpoint of such a prompt or answer failed every
    # run and resume of the session as StoreUnavailableError, and the answer's memory
    # episode as UserError on every backend, each after the tool had run.
    from loomflow.config import Settings
    from loomflow.stores import Stores

    calls: list[str] = []

    @tool
    def fetch(url: str) -> str:
        """Fetch a page."""
        calls.append(url)
        return "page"

    url = request.getfixturevalue("pg_dsn") if kind == "postgres" else f"sqlite:///{tmp_path}/j.db"
    settings = Settings(runtime_url=url)
    script = [[ToolCall(id="c", name="fetch", arguments={"url": "u"})], "do\x00ne"]
    async with Stores(settings) as stores:

        def build() -> Agent:
            return Agent.from_settings(
                "x", model=ScriptedModel(script), tools=[fetch], settings=settings,
                runtime=stores.runtime, memory=stores.memory, tuning=Tuning(checkpoint=True),
            )  # fmt: skip

        async with build() as agent:
            result = await agent.run("g\x00o", session_id="s", user_id="u")
        assert result.output == "do\ufffdne"
        async with build() as agent:
            replay = await agent.resume("g\x00o", session_id="s", user_id="u")
        assert (replay.output, replay.fresh_steps, calls) == (result.output, 0, ["u"])
        [latest] = await stores.checkpoints.list_checkpoints("s", user_id="u", limit=1)
        assert (latest.prompt, latest.output) == ("g\ufffdo", "do\ufffdne")


async def test_a_provider_answer_with_half_an_emoji_is_kept(runtime_factory: Factory) -> None:
    from loomflow.models.openai import OpenAIModel

    runtime = await runtime_factory()
    with FakeOpenAIAPI(Reply(text="caf\ud83d end")) as api:  # sent as a "\ud83d" escape
        model = OpenAIModel("gpt-4.1", base_url=api.base_url, api_key="test")
        result = await Agent("x", model=model, runtime=runtime).run("go", session_id="s")
        await model.aclose()
    assert result.output == "caf\ufffd end"
    replay = await Agent("x", model=ScriptedModel([]), runtime=runtime).resume("go", session_id="s")
    assert (replay.output, replay.fresh_steps) == (result.output, 0)


async def test_tool_calls_without_an_id_are_named_and_replay(runtime_factory: Factory) -> None:
    ran: list[int] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        ran.append(a + b)
        return a + b

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if any(m.role == "tool" for m in messages):
            return "3"
        return [
            ToolCall(id="", name="add", arguments={"a": 1, "b": 2}),
            ToolCall(id="", name="add", arguments={"a": 2, "b": 2}),
        ]

    runtime = await runtime_factory()
    agent = Agent("x", model=FunctionModel(decide), tools=[add], runtime=runtime)
    result = await agent.run("sum", session_id="s")
    answered = [m.tool_call_id for m in result.messages if m.role == "tool"]
    assert answered == ["call_0_0", "call_0_1"]
    assert [c.id for c in result.messages[2].tool_calls] == answered
    replay = await agent.resume("sum", session_id="s")
    assert (replay.fresh_steps, ran) == (0, [3, 4])


async def test_tool_calls_sharing_an_id_get_their_own_and_replay(
    runtime_factory: Factory,
) -> None:
    # Some OpenAI-compatible servers give every call of an answer the same id. Both results
    # then named one call, and the provider refuses such a conversation (Anthropic: tool_use
    # ids must be unique), after the tools had run.
    ran: list[int] = []
    sent: list[list[Message]] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        ran.append(a + b)
        return a + b

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        sent.append(list(messages))
        if any(m.role == "tool" for m in messages):
            return "done"
        return [
            ToolCall(id="c1", name="add", arguments={"a": 1, "b": 2}),
            ToolCall(id="c1", name="add", arguments={"a": 2, "b": 2}),
            ToolCall(id="call_0_1", name="add", arguments={"a": 3, "b": 2}),  # ours' shape
            ToolCall(id="", name="add", arguments={"a": 4, "b": 2}),
        ]

    runtime = await runtime_factory()
    agent = Agent("x", model=FunctionModel(decide), tools=[add], runtime=runtime)
    result = await agent.run("sum", session_id="s")
    answered = [m.tool_call_id for m in result.messages if m.role == "tool"]
    assert answered == ["c1", "call_0_1_", "call_0_1", "call_0_3"]
    assistant = next(m for m in sent[-1] if m.tool_calls)
    assert [c.id for c in assistant.tool_calls] == answered
    replay = await agent.resume("sum", session_id="s")
    assert (replay.fresh_steps, sorted(ran)) == (0, [3, 4, 5, 6])
    assert [m.tool_call_id for m in replay.messages if m.role == "tool"] == answered


@pytest.mark.parametrize("kind", ["set", "intkeys", "enum"])
def test_a_result_python_orders_per_process_replays_elsewhere(kind: str, tmp_path: Path) -> None:
    """Run in one process, resume in another with another hash seed (the order of a set of
    strings), strictly: the tool's text must be what the first run showed the model."""
    journal = tmp_path / "journal.db"
    first = _worker(journal, kind, "run", seed="1")
    again = _worker(journal, kind, "resume", seed="2")
    assert again["text"] == first["text"]
    assert again["model_calls"] == 0
    assert again["tool_runs"] == 0


def _worker(journal: Path, kind: str, mode: str, *, seed: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(journal), kind, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
