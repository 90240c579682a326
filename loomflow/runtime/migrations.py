"""Numbered schema migrations of the journal tables (component ``journal``).

Append only: the position in :data:`MIGRATIONS` is the version; a retired migration becomes an
empty statement list, never a renumbering. Applied by ``loomflow.storage.apply_migrations``.
"""

from __future__ import annotations

from ..storage import Migration

__all__ = ["COMPONENT", "MIGRATIONS", "SCHEMA_VERSION"]

COMPONENT = "journal"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "journal entries, sessions with epochs and ownership, idempotency keys",
        (
            """CREATE TABLE loom_sessions (
                scope        TEXT PRIMARY KEY,
                session_id   TEXT,
                user_id      TEXT,
                epoch        {bigint} NOT NULL DEFAULT 0,
                open         SMALLINT NOT NULL DEFAULT 0,
                owner        TEXT,
                token        {bigint} NOT NULL DEFAULT 0,
                lease_until  {double} NOT NULL DEFAULT 0,
                updated_at   {double} NOT NULL
            )""",
            "CREATE INDEX loom_sessions_session ON loom_sessions (session_id)",
            "CREATE INDEX loom_sessions_user ON loom_sessions (user_id)",
            """CREATE TABLE loom_entries (
                scope          TEXT NOT NULL,
                epoch          {bigint} NOT NULL,
                path           TEXT NOT NULL,
                name           TEXT NOT NULL,
                fingerprint    TEXT NOT NULL,
                kind           TEXT NOT NULL,
                format         TEXT NOT NULL,
                codec_version  INTEGER NOT NULL,
                value          {blob} NOT NULL,
                size           INTEGER NOT NULL,
                seq            INTEGER NOT NULL,
                created_at     {double} NOT NULL,
                PRIMARY KEY (scope, epoch, path, name, fingerprint)
            )""",
            "CREATE INDEX loom_entries_created ON loom_entries (created_at)",
            """CREATE TABLE loom_idempotency (
                user_key       TEXT NOT NULL,
                idem_key       TEXT NOT NULL,
                scope          TEXT NOT NULL,
                name           TEXT NOT NULL,
                kind           TEXT NOT NULL,
                format         TEXT NOT NULL,
                codec_version  INTEGER NOT NULL,
                value          {blob} NOT NULL,
                size           INTEGER NOT NULL,
                created_at     {double} NOT NULL,
                PRIMARY KEY (user_key, idem_key)
            )""",
        ),
    ),
    Migration(
        "run records for recovery: agent name, configuration fingerprint, inputs, attempts, "
        "last error and the run's final status (interrupted, failed, cancelled)",
        (
            "ALTER TABLE loom_sessions ADD COLUMN agent TEXT",
            "ALTER TABLE loom_sessions ADD COLUMN config TEXT",
            "ALTER TABLE loom_sessions ADD COLUMN record {blob}",
            "ALTER TABLE loom_sessions ADD COLUMN status TEXT",
            "ALTER TABLE loom_sessions ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE loom_sessions ADD COLUMN last_error TEXT",
            "ALTER TABLE loom_sessions ADD COLUMN retry_at {double} NOT NULL DEFAULT 0",
            "ALTER TABLE loom_sessions ADD COLUMN created_at {double} NOT NULL DEFAULT 0",
            # A sweep reads open runs only: with 10,000 finished sessions it must not scan them.
            "CREATE INDEX loom_sessions_open ON loom_sessions (retry_at) WHERE open = 1",
        ),
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)
