"""Numbered schema migrations, per component, recorded in one version table.

Each store (journal, checkpoints, memory, budget, audit) owns an append-only list of
:class:`Migration`; its position in the list is its version. A retired migration becomes an
empty statement list, never a renumbering. Each migration runs in its own transaction under a
cluster-wide lock and re-reads the version inside it, so concurrent migrators apply it once.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import MigrationError, StorageError
from ._database import Database, Transaction, unbounded

__all__ = [
    "Migration",
    "apply_migrations",
    "check_schema",
    "expected_schema",
    "require_schema",
    "schema_versions",
]

_VERSION_TABLE = (
    "CREATE TABLE IF NOT EXISTS loom_schema_version ("
    "component TEXT NOT NULL, version INTEGER NOT NULL, description TEXT NOT NULL, "
    "applied_at {double} NOT NULL, PRIMARY KEY (component, version))"
)


@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step: DDL statements with ``{blob}``-style type hooks."""

    description: str
    statements: tuple[str, ...]


# One advisory lock for every component, since the version table is created under it too.
_LOCK_KEY = zlib.crc32(b"loomflow-migrations")


async def _ensure_version_table(db: Database, tx: Transaction) -> None:
    # Look before creating: ``CREATE TABLE IF NOT EXISTS`` still needs CREATE on the schema,
    # which the least-privilege application role (``loomflow migrate --app-role``) lacks.
    if db.backend == "postgres":
        found = "SELECT to_regclass('loom_schema_version') IS NOT NULL"
    else:
        found = "SELECT COUNT(*) > 0 FROM sqlite_master WHERE name = 'loom_schema_version'"
    if not (await tx.fetch(found))[0][0]:
        await tx.execute(db.dialect.ddl(_VERSION_TABLE))


async def _version(db: Database, tx: Transaction, component: str) -> int:
    await _ensure_version_table(db, tx)
    rows = await tx.fetch(
        "SELECT MAX(version) FROM loom_schema_version WHERE component = $1", component
    )
    return _stored_version(rows[0][0], component)


async def apply_migrations(db: Database, component: str, migrations: Sequence[Migration]) -> int:
    """Bring ``component``'s tables up to date; return the version now in place.

    The migrations themselves are exempt from the statement timeout: building an index over
    a big table may take a while, and the migration lock keeps others waiting meanwhile.
    """
    latest = len(migrations)
    # Most opens find the schema current. Reading the version takes no lock, so a process that
    # holds SQLite's write lock (busy, or stopped by SIGSTOP) does not block a mere open; the
    # write lock and the advisory lock are taken only when there is something to apply.
    current = await _read_version(db, component)
    if current == latest:
        return current
    if current > latest:
        raise MigrationError(
            f"the {component} schema is at version {current}, newer than this loomflow knows "
            f"({latest}); upgrade loomflow"
        )
    with unbounded():
        try:
            return await _apply(db, component, migrations)
        except StorageError as exc:
            refusal = exc.__cause__
            if refusal is None or getattr(refusal, "sqlstate", None) != "42501":
                raise  # 42501: insufficient_privilege
            raise await _not_allowed(db, component, current, latest, refusal) from refusal


async def _not_allowed(
    db: Database, component: str, current: int, latest: int, refusal: BaseException
) -> MigrationError:
    """The error for a role that may not apply a migration: a least-privilege role
    (``--app-role``) left on automatic migration meets a release with a new migration, or a
    first migration runs as a role without CREATE. No outage to retry: a deploy step."""
    try:
        who = f"the role {(await db.fetch('SELECT current_user', what='schema read'))[0][0]!r}"
    except StorageError:
        who = "this role"
    if current == 0:
        fix = "as a role with CREATE on the schema (the database's owner, say)"
    else:
        fix = "as the role that owns them (docs/operations/postgresql.md#roles)"
    return MigrationError(
        f"the {component} schema is at version {current} and this loomflow needs {latest}, "
        f"but {who} may not {'create' if current == 0 else 'change'} loomflow's tables "
        f"({refusal}): run `loomflow migrate` {fix}; an application role keeps "
        "LOOMFLOW_AUTO_MIGRATE=false, so that it only checks the schema"
    )


async def _apply(db: Database, component: str, migrations: Sequence[Migration]) -> int:
    latest = len(migrations)
    for version, migration in enumerate(migrations, start=1):
        async with db.transaction(lock_key=_LOCK_KEY, what="migration") as tx:
            current = await _version(db, tx, component)
            if current > latest:
                raise MigrationError(
                    f"the {component} schema is at version {current}, newer than this loomflow "
                    f"knows ({latest}); upgrade loomflow"
                )
            if current >= version:
                continue
            for statement in migration.statements:
                if (there := await _already_there(db, tx, statement)) is not None:
                    raise MigrationError(
                        f"loom_schema_version records the {component} schema at version "
                        f"{current}, but {there}, which migration {version} "
                        f"({migration.description}) adds, already exists: the version table "
                        f"lost rows (edited, or restored apart from the tables); restore its "
                        f"rows for component {component!r} from a backup before opening"
                    )
            for statement in migration.statements:
                await tx.execute(db.dialect.ddl(statement))
            await tx.execute(
                "INSERT INTO loom_schema_version (component, version, description, applied_at)"
                " VALUES ($1, $2, $3, {now})",
                component,
                version,
                migration.description,
            )
    async with db.transaction(lock_key=_LOCK_KEY, what="migration") as tx:
        current = await _version(db, tx, component)
    if current > latest:
        raise MigrationError(
            f"the {component} schema is at version {current}, newer than this loomflow knows "
            f"({latest}); upgrade loomflow"
        )
    return current


_CREATES = re.compile(r"\s*CREATE\s+TABLE\s+(?!IF\s)(\w+)", re.IGNORECASE)
_ADDS = re.compile(r"\s*ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(?!IF\s)(\w+)", re.IGNORECASE)


async def _already_there(db: Database, tx: Transaction, statement: str) -> str | None:
    """The table or column ``statement`` adds, if the database has it already: the schema is
    further along than the version table says, and running the statement would fail with an
    error ("table exists") that reads like an outage."""
    postgres = db.backend == "postgres"
    if (create := _CREATES.match(statement)) is not None:
        table = create.group(1)
        sql = (
            "SELECT to_regclass($1) IS NOT NULL"
            if postgres
            else "SELECT COUNT(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = $1"
        )
        return f"table {table}" if (await tx.fetch(sql, table))[0][0] else None
    if (add := _ADDS.match(statement)) is not None:
        table, column = add.group(1), add.group(2)
        sql = (
            # The table the search path resolves the name to, as every statement does.
            "SELECT COUNT(*) > 0 FROM pg_attribute WHERE attrelid = to_regclass($1) "
            "AND attname = $2 AND attnum > 0 AND NOT attisdropped"
            if postgres
            else "SELECT COUNT(*) > 0 FROM pragma_table_info($1) WHERE name = $2"
        )
        return f"column {table}.{column}" if (await tx.fetch(sql, table, column))[0][0] else None
    return None


async def schema_versions(db: Database) -> dict[str, int]:
    """Every component's schema version in this database."""
    async with db.transaction(what="schema read") as tx:
        await _ensure_version_table(db, tx)
        rows = await tx.fetch(
            "SELECT component, MAX(version) FROM loom_schema_version GROUP BY component"
        )
    return {str(r[0]): _stored_version(r[1], str(r[0])) for r in rows}


async def _read_version(db: Database, component: str) -> int:
    """``component``'s schema version, read without any lock (0 if nothing is there yet)."""
    if db.backend == "postgres":
        found = "SELECT to_regclass('loom_schema_version') IS NOT NULL"
    else:
        found = "SELECT COUNT(*) > 0 FROM sqlite_master WHERE name = 'loom_schema_version'"
    if not (await db.fetch(found, what="schema read"))[0][0]:
        return 0
    rows = await db.fetch(
        "SELECT MAX(version) FROM loom_schema_version WHERE component = $1",
        component,
        what="schema read",
    )
    return _stored_version(rows[0][0], component)


def _stored_version(value: object, component: str) -> int:
    """A version read back from ``loom_schema_version`` (untrusted: SQLite keeps any type)."""
    if value is None:
        return 0
    if type(value) is not int or value < 0:
        raise MigrationError(
            f"the {component} schema version in loom_schema_version is {value!r}, not a "
            f"version number: the table was edited; restore its rows for component "
            f"{component!r} (each applied migration's number) from a backup"
        )
    return value


def _migrate_command(db: Database) -> str:
    """The ``loomflow migrate`` that reaches ``db``: a bare one migrates the default journal
    (``.loomflow/journal.db``), not the file or database the application named."""
    path = getattr(db, "path", None)
    if path is not None and str(path) != ":memory:":
        return f"loomflow migrate --url sqlite:///{os.path.abspath(path)}"
    dsn = getattr(db, "shown_dsn", None)
    return "loomflow migrate" if dsn is None else f"loomflow migrate --url {dsn}"


async def require_schema(db: Database, component: str, migrations: Sequence[Migration]) -> None:
    """Check, without changing anything, that ``component``'s tables are at the version this
    loomflow expects (for stores opened with ``auto_migrate=False``).

    Raises:
        MigrationError: the schema is behind (run ``loomflow migrate``) or ahead (upgrade).
    """
    current = await _read_version(db, component)
    latest = len(migrations)
    if current < latest:
        raise MigrationError(
            f"the {component} schema is at version {current} and this loomflow needs {latest}; "
            f"automatic migration is off (LOOMFLOW_AUTO_MIGRATE=false), so run "
            f"`{_migrate_command(db)}` first"
        )
    if current > latest:
        raise MigrationError(
            f"the {component} schema is at version {current}, newer than this loomflow knows "
            f"({latest}); upgrade loomflow"
        )


# -- the tables, columns and triggers the migrations leave behind --------------------------------

_CREATE_TABLE = re.compile(
    r"\s*CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)\s*\((.*)\)\s*$", re.IGNORECASE | re.DOTALL
)
_CREATE_TRIGGER = re.compile(
    r"\s*CREATE\s+(?:OR\s+REPLACE\s+)?TRIGGER\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.IGNORECASE
)
_DROP_TRIGGER = re.compile(r"\s*DROP\s+TRIGGER\s+(?:IF\s+EXISTS\s+)?(\w+)", re.IGNORECASE)
# What an item of a table definition starts with when it is a constraint, not a column.
_NOT_COLUMNS = frozenset({"PRIMARY", "UNIQUE", "CHECK", "FOREIGN", "CONSTRAINT", "EXCLUDE"})


def _items(body: str) -> list[str]:
    """The comma-separated items of the body of a table definition (commas inside
    parentheses kept)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(body):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
    items.append(body[start:])
    return [item.strip() for item in items if item.strip()]


def expected_schema(migrations: Sequence[Migration]) -> dict[str, int]:
    """What the migrations leave in the database, each with the migration that made it:
    ``"table t"``, ``"column t.c"`` and ``"trigger g"``."""
    found: dict[str, int] = {}
    for version, migration in enumerate(migrations, start=1):
        for statement in migration.statements:
            if (table := _CREATE_TABLE.match(statement)) is not None:
                name = table.group(1).lower()
                found[f"table {name}"] = version
                for item in _items(table.group(2)):
                    column = item.split()[0]
                    if column.upper() not in _NOT_COLUMNS:
                        found[f"column {name}.{column.lower()}"] = version
            elif (add := _ADDS.match(statement)) is not None:
                found[f"column {add.group(1).lower()}.{add.group(2).lower()}"] = version
            elif (trigger := _CREATE_TRIGGER.match(statement)) is not None:
                found[f"trigger {trigger.group(1).lower()}"] = version
            elif (dropped := _DROP_TRIGGER.match(statement)) is not None:
                found.pop(f"trigger {dropped.group(1).lower()}", None)
    return found


async def _present_schema(db: Database, tables: Sequence[str]) -> set[str]:
    """The tables (of ``tables``), their columns and every trigger on them.

    On PostgreSQL each name is resolved through the search path, as the version table and
    every statement resolve it, not looked up in ``current_schema()`` alone: with
    ``search_path=app2,app`` and the tables in ``app``, they are there for everything else."""
    present: set[str] = set()
    if db.backend == "postgres":
        columns = await db.fetch(
            "SELECT t.name, a.attname FROM unnest($1::text[]) AS t(name) "
            "JOIN pg_attribute a ON a.attrelid = to_regclass(t.name) "
            "WHERE a.attnum > 0 AND NOT a.attisdropped",
            list(tables),
            what="schema read",
        )
        triggers = await db.fetch(
            "SELECT g.tgname FROM unnest($1::text[]) AS t(name) "
            "JOIN pg_trigger g ON g.tgrelid = to_regclass(t.name) WHERE NOT g.tgisinternal",
            list(tables),
            what="schema read",
        )
    else:
        columns = []
        for table in tables:
            columns += [
                (table, row[0])
                for row in await db.fetch(
                    "SELECT name FROM pragma_table_info($1)", table, what="schema read"
                )
            ]
        triggers = await db.fetch(
            "SELECT name FROM sqlite_master WHERE type = 'trigger'", what="schema read"
        )
    for table, column in columns:
        present.add(f"table {str(table).lower()}")
        present.add(f"column {str(table).lower()}.{str(column).lower()}")
    present.update(f"trigger {str(row[0]).lower()}" for row in triggers)
    return present


async def check_schema(db: Database, component: str, migrations: Sequence[Migration]) -> None:
    """Check that every table, column and trigger ``component``'s migrations made is there.

    The version table can say a schema is current while the tables themselves were changed
    behind loomflow's back (a table dropped by hand, a restore of some tables only): every
    run would then fail on a missing table with an error that reads like an outage.

    Raises:
        MigrationError: something the migrations made is missing; names what and which
            migration made it.
    """
    expected = expected_schema(migrations)
    tables = sorted({key.split(" ", 1)[1] for key in expected if key.startswith("table ")})
    missing = [key for key in expected if key not in await _present_schema(db, tables)]
    if not missing:
        return
    # A missing table's columns go without saying.
    gone = {key.split(" ", 1)[1] for key in missing if key.startswith("table ")}
    shown = [
        f"{key} (migration {expected[key]})"
        for key in missing
        if not (key.startswith("column ") and key.split(" ", 1)[1].split(".")[0] in gone)
    ]
    raise MigrationError(
        f"loom_schema_version records the {component} schema as current, but "
        f"{', '.join(shown)} {'is' if len(shown) == 1 else 'are'} missing: the database was "
        "changed outside loomflow (dropped by hand, or restored in part); restore it from a "
        "backup"
    )
