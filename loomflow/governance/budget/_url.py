"""Turn a store URL (from settings or the command line) into a budget store."""

from __future__ import annotations

from ...config import Settings
from ...storage import Database
from ._store import BudgetStore

__all__ = ["budget_store_for", "budget_store_from_url"]


def budget_store_from_url(
    url: str | None = None, *, settings: Settings | None = None
) -> BudgetStore:
    """The budget store a URL names: ``memory://``, ``sqlite:///budget.db`` or
    ``postgresql://...`` (the last two open a connection of their own).

    Without ``url``, the settings decide: ``LOOMFLOW_BUDGET_URL``, else the journal's
    ``LOOMFLOW_RUNTIME_URL`` (the budget then keeps its tables beside the journal's).
    """
    from ...stores import store_from_url

    s = settings or Settings()
    store: BudgetStore = store_from_url("budget", url or s.budget_url or s.runtime_url, settings=s)
    return store


def budget_store_for(settings: Settings, database: Database | None) -> BudgetStore | None:
    """Where a deployment keeps budget totals: ``budget_url``'s store, else a store in
    ``database`` (a journal's, sharing its connection), else ``None``."""
    from ...stores import budget_store_for as placed

    return placed(settings, database)
