"""Numbered schema migrations of the audit tables (component ``audit``).

Append only: the position in the list is the version. SQLite and PostgreSQL share the tables
and differ only in how the database itself refuses edits (trigger syntax, and TRUNCATE, which
only PostgreSQL has), so each dialect gets its own list of the same length.
"""

from __future__ import annotations

from ..storage import Migration
from ._entry import GENESIS

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

# Version 2: the database, not the writer, moves a user's head, from the entry being inserted,
# and refuses an entry that does not extend the head (seq + 1, prev_hash = the head's hash).
# So the application role needs no write access to the heads at all (``loomflow migrate
# --app-role`` grants it SELECT only): it cannot move, fork or erase a head, only append an
# entry that chains on. On PostgreSQL the trigger function runs as the tables' owner
# (SECURITY DEFINER) with a search_path pinned to the schema it was created in, pg_temp last,
# so an application role's own objects cannot stand in for the tables.
_SQLITE_CHAIN = (
    f"""CREATE TRIGGER loom_audit_chain BEFORE INSERT ON loom_audit
    WHEN NEW.seq IS NOT COALESCE(
            (SELECT seq FROM loom_audit_heads WHERE user_key = NEW.user_key), 0) + 1
        OR NEW.prev_hash IS NOT COALESCE(
            (SELECT hash FROM loom_audit_heads WHERE user_key = NEW.user_key), '{GENESIS}')
    BEGIN SELECT RAISE(ABORT, 'loom_audit: an entry must extend its user''s chain head'); END""",
    """CREATE TRIGGER loom_audit_move_head AFTER INSERT ON loom_audit
    BEGIN
        INSERT INTO loom_audit_heads (user_key, user_id, seq, hash)
        VALUES (NEW.user_key, NEW.user_id, NEW.seq, NEW.hash)
        ON CONFLICT (user_key) DO UPDATE SET seq = excluded.seq, hash = excluded.hash;
    END""",
)

# format() fills in the schema; its own "%" are doubled.
_POSTGRES_CHAIN = (
    f"""DO $do$ BEGIN EXECUTE format($fn$
    CREATE FUNCTION loom_audit_chain() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = %I, pg_temp AS $body$
    DECLARE
        head_seq BIGINT;
        head_hash TEXT;
    BEGIN
        SELECT seq, hash INTO head_seq, head_hash FROM loom_audit_heads
            WHERE user_key = NEW.user_key FOR UPDATE;
        IF NOT FOUND THEN
            head_seq := 0;
            head_hash := '{GENESIS}';
        END IF;
        IF NEW.seq IS DISTINCT FROM head_seq + 1 OR NEW.prev_hash IS DISTINCT FROM head_hash THEN
            RAISE EXCEPTION 'loom_audit: entry %% of %% does not extend its chain head (seq %%)',
                NEW.seq, NEW.user_key, head_seq USING ERRCODE = 'integrity_constraint_violation';
        END IF;
        INSERT INTO loom_audit_heads (user_key, user_id, seq, hash)
            VALUES (NEW.user_key, NEW.user_id, NEW.seq, NEW.hash)
            ON CONFLICT (user_key) DO UPDATE SET seq = excluded.seq, hash = excluded.hash;
        RETURN NEW;
    END $body$ $fn$, current_schema()); END $do$""",
    "REVOKE ALL ON FUNCTION loom_audit_chain() FROM PUBLIC",
    """CREATE TRIGGER loom_audit_chain BEFORE INSERT ON loom_audit
    FOR EACH ROW EXECUTE FUNCTION loom_audit_chain()""",
)

_CHAIN = "heads moved by the database from each inserted entry, which must extend the head"

# Version 3: each entry records how its hash is computed (1: Python's json.dumps spelling, the
# only one before; 2: RFC 8785). Rows already stored are version 1, which the constant default
# says without touching them: on both databases, adding a column with a constant default
# rewrites no row, so no UPDATE trigger fires and a large trail migrates at once. The insert
# trigger of version 2 reads only NEW.seq, NEW.prev_hash and the heads, so it is unaffected.
_HASH_VERSION = ("ALTER TABLE loom_audit ADD COLUMN hash_version INTEGER NOT NULL DEFAULT 1",)

_HASHES = "per-entry hash version (2: RFC 8785 canonical JSON); existing entries are version 1"

# Version 4: erasure. New entries (hash version 3) keep a salted digest of their payload in
# ``payload_digest``, which is what their hash covers, and the salt in ``payload_salt``; an
# erased payload is the text ``null`` with no salt. The UPDATE guard is replaced by one that
# lets an UPDATE through only when it erases a payload and changes nothing else. The
# application role still cannot erase: it holds no UPDATE privilege on loom_audit, so only the
# tables' owner can (``loomflow users forget``, ``loomflow audit retain``). DELETE and TRUNCATE
# stay refused to everyone the triggers bind.
_DIGEST_COLUMNS = (
    "ALTER TABLE loom_audit ADD COLUMN payload_digest TEXT",
    "ALTER TABLE loom_audit ADD COLUMN payload_salt TEXT",
)
_UNCHANGED = (
    "id",
    "user_key",
    "user_id",
    "seq",
    "time_us",
    "session_id",
    "run_id",
    "actor",
    "action",
    "schema_version",
    "prev_hash",
    "hash",
    "hash_version",
    "payload_digest",
)
_SQLITE_ERASE_ONLY = (
    *_DIGEST_COLUMNS,
    "DROP TRIGGER loom_audit_no_update",
    f"""CREATE TRIGGER loom_audit_no_update BEFORE UPDATE ON loom_audit
    WHEN NOT (NEW.payload = 'null' AND NEW.payload_salt IS NULL AND
        {" AND ".join(f"NEW.{c} IS OLD.{c}" for c in _UNCHANGED)})
    BEGIN SELECT RAISE(ABORT,
        'loom_audit is append-only: UPDATE is refused (erasing a payload is the one exception)');
    END""",
)
_POSTGRES_ERASE_ONLY = (
    *_DIGEST_COLUMNS,
    f"""CREATE FUNCTION loom_audit_erase_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.payload = 'null' AND NEW.payload_salt IS NULL
            AND ({", ".join(f"NEW.{c}" for c in _UNCHANGED)})
            IS NOT DISTINCT FROM ({", ".join(f"OLD.{c}" for c in _UNCHANGED)}) THEN
            RETURN NEW;
        END IF;
        RAISE EXCEPTION
            'loom_audit is append-only: UPDATE is refused (erasing a payload is the one exception)'
            USING ERRCODE = 'insufficient_privilege';
    END $$""",
    "DROP TRIGGER loom_audit_no_update_delete ON loom_audit",
    """CREATE TRIGGER loom_audit_no_delete BEFORE DELETE ON loom_audit
    FOR EACH ROW EXECUTE FUNCTION loom_audit_refuse()""",
    """CREATE TRIGGER loom_audit_erase_only BEFORE UPDATE ON loom_audit
    FOR EACH ROW EXECUTE FUNCTION loom_audit_erase_only()""",
)

_ERASURE = "payload digests (hash version 3); an UPDATE may only erase a payload"

_MIGRATIONS = {
    "sqlite": (
        Migration(_DESCRIPTION, _TABLES + _SQLITE_GUARDS),
        Migration(_CHAIN, _SQLITE_CHAIN),
        Migration(_HASHES, _HASH_VERSION),
        Migration(_ERASURE, _SQLITE_ERASE_ONLY),
    ),
    "postgres": (
        Migration(_DESCRIPTION, _TABLES + _POSTGRES_GUARDS),
        Migration(_CHAIN, _POSTGRES_CHAIN),
        Migration(_HASHES, _HASH_VERSION),
        Migration(_ERASURE, _POSTGRES_ERASE_ONLY),
    ),
}

SCHEMA_VERSION = 4


def migrations_for(dialect: str) -> tuple[Migration, ...]:
    """The audit migrations of a dialect (``"sqlite"`` or ``"postgres"``)."""
    return _MIGRATIONS[dialect]
