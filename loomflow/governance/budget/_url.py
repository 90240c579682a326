"""Turn a store URL (from settings or the command line) into a budget store."""

from __future__ import annotations

from ...config import Settings
from ...storage import Database
from ...storage._schemes import check_scheme
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
    s = settings or Settings()
    url = url or s.budget_url or s.runtime_url
    if check_scheme("budget", url) == "memory":
        from .inmemory import InMemoryBudgetStore

        return InMemoryBudgetStore()
    from .sql import SqlBudgetStore

    return SqlBudgetStore(url, settings=s)


def budget_store_for(settings: Settings, database: Database | None) -> BudgetStore | None:
    """Where a deployment keeps budget totals: ``budget_url``'s store, else a store in
    ``database`` (a journal's, sharing its connection), else ``None``."""
    if settings.budget_url:
        return budget_store_from_url(settings.budget_url, settings=settings)
    if database is not None:
        from .sql import SqlBudgetStore

        return SqlBudgetStore(database, settings=settings)
    return None
