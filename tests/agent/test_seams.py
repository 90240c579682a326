"""The typed seams of a run: what the agent needs of a journal, a memory and a plug-in."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loomflow.agent import Agent
from loomflow.agent._passthrough import Passthrough
from loomflow.agent._seams import HookProvider, PricedBudget, RedactingAudit
from loomflow.agent.hooks import RunHooks, RunInfo
from loomflow.audit import AuditLog, InMemoryAuditStore
from loomflow.audit.redaction import Redactor
from loomflow.governance import PIIGuardrail, StandardBudget, StandardPermissions
from loomflow.memory import AgentMemory, InMemoryMemory
from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import JournalRuntime, OpenRun, Runtime
from loomflow.telemetry import Metrics, Telemetry
from loomflow.tools import Tool, ToolOutcome, tool


async def test_every_backend_is_a_runtime_and_opens_a_run_the_agent_can_read(
    runtime_factory: Callable[..., Awaitable[JournalRuntime]],
) -> None:
    runtime = await runtime_factory(max_payload_bytes=4096)
    assert isinstance(runtime, Runtime)
    assert runtime.max_payload_bytes == 4096
    assert runtime.current_run is None
    async with runtime.session("s", "u") as run:
        assert isinstance(run, OpenRun)
        assert runtime.current_run is run
        assert (run.epoch, run.resumed, run.stats.hits) == (0, False, 0)


async def test_without_a_journal_the_runtime_opens_no_run_and_caps_nothing() -> None:
    runtime = Passthrough()
    assert isinstance(runtime, Runtime)
    assert (runtime.backend, runtime.max_payload_bytes, runtime.current_run) == ("none", None, None)
    async with runtime.session("s", "u") as run:
        assert run is None


def test_loomflow_components_plug_in_through_the_seams() -> None:
    audit = AuditLog(InMemoryAuditStore())
    providers = [
        StandardBudget(),
        StandardPermissions(),
        audit,
        Telemetry(tracer_provider=None, metrics=False),
        Metrics(CollectorRegistry()),
        PIIGuardrail(),
    ]
    for component in providers:
        assert isinstance(component, HookProvider), component
        assert isinstance(component.as_hooks(), RunHooks), component
    assert isinstance(StandardBudget(), PricedBudget)
    assert isinstance(audit, RedactingAudit)
    assert not isinstance(StandardPermissions(), PricedBudget | RedactingAudit)
    assert isinstance(InMemoryMemory(), AgentMemory)


class Seen(RunHooks):
    def __init__(self) -> None:
        self.log: list[str] = []

    async def run_started(self, info: RunInfo) -> None:
        self.log.append("run_started")

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        self.log.append(f"before_tool:{call.name}")
        return call

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        self.log.append(f"after_model:{turn}")


class OwnPolicy:
    """A plug-in of one's own: not a RunHooks, but it has one to give."""

    def __init__(self) -> None:
        self.hooks = Seen()

    def as_hooks(self) -> RunHooks:
        return self.hooks


class OwnAudit(OwnPolicy):
    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor


@tool
def lookup(code: str) -> str:
    """Look a code up."""
    return f"found {code}"


def plan(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role == "tool":
        return "done"
    return [ToolCall(id="1", name="lookup", arguments={"code": "plum-hunter-22"})]


async def test_a_provider_of_ones_own_plugs_in_at_its_place() -> None:
    policy = OwnPolicy()
    agent = Agent("x", model=FunctionModel(plan), tools=[lookup], permissions=policy)
    result = await agent.run("go")
    assert result.output == "done"
    assert policy.hooks.log == [
        "run_started",
        "after_model:0",
        "before_tool:lookup",
        "after_model:1",
    ]


async def test_an_audit_log_of_ones_own_lends_the_agent_its_redactor() -> None:
    # The agent seals with the audit's redactor, so the secret it learned never reaches the
    # episode memory records.
    redactor = Redactor(secrets=["plum-hunter-22"])
    memory = InMemoryMemory()
    agent = Agent(
        "x", model=FunctionModel(plan), tools=[lookup], audit=OwnAudit(redactor), memory=memory
    )
    await agent.run("look plum-hunter-22 up", session_id="s")
    [episode] = await memory.episodes("s", user_id=None)
    stored = " ".join(m.content for m in episode.messages)
    assert "look" in stored
    assert "plum-hunter-22" not in stored


def test_anything_else_is_refused_when_the_agent_is_built() -> None:
    from loomflow.errors import UserError

    with pytest.raises(UserError, match="has no as_hooks"):
        Agent("x", model="scripted", telemetry="yes")  # type: ignore[arg-type]
