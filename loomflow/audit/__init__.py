"""The per-user audit log: who ran what, what was allowed or denied and why, what replayed.

Entries carry ``user_id`` as a top-level field and form one hash chain per user, with a
gap-free sequence; ``verify()`` finds edits, deletions, reordering and truncation. Backends:
:class:`InMemoryAuditStore`, :class:`JsonlAuditStore`, :class:`SqliteAuditStore` and
:class:`PostgresAuditStore` (append-only in the database itself). Plug it into an agent with
``Agent(audit=AuditLog(...))``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import actions
from ._entry import ENTRY_SCHEMA_VERSION, GENESIS, HASH_VERSION, AuditEntry, AuditRecord
from ._log import AuditHooks, AuditLog
from ._sql import SqlAuditStore
from ._store import (
    ANY_USER,
    AuditPage,
    AuditStore,
    ChainHead,
    ChainProblem,
    VerifyReport,
    damaged_row,
)
from ._url import audit_store_beside, audit_store_for, audit_store_from_url
from .inmemory import InMemoryAuditStore
from .jsonl import JsonlAuditStore
from .offline import heads_from_json, verify_lines
from .redaction import Redactor, install_log_redaction
from .sqlite import SqliteAuditStore

if TYPE_CHECKING:
    from .postgres import PostgresAuditStore

__all__ = [
    "ANY_USER",
    "AuditEntry",
    "AuditHooks",
    "AuditLog",
    "AuditPage",
    "AuditRecord",
    "AuditStore",
    "ChainHead",
    "ChainProblem",
    "ENTRY_SCHEMA_VERSION",
    "GENESIS",
    "HASH_VERSION",
    "InMemoryAuditStore",
    "JsonlAuditStore",
    "PostgresAuditStore",
    "Redactor",
    "SqlAuditStore",
    "SqliteAuditStore",
    "VerifyReport",
    "actions",
    "audit_store_beside",
    "audit_store_for",
    "audit_store_from_url",
    "damaged_row",
    "heads_from_json",
    "install_log_redaction",
    "verify_lines",
]


def __getattr__(name: str) -> Any:
    # PostgresAuditStore is imported on first use so that asyncpg stays an optional extra.
    if name == "PostgresAuditStore":
        from .postgres import PostgresAuditStore

        return PostgresAuditStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
