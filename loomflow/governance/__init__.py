"""Governance: budgets, permissions and guardrails, plugged into the agent loop as hooks."""

from __future__ import annotations

from .events import (
    BudgetDenied,
    BudgetWarning,
    GovernanceEvent,
    GuardrailTripped,
    PermissionDecided,
)

__all__ = [
    "BudgetDenied",
    "BudgetWarning",
    "GovernanceEvent",
    "GuardrailTripped",
    "PermissionDecided",
]
