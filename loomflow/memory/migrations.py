"""Numbered schema migrations of the memory tables (component ``memory``).

Append only: the position in :data:`MIGRATIONS` is the version; a retired migration becomes an
empty statement list, never a renumbering. Applied by ``loomflow.storage.apply_migrations``.
"""

from __future__ import annotations

from ..storage import Migration

__all__ = ["COMPONENT", "MIGRATIONS", "SCHEMA_VERSION"]

COMPONENT = "memory"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "episodes, bitemporal facts and working blocks, partitioned by user",
        (
            # user_key is the injective JSON encoding of the user id (None included), so every
            # lookup is one equality on an indexed column, never an IS NULL special case.
            """CREATE TABLE loom_memory_episodes (
                seq            {serial},
                episode_id     TEXT NOT NULL UNIQUE,
                user_key       TEXT NOT NULL,
                scope          TEXT NOT NULL,
                session_id     TEXT NOT NULL,
                user_id        TEXT,
                episode_key    TEXT NOT NULL,
                run_id         TEXT,
                epoch          {bigint},
                output         TEXT NOT NULL,
                codec_version  INTEGER NOT NULL,
                messages       {blob} NOT NULL,
                created_at     {double} NOT NULL,
                updated_at     {double} NOT NULL,
                UNIQUE (user_key, episode_key)
            )""",
            "CREATE INDEX loom_memory_episodes_scope ON loom_memory_episodes (scope, epoch)",
            """CREATE TABLE loom_memory_facts (
                seq            {serial},
                fact_id        TEXT NOT NULL UNIQUE,
                user_key       TEXT NOT NULL,
                user_id        TEXT,
                subject        TEXT NOT NULL,
                predicate      TEXT NOT NULL,
                object         TEXT NOT NULL,
                source         TEXT,
                valid_from     {double} NOT NULL,
                valid_to       {double},
                superseded_by  TEXT
            )""",
            # At most one current fact per (user, subject, predicate), whatever the callers do.
            "CREATE UNIQUE INDEX loom_memory_facts_current ON loom_memory_facts "
            "(user_key, subject, predicate) WHERE valid_to IS NULL",
            "CREATE INDEX loom_memory_facts_lookup ON loom_memory_facts "
            "(user_key, subject, predicate, valid_from)",
            """CREATE TABLE loom_memory_blocks (
                user_key    TEXT NOT NULL,
                name        TEXT NOT NULL,
                user_id     TEXT,
                content     TEXT NOT NULL,
                created_at  {double} NOT NULL,
                updated_at  {double} NOT NULL,
                PRIMARY KEY (user_key, name)
            )""",
        ),
    ),
    Migration(
        "index the user_id of memory rows, for a user's export and erasure",
        (
            # An export or an erasure also takes rows that name the user under another key
            # ((user_key = ? OR user_id = ?)): without these, each scanned the whole table.
            "CREATE INDEX loom_memory_episodes_user ON loom_memory_episodes (user_id)",
            "CREATE INDEX loom_memory_facts_user ON loom_memory_facts (user_id)",
            "CREATE INDEX loom_memory_blocks_user ON loom_memory_blocks (user_id)",
        ),
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)
