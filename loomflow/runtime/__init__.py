"""The journaled runtime: steps recorded once, replayed after a crash.

Three backends share one replay implementation: :class:`InMemoryRuntime`,
:class:`SqliteRuntime` (the embedded default) and :class:`PostgresRuntime`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._journal import (
    JournalRun,
    JournalRuntime,
    Orphan,
    PickledEntryWarning,
    ReplayStats,
    StepEvent,
    StepStart,
    StepTracer,
    decode_record,
)
from ._legacy import (
    LAYOUT_0_20,
    LegacyImport,
    LegacyJournal,
    LegacyTable,
    import_legacy_journal,
    inspect_legacy_journal,
)
from ._protocol import OpenRun, Runtime
from ._store import RUN_STATES, EntryInfo, IdempotentInfo, OrphanClaim, RunRecord, SessionInfo
from ._url import runtime_from_url
from .codec import is_registered, register_type
from .inmemory import InMemoryRuntime
from .sqlite import SqliteRuntime

if TYPE_CHECKING:
    from .postgres import PostgresRuntime

__all__ = [
    "EntryInfo",
    "IdempotentInfo",
    "InMemoryRuntime",
    "JournalRun",
    "JournalRuntime",
    "LAYOUT_0_20",
    "LegacyImport",
    "LegacyJournal",
    "LegacyTable",
    "OpenRun",
    "Orphan",
    "OrphanClaim",
    "PickledEntryWarning",
    "PostgresRuntime",
    "RUN_STATES",
    "ReplayStats",
    "RunRecord",
    "Runtime",
    "SessionInfo",
    "SqliteRuntime",
    "StepEvent",
    "StepStart",
    "StepTracer",
    "decode_record",
    "import_legacy_journal",
    "inspect_legacy_journal",
    "is_registered",
    "register_type",
    "runtime_from_url",
]


def __getattr__(name: str) -> Any:
    # PostgresRuntime is imported on first use so that asyncpg stays an optional extra.
    if name == "PostgresRuntime":
        from .postgres import PostgresRuntime

        return PostgresRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
