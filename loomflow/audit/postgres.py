"""The audit log in PostgreSQL, append-only in the database itself."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import ErasureRefusedError
from ..storage import PostgresDatabase
from ._sql import SqlAuditStore

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PostgresAuditStore"]

log = logging.getLogger("loomflow.audit")

# (database, role) pairs already warned about in this process: once is enough.
_warned: set[tuple[str, str]] = set()

_WRITER = """
SELECT current_database(), current_user, r.rolsuper, pg_has_role(current_user, c.relowner, 'MEMBER')
FROM pg_roles r, pg_class c
WHERE r.rolname = current_user AND c.oid = to_regclass('loom_audit')
"""


class PostgresAuditStore(SqlAuditStore):
    """Audit entries in PostgreSQL, shared by every worker process.

    UPDATE and DELETE of an entry are refused by a row trigger and TRUNCATE by a statement
    trigger; heads are moved by the database, forward only. Build it from a DSN, an asyncpg
    pool (which stays yours), or a runtime's ``database`` to share its pool.

    The triggers bind every role but the tables' owner and superusers, who can switch them
    off: connect as a role made with ``loomflow migrate --app-role``. The first append
    through a store connected as an owner or a superuser logs a warning, once per database and
    role in a process; reading the trail does not, nor do erasure and retention, which must
    run as the owner.
    """

    def __init__(
        self,
        dsn_or_pool: str | asyncpg.Pool | PostgresDatabase,
        *,
        min_size: int = 1,
        max_size: int = 10,
        auto_migrate: bool = True,
    ) -> None:
        self._role_checked = False
        if isinstance(dsn_or_pool, PostgresDatabase):
            super().__init__(dsn_or_pool, owns_db=False, auto_migrate=auto_migrate)
            return
        db = PostgresDatabase(dsn_or_pool, min_size=min_size, max_size=max_size)
        super().__init__(db, owns_db=True, auto_migrate=auto_migrate)

    async def _before_write(self) -> None:
        if self._role_checked:
            return
        self._role_checked = True
        rows = await self.db.fetch(_WRITER, what="audit role check")
        if not rows:
            return
        database, role, superuser, owner = rows[0]
        if not (superuser or owner) or (database, role) in _warned:
            return
        _warned.add((database, role))
        log.warning(
            "the audit log in database %r is written by role %r, which %s: it can switch the "
            "append-only triggers off and rewrite the trail unseen. Connect the application as "
            "a least-privilege role (loomflow migrate --app-role NAME; see docs/security.md)",
            database,
            role,
            "is a superuser" if superuser else "owns the audit tables",
        )

    async def check_can_erase(self) -> None:
        # Erasure must run as the owner: its own appends (the erasure records) are not the
        # application writing as one, so they are not warned of.
        self._role_checked = True
        await self.open()
        rows = await self.db.fetch(
            "SELECT current_user, has_table_privilege('loom_audit', 'UPDATE')",
            what="audit erasure check",
        )
        role, allowed = rows[0]
        if not allowed:
            raise ErasureRefusedError(
                f"role {role!r} may not erase audit payloads (it has no UPDATE on loom_audit, "
                "as the least-privilege application role should not): run erasure and "
                "retention as the role that owns the audit tables"
            )
