"""Events governance emits into a run's stream; the audit log records every one of them.

They are emitted with ``RunInfo.emit`` from the hooks, so they reach the caller of
``agent.stream()`` and every other hook's ``on_event`` (audit, telemetry).

A hook that handles them implements :class:`GovernanceVisitor` (one method per event) and
calls ``event.accept(visitor)``: each event picks its own method, so the events are told
apart once, by class, and a new event is a new visitor method that mypy asks every handler
for.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ApprovalRequested",
    "BudgetDenied",
    "BudgetUnavailable",
    "BudgetWarning",
    "GovernanceEvent",
    "GovernanceVisitor",
    "GuardrailTripped",
    "PermissionDecided",
]

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class GovernanceVisitor(Protocol[R_co]):
    """What handles every governance event: one method per event class."""

    def budget_warning(self, event: BudgetWarning) -> R_co: ...

    def budget_denied(self, event: BudgetDenied) -> R_co: ...

    def budget_unavailable(self, event: BudgetUnavailable) -> R_co: ...

    def permission_decided(self, event: PermissionDecided) -> R_co: ...

    def guardrail_tripped(self, event: GuardrailTripped) -> R_co: ...

    def approval_requested(self, event: ApprovalRequested) -> R_co: ...


class GovernanceEvent(BaseModel):
    """Base of governance events."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def accept(self, visitor: GovernanceVisitor[R]) -> R | None:
        """``visitor``'s answer to this event; ``None`` for an event it has no method for
        (a subclass defined outside loomflow)."""
        return None


class BudgetWarning(GovernanceEvent):
    """Spend crossed a warning threshold of a cap (the run goes on)."""

    type: Literal["budget_warning"] = "budget_warning"
    cap: str  # e.g. "user.tokens_total", "global.cost_usd.daily"
    limit: float
    used: float
    fraction: float

    def accept(self, visitor: GovernanceVisitor[R]) -> R:
        return visitor.budget_warning(self)


class BudgetDenied(GovernanceEvent):
    """A model call was refused because it would cross a cap; the run ends interrupted."""

    type: Literal["budget_denied"] = "budget_denied"
    cap: str
    limit: float
    used: float
    requested: float
    reserved: float = 0.0  # held by other calls in flight when this one asked

    def accept(self, visitor: GovernanceVisitor[R]) -> R:
        return visitor.budget_denied(self)


class BudgetUnavailable(GovernanceEvent):
    """The budget store failed, so a model call was refused (fail closed); the run raises."""

    type: Literal["budget_unavailable"] = "budget_unavailable"
    detail: str

    def accept(self, visitor: GovernanceVisitor[R]) -> R:
        return visitor.budget_unavailable(self)


class PermissionDecided(GovernanceEvent):
    """The permission layer decided on a live tool call."""

    type: Literal["permission_decided"] = "permission_decided"
    tool: str
    turn: int
    slot: int
    decision: Literal["allow", "deny", "ask"]
    final: Literal["allow", "deny"]  # after an approval handler answered an "ask"
    reason: str
    policy: str
    approver: str | None = None
    # Hidden as the audit entry hides them (sensitive names and keys, secrets, personal data).
    arguments: dict[str, Any] = Field(default_factory=dict)
    edited: bool = False
    # An approver answered the ask (named or not), rather than the policy refusing it because
    # nobody could be asked (no handler, a timeout, a handler that failed).
    by_approver: bool = False

    def accept(self, visitor: GovernanceVisitor[R]) -> R:
        return visitor.permission_decided(self)


class GuardrailTripped(GovernanceEvent):
    """A guardrail blocked or redacted input, output or a tool result."""

    type: Literal["guardrail_tripped"] = "guardrail_tripped"
    name: str
    stage: Literal["input", "output", "tool_result"]
    action: Literal["block", "redact"]
    detail: str = ""

    def accept(self, visitor: GovernanceVisitor[R]) -> R:
        return visitor.guardrail_tripped(self)


class ApprovalRequested(GovernanceEvent):
    """A tool call needs a person's decision; the run stops until one is recorded
    (``StandardPermissions(approval="defer")``)."""

    type: Literal["approval_requested"] = "approval_requested"
    request_id: str
    tool: str
    turn: int
    slot: int
    reason: str
    policy: str
    # Hidden as the audit entry hides them (sensitive names and keys, secrets, personal data).
    arguments: dict[str, Any] = Field(default_factory=dict)

    def accept(self, visitor: GovernanceVisitor[R]) -> R:
        return visitor.approval_requested(self)
