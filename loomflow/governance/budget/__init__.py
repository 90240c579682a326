"""Budgets: caps on tokens, cost and time, with totals in a store shared by every worker.

:class:`StandardBudget` enforces :class:`Cap` objects through agent hooks. Its totals live in a
:class:`BudgetStore`: :class:`InMemoryBudgetStore` for one process, :class:`SqlBudgetStore` on
SQLite or PostgreSQL for totals that survive restarts and are shared across processes.
"""

from __future__ import annotations

from ._budget import BudgetHooks, CapStatus, StandardBudget, Ticket, bound_input_tokens
from ._store import BudgetStore
from ._types import (
    MAX_COST_NANOUSD_PER_CALL,
    MAX_SECONDS_PER_CALL,
    MAX_TOKENS_PER_CALL,
    Amount,
    Bucket,
    BucketLimit,
    BucketUsage,
    Cap,
    CommitResult,
    Denial,
    OnExpiry,
    Reservation,
    ReservationInfo,
    Totals,
    UnreadableBucket,
)
from ._url import budget_store_for, budget_store_from_url
from .inmemory import InMemoryBudgetStore
from .sql import SqlBudgetStore

__all__ = [
    "Amount",
    "Bucket",
    "BucketLimit",
    "BucketUsage",
    "BudgetHooks",
    "BudgetStore",
    "Cap",
    "CapStatus",
    "CommitResult",
    "Denial",
    "InMemoryBudgetStore",
    "MAX_COST_NANOUSD_PER_CALL",
    "MAX_SECONDS_PER_CALL",
    "MAX_TOKENS_PER_CALL",
    "OnExpiry",
    "Reservation",
    "ReservationInfo",
    "SqlBudgetStore",
    "StandardBudget",
    "Ticket",
    "Totals",
    "UnreadableBucket",
    "bound_input_tokens",
    "budget_store_for",
    "budget_store_from_url",
]
