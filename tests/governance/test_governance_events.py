"""Every budget denial, permission decision and guardrail trip reaches every hook's on_event
(the audit log is one of them) and the caller's event stream."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from loomflow.agent import Agent, RunFinished, Tuning
from loomflow.agent.hooks import RunHooks, RunInfo
from loomflow.governance import (
    ApprovalRequested,
    BudgetDenied,
    BudgetUnavailable,
    BudgetWarning,
    Cap,
    GovernanceEvent,
    GuardrailTripped,
    PermissionDecided,
    PIIGuardrail,
    Rule,
    StandardBudget,
    StandardPermissions,
)
from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec, Usage
from loomflow.models import FunctionModel
from loomflow.tools import tool


class AuditSpy(RunHooks):
    def __init__(self) -> None:
        self.events: list[BaseModel] = []

    async def on_event(self, info: RunInfo, event: BaseModel) -> None:
        assert info.user_id == "alice"
        self.events.append(event)


@tool(destructive=True)
def drop_table(name: str) -> str:
    """Drop a table."""
    return f"dropped {name}"


@tool
def read_table(name: str) -> str:
    """Read a table."""
    return f"rows of {name}: contact ops@example.com"


def decide(messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
    usage = Usage(input_tokens=100, output_tokens=20)
    turn = sum(1 for m in messages if m.role == "assistant")
    calls = [
        [ToolCall(id="a", name="drop_table", arguments={"name": "users"})],
        [ToolCall(id="b", name="read_table", arguments={"name": "users"})],
    ]
    if turn < len(calls):
        return ModelResponse(tool_calls=calls[turn], usage=usage, finish_reason="tool_calls")
    return ModelResponse(text="done", usage=usage)


async def test_governance_events_reach_the_audit_hook_and_the_stream() -> None:
    spy = AuditSpy()
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[drop_table, read_table],
        budget=StandardBudget([Cap("tokens_total", 450)], warn_at=0.5, overhead_tokens=100),
        permissions=StandardPermissions("default", [Rule.deny("drop_*")]),
        guardrails=[PIIGuardrail()],
        hooks=[spy],
        tuning=Tuning(max_tokens=32),
    )
    streamed: list[Any] = [e async for e in agent.stream("clean up", user_id="alice")]
    assert isinstance(streamed[-1], RunFinished)
    result = streamed[-1].result
    assert result.interruption_reason == "budget:user.tokens_total"
    kinds = [type(e) for e in spy.events]
    assert kinds == [
        PermissionDecided,  # drop_table denied by the rule
        BudgetWarning,  # 240 of 450 tokens
        PermissionDecided,  # read_table allowed
        GuardrailTripped,  # its result held an e-mail address, redacted
        BudgetDenied,  # the third call would cross the cap
    ]
    assert all(isinstance(e, GovernanceEvent) for e in spy.events)
    assert [e for e in streamed if isinstance(e, GovernanceEvent)] == spy.events
    denied = spy.events[0]
    assert isinstance(denied, PermissionDecided)
    assert (denied.tool, denied.final, denied.policy) == ("drop_table", "deny", "global")


def test_each_event_picks_its_own_visitor_method() -> None:
    # Told apart by class, once: the visitor method names the event class it receives.
    class Names:
        def budget_warning(self, event: BudgetWarning) -> str:
            return type(event).__name__

        def budget_denied(self, event: BudgetDenied) -> str:
            return type(event).__name__

        def budget_unavailable(self, event: BudgetUnavailable) -> str:
            return type(event).__name__

        def permission_decided(self, event: PermissionDecided) -> str:
            return type(event).__name__

        def guardrail_tripped(self, event: GuardrailTripped) -> str:
            return type(event).__name__

        def approval_requested(self, event: ApprovalRequested) -> str:
            return type(event).__name__

    events: list[GovernanceEvent] = [
        BudgetWarning(cap="c", limit=1, used=0.9, fraction=0.9),
        BudgetDenied(cap="c", limit=1, used=1, requested=1),
        BudgetUnavailable(detail="down"),
        PermissionDecided(
            tool="t", turn=0, slot=0, decision="allow", final="allow", reason="r", policy="p"
        ),
        GuardrailTripped(name="pii", stage="input", action="block"),
        ApprovalRequested(
            request_id="apr_1", tool="t", turn=0, slot=0, reason="r", policy="global"
        ),
    ]
    assert [e.accept(Names()) for e in events] == [type(e).__name__ for e in events]
    # Every event class loomflow defines has its method (a new one without it would be None).
    home = GovernanceEvent.__module__
    ours = {c for c in GovernanceEvent.__subclasses__() if c.__module__ == home}
    assert {type(e) for e in events} == ours

    class Custom(GovernanceEvent):
        detail: str = ""

    assert Custom().accept(Names()) is None  # an application's own event: no handler, no crash
