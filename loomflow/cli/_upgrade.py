"""What ``migrate`` and ``runs list`` say about a loomflow 0.20 journal, and the import."""

from __future__ import annotations

from ..runtime import JournalRuntime, inspect_legacy_journal
from ..runtime._legacy import quiet_on_open

__all__ = ["legacy_note", "quiet_on_open"]


async def legacy_note(runtime: JournalRuntime, *, pending_only: bool = False) -> str | None:
    """One paragraph on the 0.20 journal in the runtime's database, if it holds one (with
    ``pending_only``, only while some of it is not imported)."""
    if getattr(runtime, "database", None) is None:
        return None  # memory:// has no 0.20 tables
    found = await inspect_legacy_journal(runtime)
    if found is None or (pending_only and not found.pending):
        return None
    return found.describe()
