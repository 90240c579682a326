"""Numbered schema migrations of the budget tables (component ``budget``).

Append only: the position in :data:`MIGRATIONS` is the version; a retired migration becomes an
empty statement list, never a renumbering. Applied by ``loomflow.storage.apply_migrations``.
"""

from __future__ import annotations

from ...storage import Migration

__all__ = ["COMPONENT", "MIGRATIONS", "SCHEMA_VERSION"]

COMPONENT = "budget"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "budget buckets (spent and held totals) and the reservations of calls in flight",
        (
            """CREATE TABLE loom_budget_buckets (
                bucket                 TEXT PRIMARY KEY,
                scope                  TEXT NOT NULL,
                user_id                TEXT,
                period                 TEXT NOT NULL,
                tokens_in              {bigint} NOT NULL DEFAULT 0,
                tokens_out             {bigint} NOT NULL DEFAULT 0,
                cost_nanousd           {bigint} NOT NULL DEFAULT 0,
                wall_s                 {double} NOT NULL DEFAULT 0,
                calls                  {bigint} NOT NULL DEFAULT 0,
                reserved_in            {bigint} NOT NULL DEFAULT 0,
                reserved_out           {bigint} NOT NULL DEFAULT 0,
                reserved_cost_nanousd  {bigint} NOT NULL DEFAULT 0,
                updated_at             {double} NOT NULL
            )""",
            "CREATE INDEX loom_budget_buckets_user ON loom_budget_buckets (user_id)",
            """CREATE TABLE loom_budget_reservations (
                id             TEXT PRIMARY KEY,
                owner          TEXT NOT NULL,
                buckets        TEXT NOT NULL,
                tokens_in      {bigint} NOT NULL,
                tokens_out     {bigint} NOT NULL,
                cost_nanousd   {bigint} NOT NULL,
                on_expiry      TEXT NOT NULL,
                created_at     {double} NOT NULL,
                expires_at     {double} NOT NULL
            )""",
            "CREATE INDEX loom_budget_reservations_expiry ON loom_budget_reservations (expires_at)",
            "CREATE INDEX loom_budget_reservations_owner ON loom_budget_reservations (owner)",
        ),
    ),
    Migration(
        "reservations name the run that holds them (NULL in holds made before: shown unknown)",
        ("ALTER TABLE loom_budget_reservations ADD COLUMN run_id TEXT",),
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)
