"""What ``migrate`` and ``runs list`` say about a loomflow 0.20 journal, and the import."""

from __future__ import annotations

from ..runtime import JournalRuntime, import_legacy_journal, inspect_legacy_journal
from ..runtime._legacy import quiet_on_open

__all__ = ["legacy_note", "migrate_legacy", "quiet_on_open"]


async def legacy_note(runtime: JournalRuntime, *, pending_only: bool = False) -> str | None:
    """One paragraph on the 0.20 journal in the runtime's database, if it holds one (with
    ``pending_only``, only while some of it is not imported)."""
    if getattr(runtime, "database", None) is None:
        return None  # memory:// has no 0.20 tables
    found = await inspect_legacy_journal(runtime)
    if found is None or (pending_only and not found.pending):
        return None
    return found.describe()


async def migrate_legacy(runtime: JournalRuntime, *, do_import: bool) -> None:
    """After ``migrate``: say what a 0.20 journal holds or, with ``do_import``, import it and
    say what was imported and what was not."""
    if getattr(runtime, "database", None) is None:
        if do_import:
            print("no loomflow 0.20 journal in a memory:// journal: nothing to import")
        return
    if do_import:
        found = await inspect_legacy_journal(runtime)
        if found is None:
            print("no loomflow 0.20 journal in this database: nothing to import")
            return
        done = await import_legacy_journal(runtime)
        print(done.describe())
        print("the 0.20 tables were only read; drop them once the imported runs have resumed")
        return
    note = await legacy_note(runtime)
    if note is not None:
        print(note)
