"""Numbered schema migrations of the checkpoint table (component ``checkpoints``).

Append only: the position in :data:`MIGRATIONS` is the version; a retired migration becomes an
empty statement list, never a renumbering. Applied by ``loomflow.storage.apply_migrations``.
"""

from __future__ import annotations

from ..storage import Migration

__all__ = ["COMPONENT", "MIGRATIONS", "SCHEMA_VERSION"]

COMPONENT = "checkpoints"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "transcript snapshots per (session, user)",
        (
            # seq orders "newest first" exactly (ULIDs of one millisecond do not); the
            # scalar fields are columns so that operators can query them without decoding.
            """CREATE TABLE loom_checkpoints (
                seq            {serial},
                checkpoint_id  TEXT NOT NULL UNIQUE,
                scope          TEXT NOT NULL,
                user_key       TEXT NOT NULL,
                session_id     TEXT NOT NULL,
                user_id        TEXT,
                run_id         TEXT NOT NULL,
                epoch          {bigint} NOT NULL,
                turn           INTEGER NOT NULL,
                final          SMALLINT NOT NULL,
                prompt         TEXT NOT NULL,
                output         TEXT NOT NULL,
                prompt_index   INTEGER NOT NULL,
                tokens_in      {bigint} NOT NULL,
                tokens_out     {bigint} NOT NULL,
                cost_usd       {double} NOT NULL,
                parent_id      TEXT,
                codec_version  INTEGER NOT NULL,
                messages       {blob} NOT NULL,
                size           INTEGER NOT NULL,
                created_at     {double} NOT NULL
            )""",
            "CREATE INDEX loom_checkpoints_scope ON loom_checkpoints (scope, seq)",
            "CREATE INDEX loom_checkpoints_user ON loom_checkpoints (user_key)",
        ),
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)
