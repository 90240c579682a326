"""Governance: budgets, permissions and guardrails, plugged into the agent loop as hooks.

Give them to the agent and they act at the right points of every run::

    agent = Agent(
        "...",
        model="claude-opus-4-7",
        budget=StandardBudget([Cap("cost_usd", 2.0, window="day")], store=store),
        permissions=StandardPermissions("acceptEdits", [Rule.deny("drop_*")]),
        guardrails=[PIIGuardrail()],
    )

Each decision (a budget refusal or warning, a permission decision, a guardrail trip) is an
event in the run's stream, which the audit log records.
"""

from __future__ import annotations

from .approvals import Approve, Deny, PendingApproval
from .budget import (
    BudgetStore,
    Cap,
    CapStatus,
    InMemoryBudgetStore,
    SqlBudgetStore,
    StandardBudget,
    budget_store_from_url,
)
from .events import (
    ApprovalRequested,
    BudgetDenied,
    BudgetUnavailable,
    BudgetWarning,
    GovernanceEvent,
    GovernanceVisitor,
    GuardrailTripped,
    PermissionDecided,
)
from .guardrails import Finding, Guardrail, PIIGuardrail, RegexGuardrail
from .permissions import (
    PERMISSION_DENIED,
    Approval,
    ApprovalRequest,
    Decision,
    PermissionContext,
    Policy,
    Rule,
    StandardPermissions,
)

__all__ = [
    "Approval",
    "ApprovalRequest",
    "ApprovalRequested",
    "Approve",
    "BudgetDenied",
    "BudgetStore",
    "BudgetUnavailable",
    "BudgetWarning",
    "Cap",
    "CapStatus",
    "Decision",
    "Deny",
    "Finding",
    "GovernanceEvent",
    "GovernanceVisitor",
    "Guardrail",
    "GuardrailTripped",
    "InMemoryBudgetStore",
    "PERMISSION_DENIED",
    "PIIGuardrail",
    "PendingApproval",
    "PermissionContext",
    "PermissionDecided",
    "Policy",
    "RegexGuardrail",
    "Rule",
    "SqlBudgetStore",
    "StandardBudget",
    "StandardPermissions",
    "budget_store_from_url",
]
