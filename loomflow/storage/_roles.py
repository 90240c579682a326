"""The least-privilege PostgreSQL role an application runs as (``loomflow migrate --app-role``).

The role that runs the migrations owns the tables, and an owner (or a superuser) can switch
the audit log's triggers off, rewrite it and switch them back on. So the application should
connect as another role that owns nothing and holds only what its writes need:

- journal, checkpoints, memory and budget tables: ``SELECT, INSERT, UPDATE, DELETE``;
- ``loom_audit``: ``SELECT, INSERT`` (no ``UPDATE``, ``DELETE``, ``TRUNCATE``, ``TRIGGER``);
- ``loom_audit_heads`` and ``loom_schema_version``: ``SELECT`` (heads are moved by an insert
  trigger that runs as the owner, see ``loomflow.audit.migrations``);
- the tables' sequences: ``USAGE, SELECT``; the schema: ``USAGE``.

Every loomflow table in the schema is covered, so tables that later migrations add are
granted by running the command again after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigurationError, UserError
from ._database import Database

__all__ = ["AppRoleGrant", "app_role_problem", "grant_app_role"]

_READ_WRITE = "SELECT, INSERT, UPDATE, DELETE"
# Tables the application may not change freely; everything else named loom_* is read-write.
_RESTRICTED = {
    "loom_audit": "SELECT, INSERT",
    "loom_audit_heads": "SELECT",
    "loom_schema_version": "SELECT",
}


# Other roles the role belongs to (and so can act as, SET ROLE) that reach past any grant
# here: a superuser, one with CREATEROLE (see grant_app_role), and pg_write_all_data, which
# writes every table. The role's own attributes are checked apart, with their own messages.
_POWERFUL_GROUPS = (
    "SELECT rolname, rolsuper, rolcreaterole FROM pg_roles WHERE rolname <> $1 "
    "AND (rolsuper OR rolcreaterole OR rolname = 'pg_write_all_data') "
    "AND pg_has_role($1, oid, 'MEMBER') ORDER BY rolsuper DESC, rolcreaterole DESC LIMIT 1"
)


@dataclass(slots=True)
class AppRoleGrant:
    """What :func:`grant_app_role` did: the role, whether it was created (or, existing, given
    ``LOGIN``), and the grants."""

    role: str
    created: bool
    database: str
    schema: str
    grants: dict[str, str] = field(default_factory=dict)
    login_granted: bool = False


# Names PostgreSQL reserves, or that GRANT and ALTER read as something else when written
# unquoted (PUBLIC is every role; CURRENT_USER whoever runs the statement).
_RESERVED = frozenset({"public", "none", "current_user", "current_role", "session_user", "user"})


def app_role_problem(role: object) -> str | None:
    """Why ``role`` cannot be the application's role, or ``None`` when the name will do.

    Refused: an empty or too long name, control or other non-printable characters, a name
    PostgreSQL reserves (``pg_...``: the predefined roles such as ``pg_monitor`` or
    ``pg_read_all_data``, whose members would all be given write access to the tables) and
    the names that statements read as some other role (``public``, ``current_user``, ...).
    """
    if not isinstance(role, str) or not role.strip():
        return f"bad role name {role!r}: it is empty or blank"
    if len(role.encode()) > 63:
        return f"bad role name {role[:20]!r}...: at most 63 bytes (PostgreSQL cuts longer ones)"
    if not role.isprintable() or role != role.strip():
        return f"bad role name {role!r}: no control characters, nor spaces at its ends"
    if role.lower().startswith("pg_"):
        return (
            f"{role!r} is a reserved PostgreSQL role name (pg_...: the predefined roles, whose "
            "members would all be granted the application's access); name a role of your own"
        )
    if role.lower() in _RESERVED:
        return (
            f"{role!r} is a reserved PostgreSQL role name, or one that statements read as "
            "another role; name a role of your own"
        )
    return None


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def grant_app_role(db: Database, role: str, *, login: bool = False) -> AppRoleGrant:
    """Give ``role`` exactly what a loomflow application needs on this database's tables.

    Run it as the role that ran the migrations (the tables' owner), after them. A missing
    role is created, ``NOLOGIN`` unless ``login`` (then give it a password yourself, or let
    login roles inherit it: ``GRANT role TO app_user``); an existing ``NOLOGIN`` role is given
    ``LOGIN`` when ``login`` is asked for (never taken away without it). Whatever the role held
    on loomflow's tables before is revoked first, so running it again tightens a role granted
    too much.

    Raises:
        UserError: not PostgreSQL, a bad or reserved name (:func:`app_role_problem`), or a
            role that could undo the audit log's protection (the current role, a superuser,
            an owner of the tables, a role with ``CREATEROLE`` or in ``pg_write_all_data``).
    """
    if db.backend != "postgres":
        raise UserError("an application role needs PostgreSQL; SQLite has no roles")
    if (problem := app_role_problem(role)) is not None:
        raise UserError(problem)
    await db.open()
    quoted = _ident(role)
    async with db.transaction(what="app role grants") as tx:
        me, database, schema = (
            # The schema the search path finds the tables in, as the migrations and every
            # statement do (search_path=app2,app with the tables in app), else the current one.
            await tx.fetch(
                "SELECT current_user, current_database(), COALESCE((SELECT n.nspname FROM "
                "pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE c.oid = to_regclass('loom_schema_version')), current_schema())"
            )
        )[0]
        if schema is None:
            raise ConfigurationError("no current schema: check the connection's search_path")
        if role == me:
            raise UserError(
                f"{role!r} is the role running the migrations, which owns the tables; name "
                "another role for the application"
            )
        found = await tx.fetch(
            "SELECT rolsuper, rolcanlogin, rolcreaterole FROM pg_roles WHERE rolname = $1", role
        )
        created = not found
        login_granted = False
        if created:
            await tx.execute(f"CREATE ROLE {quoted} {'LOGIN' if login else 'NOLOGIN'}")
        elif found[0][0]:
            raise UserError(f"{role!r} is a superuser, which no trigger or grant can restrict")
        elif found[0][2]:
            raise UserError(
                f"{role!r} has CREATEROLE, with which (before PostgreSQL 16) it can make itself "
                "a member of the tables' owner and switch the audit triggers off; name a role "
                "without it"
            )
        elif login and not found[0][1]:
            # Asked for a role the application can sign in as: an existing NOLOGIN one would
            # otherwise be reported granted and still refuse every connection.
            await tx.execute(f"ALTER ROLE {quoted} LOGIN")
            login_granted = True
        relations = await tx.fetch(
            "SELECT c.relname, c.relkind, pg_has_role($1, c.relowner, 'MEMBER') "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = $2 AND c.relkind IN ('r', 'p', 'S') "
            "AND c.relname LIKE 'loom\\_%' ORDER BY c.relname",
            role,
            schema,
        )
        owned = [str(r[0]) for r in relations if r[2]]
        if owned:
            raise UserError(
                f"{role!r} owns (or is a member of the owner of) {', '.join(owned[:3])}: an "
                "owner can switch the audit triggers off; run the migrations as another role"
            )
        if groups := await tx.fetch(_POWERFUL_GROUPS, role):
            group, superuser, createrole = groups[0]
            if superuser:
                power = "a superuser, which no trigger or grant can restrict"
            elif createrole:
                power = "a role with CREATEROLE, as which it can switch the audit triggers off"
            else:
                power = (
                    "which writes every table whatever is granted here (an UPDATE of loom_audit "
                    "could erase payloads unrecorded)"
                )
            raise UserError(f"{role!r} is a member of {group}, {power}; name a role outside it")
        if not relations:
            raise UserError(f"no loomflow tables in schema {schema!r}: run the migrations first")
        await tx.execute(f"GRANT USAGE ON SCHEMA {_ident(schema)} TO {quoted}")
        grants: dict[str, str] = {}
        for name, kind, _owner in relations:
            target = f"{_ident(schema)}.{_ident(str(name))}"
            what = "SEQUENCE " if kind == "S" else ""
            await tx.execute(f"REVOKE ALL ON {what}{target} FROM {quoted}")
            privileges = "USAGE, SELECT" if kind == "S" else _RESTRICTED.get(str(name), _READ_WRITE)
            await tx.execute(f"GRANT {privileges} ON {what}{target} TO {quoted}")
            grants[str(name)] = privileges
    return AppRoleGrant(role, created, str(database), str(schema), grants, login_granted)
