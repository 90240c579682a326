"""Numbered schema migrations of the audit tables (component ``audit``).

Append only: the position in the list is the version. SQLite and PostgreSQL share the tables
and differ only in how the database itself refuses edits (trigger syntax, and TRUNCATE, which
only PostgreSQL has), so each dialect gets its own list of the same length.
"""

from __future__ import annotations

from ..storage import Migration

__all__ = ["COMPONENT", "SCHEMA_VERSION", "migrations_for"]

COMPONENT = "audit"

# The payload is TEXT holding the canonical JSON, not JSONB: JSONB rewrites numbers (1e20
# comes back as 100000000000000000000), and the hash must be re-derivable from what is stored.
_TABLES = (
    """CREATE TABLE loom_audit (
        id              {serial},
        user_key        TEXT NOT NULL,
        user_id         TEXT,
        seq             {bigint} NOT NULL,
        time_us         {bigint} NOT NULL,
        session_id      TEXT,
        run_id          TEXT,
        actor           TEXT NOT NULL,
        action          TEXT NOT NULL,
        payload         TEXT NOT NULL,
        schema_version  INTEGER NOT NULL,
        prev_hash       TEXT NOT NULL,
        hash            TEXT NOT NULL,
        UNIQUE (user_key, seq)
    )""",
    # Each filter the query API offers has an index ending in id, the page order, so one
    # user's page is an index range scan however many entries other users have.
    "CREATE INDEX loom_audit_user ON loom_audit (user_key, id)",
    "CREATE INDEX loom_audit_user_time ON loom_audit (user_key, time_us)",
    "CREATE INDEX loom_audit_user_action ON loom_audit (user_key, action, id)",
    "CREATE INDEX loom_audit_session ON loom_audit (session_id, id)",
    "CREATE INDEX loom_audit_run ON loom_audit (run_id, id)",
    "CREATE INDEX loom_audit_action ON loom_audit (action, id)",
    "CREATE INDEX loom_audit_time ON loom_audit (time_us)",
    # The head of every chain, written in the same transaction as the entry: it is what
    # reveals a truncated tail, which a hash chain alone cannot.
    """CREATE TABLE loom_audit_heads (
        user_key  TEXT PRIMARY KEY,
        user_id   TEXT,
        seq       {bigint} NOT NULL,
        hash      TEXT NOT NULL
    )""",
)

_SQLITE_GUARDS = (
    """CREATE TRIGGER loom_audit_no_update BEFORE UPDATE ON loom_audit
    BEGIN SELECT RAISE(ABORT, 'loom_audit is append-only: UPDATE is refused'); END""",
    """CREATE TRIGGER loom_audit_no_delete BEFORE DELETE ON loom_audit
    BEGIN SELECT RAISE(ABORT, 'loom_audit is append-only: DELETE is refused'); END""",
    """CREATE TRIGGER loom_audit_heads_no_delete BEFORE DELETE ON loom_audit_heads
    BEGIN SELECT RAISE(ABORT, 'loom_audit_heads only moves forward: DELETE is refused'); END""",
    """CREATE TRIGGER loom_audit_heads_forward BEFORE UPDATE ON loom_audit_heads
    WHEN NEW.seq <= OLD.seq
    BEGIN SELECT RAISE(ABORT, 'loom_audit_heads only moves forward'); END""",
)

_POSTGRES_GUARDS = (
    """CREATE FUNCTION loom_audit_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'loom_audit is append-only: % is refused', TG_OP
            USING ERRCODE = 'insufficient_privilege';
    END $$""",
    """CREATE TRIGGER loom_audit_no_update_delete BEFORE UPDATE OR DELETE ON loom_audit
    FOR EACH ROW EXECUTE FUNCTION loom_audit_refuse()""",
    """CREATE TRIGGER loom_audit_no_truncate BEFORE TRUNCATE ON loom_audit
    FOR EACH STATEMENT EXECUTE FUNCTION loom_audit_refuse()""",
    """CREATE FUNCTION loom_audit_heads_forward() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'UPDATE' AND NEW.seq > OLD.seq AND NEW.user_key = OLD.user_key THEN
            RETURN NEW;
        END IF;
        RAISE EXCEPTION 'loom_audit_heads only moves forward: % is refused', TG_OP
            USING ERRCODE = 'insufficient_privilege';
    END $$""",
    """CREATE TRIGGER loom_audit_heads_forward BEFORE UPDATE OR DELETE ON loom_audit_heads
    FOR EACH ROW EXECUTE FUNCTION loom_audit_heads_forward()""",
    """CREATE TRIGGER loom_audit_heads_no_truncate BEFORE TRUNCATE ON loom_audit_heads
    FOR EACH STATEMENT EXECUTE FUNCTION loom_audit_heads_forward()""",
)

_DESCRIPTION = "audit entries with per-user chains and heads; edits refused by triggers"

_MIGRATIONS = {
    "sqlite": (Migration(_DESCRIPTION, _TABLES + _SQLITE_GUARDS),),
    "postgres": (Migration(_DESCRIPTION, _TABLES + _POSTGRES_GUARDS),),
}

SCHEMA_VERSION = 1


def migrations_for(dialect: str) -> tuple[Migration, ...]:
    """The audit migrations of a dialect (``"sqlite"`` or ``"postgres"``)."""
    return _MIGRATIONS[dialect]
