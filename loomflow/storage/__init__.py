"""Database plumbing shared by every store: connections, dialects, migrations, errors.

The journal, checkpoints, memory, budget and audit stores each keep their own SQL and their
own migration list, but they talk to SQLite and PostgreSQL through one :class:`Database`
object, so a store built next to a runtime reuses the runtime's connection (or pool).
"""

from __future__ import annotations

from ._database import Database, Transaction, translate_errors, unbounded
from ._dialect import POSTGRES, SQLITE, Dialect
from ._migrations import Migration, apply_migrations, require_schema, schema_versions
from ._postgres import PostgresDatabase
from ._roles import AppRoleGrant, grant_app_role
from ._sqlite import SqliteDatabase
from ._url import database_from_url

__all__ = [
    "AppRoleGrant",
    "Database",
    "Dialect",
    "Migration",
    "POSTGRES",
    "PostgresDatabase",
    "SQLITE",
    "SqliteDatabase",
    "Transaction",
    "apply_migrations",
    "database_from_url",
    "grant_app_role",
    "require_schema",
    "schema_versions",
    "translate_errors",
    "unbounded",
]
