"""Where the CLI's commands find their stores, and refusing ones that are not there."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._ids import user_label
from ..config import Settings, _masked_url
from ..errors import (
    ConfigurationError,
    CorruptEntryError,
    JournalError,
    MigrationError,
    StoreUnavailableError,
    UserError,
)
from ..runtime import JournalRuntime, SessionInfo
from ..storage._sqlite import read_text
from ..storage._url import sqlite_path

__all__ = ["existing", "migrate_command", "refuse_unready", "refuse_without", "session_of"]


def not_in_process(url: str, what: str) -> None:
    """Refuse a ``memory://`` store: it lives inside the process that made it, so a command
    started on its own would read, change or migrate a new, empty one and report success."""
    if url.startswith("memory:"):
        raise ConfigurationError(
            f"a memory:// {what} lives inside the process that made it, so a command cannot "
            "read or change it: point the command at the SQLite file or PostgreSQL database "
            "the application uses"
        )


def existing(url: str, what: str) -> str:
    """``url``, if it names a file that exists (or is not a file store at all).

    Commands that only read or tidy a store must not create an empty one at a mistyped path
    and then report that all is well (an ``audit verify`` cron job would pass on a typo).

    Raises:
        ConfigurationError: a SQLite or JSON-lines store whose file does not exist, or a
            ``memory://`` or SQLite ``:memory:`` store (it lives inside one process: a
            command started on its own would read an empty one, or write a hold or a
            cancellation that is gone at exit).
    """
    not_in_process(url, what)
    if url.startswith("jsonl://"):
        path: str | None = url.removeprefix("jsonl://")[1:]  # as audit_store_from_url reads it
    elif "://" not in url and url.endswith(".jsonl"):
        path = url
    else:
        path = sqlite_path(url)
    if path == ":memory:":
        raise ConfigurationError(
            f"a SQLite :memory: {what} lives inside the connection that made it, so a "
            "command would read a new, empty one: point the command at the SQLite file or "
            "PostgreSQL database the application uses"
        )
    if path is not None and not Path(path).exists():
        if url == Settings.model_fields["runtime_url"].default:
            # No --url and no LOOMFLOW_RUNTIME_URL: say how to name the journal a program wrote.
            raise ConfigurationError(
                f"no {what} at {path}, the default journal: name yours with --url "
                "(`loomflow --url sqlite:///journal.db ...`) or with LOOMFLOW_RUNTIME_URL"
            )
        where = path
        if not Path(path).is_absolute():
            # A relative URL is read from where the command runs, which need not be where
            # the application ran: say which file that was, so the mix-up is plain.
            where = f"{path} ({os.path.abspath(path)}: a relative path is read from the "
            where += "directory the command runs in)"
        raise ConfigurationError(
            f"no {what} at {where}: check the URL (a new store is made by `loomflow migrate` "
            "or by its first write)"
        )
    return url


async def session_of(
    runtime: JournalRuntime, session_id: str, user_id: str | None, *, anonymous: bool
) -> SessionInfo:
    """The (session, user) a command means: ``--user``, ``--anonymous``, or, with neither,
    the one user who ran that session id.

    Raises:
        JournalError: no such session (for that user).
        CorruptEntryError: several session rows of one user, none of them sound.
        UserError: several users ran that session id and none was named.
    """
    if anonymous:
        found = await runtime.sessions(user_id=None, session_id=session_id)
    elif user_id is not None:
        found = await runtime.sessions(user_id=user_id, session_id=session_id)
    else:
        found = await runtime.sessions(session_id=session_id)
    if not found:
        who = " without a user" if anonymous else ""
        if user_id is not None:
            who = f" of {user_label(user_id)}"
        raise JournalError(f"no session {session_id!r}{who} in the journal")
    if len(found) > 1 and len({s.user_id for s in found}) == 1:
        # Rows of one (session, user) under keys spelled otherwise: edited by hand, and
        # listed as unreadable. The row the runtime reads is the sound one.
        sound = [s for s in found if s.state != "unreadable"]
        if len(sound) == 1:
            return sound[0]
        raise CorruptEntryError(
            f"session {session_id!r} of {user_label(found[0].user_id)} has {len(found)} session "
            "rows, edited by hand (`runs list` marks them unreadable): repair loom_sessions"
        )
    if len(found) > 1:
        users = ", ".join(
            sorted({"(no user)" if s.user_id is None else repr(s.user_id) for s in found})
        )
        raise UserError(
            f"session {session_id!r} has runs of several users ({users}): "
            "pick one with --user (or --anonymous)"
        )
    return found[0]


# -- commands that read or tidy never change a schema --------------------------------------


def _latest_versions(dialect: str) -> dict[str, int]:
    """Each component's schema version this loomflow writes, on ``dialect``."""
    from ..audit.migrations import COMPONENT as AUDIT
    from ..audit.migrations import migrations_for
    from ..checkpoints.migrations import COMPONENT as CHECKPOINTS
    from ..checkpoints.migrations import MIGRATIONS as CHECKPOINT_M
    from ..governance.budget.migrations import COMPONENT as BUDGET
    from ..governance.budget.migrations import MIGRATIONS as BUDGET_M
    from ..memory.migrations import COMPONENT as MEMORY
    from ..memory.migrations import MIGRATIONS as MEMORY_M
    from ..runtime.migrations import COMPONENT as JOURNAL
    from ..runtime.migrations import MIGRATIONS as JOURNAL_M

    return {
        JOURNAL: len(JOURNAL_M),
        MEMORY: len(MEMORY_M),
        CHECKPOINTS: len(CHECKPOINT_M),
        BUDGET: len(BUDGET_M),
        AUDIT: len(migrations_for(dialect)),
    }


_VERSIONS = "SELECT component, MAX(version) FROM loom_schema_version GROUP BY component"
_LEGACY = ("journal_steps", "journal_streams")  # the tables of a loomflow 0.20 journal
# What a database holding a 0.20 journal and no store of this release answers instead of
# its versions.
_ONLY_0_20 = "0.20"


def _sqlite_versions(path: str) -> dict[str, Any] | str | None:
    """The versions in a SQLite file, read through a read-only connection (no WAL switch,
    no file made): ``"0.20"`` when it holds only a 0.20 journal, ``None`` when that cannot be
    told (the command then says why)."""
    if not Path(path).is_file():
        return None  # not there: the command's own check says so
    try:
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
        conn.text_factory = read_text
    except sqlite3.Error:
        return None
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "loom_schema_version" not in tables:
            return _ONLY_0_20 if tables & set(_LEGACY) else {}
        return {str(c): v for c, v in conn.execute(_VERSIONS)}
    except sqlite3.Error:
        return None
    finally:
        conn.close()


async def _connect(dsn: str, timeout_s: float) -> Any:
    """A connection for a look at the schema, or ``None`` when the command's own open should
    say why there is none (refused, no such database, a DSN asyncpg rejects).

    Bounded by ``LOOMFLOW_POSTGRES_TIMEOUT_SECONDS`` like every other wait on the server: a
    host that takes the connection and never answers is reported here, once, rather than
    waited for twice (this look, then the command's own open).

    Raises:
        StoreUnavailableError: the server did not answer within the timeout.
    """
    import asyncpg

    # 0 means "no limit" for statements; a connection that never comes is still given up on
    # after asyncpg's own 60 s, as the command's open would.
    timeout = timeout_s or 60.0
    try:
        return await asyncpg.connect(dsn, timeout=timeout)
    except TimeoutError:
        raise StoreUnavailableError(
            f"postgres connect failed: PostgreSQL at {_masked_url(dsn)!r} did not answer within "
            f"{timeout:g}s (LOOMFLOW_POSTGRES_TIMEOUT_SECONDS): the server may be paused, "
            "overloaded or cut off"
        ) from None
    except Exception:  # unreachable or a DSN asyncpg refuses: the command's open says why
        return None


async def _postgres_versions(dsn: str, timeout_s: float) -> dict[str, Any] | str | None:
    try:
        import asyncpg
    except ImportError:
        return None
    conn = await _connect(dsn, timeout_s)
    if conn is None:
        return None
    try:
        found = await conn.fetchval("SELECT to_regclass('loom_schema_version') IS NOT NULL")
        if not found:
            legacy = await conn.fetchval(
                "SELECT count(*) FROM unnest($1::text[]) AS t(name) "
                "WHERE to_regclass(t.name) IS NOT NULL",
                list(_LEGACY),
            )
            return _ONLY_0_20 if legacy else {}
        return {str(r[0]): r[1] for r in await conn.fetch(_VERSIONS)}
    except asyncpg.PostgresError:
        return None
    finally:
        await conn.close()


async def _versions_of(
    url: str, timeout_s: float
) -> tuple[dict[str, Any] | str | None, str] | None:
    """The schema versions in the database ``url`` names (see :func:`_sqlite_versions`) and
    its dialect; ``None`` for a store that is no SQL database (JSON lines, memory)."""
    if url.startswith(("postgresql://", "postgres://")):
        return await _postgres_versions(url, timeout_s), "postgres"
    path = sqlite_path(url) if not url.endswith(".jsonl") else None
    if path is None or path == ":memory:":
        return None
    return await asyncio.to_thread(_sqlite_versions, path), "sqlite"


def migrate_command(args: argparse.Namespace) -> str:
    """The ``loomflow migrate`` that reaches the stores a command was pointed at.

    A bare one reads only the settings, so it would migrate (or create) the default journal
    rather than the ``--url`` given: the URLs given on the command line are repeated, and a
    ``--budget-url``, which ``migrate`` does not take, becomes its variable.
    """
    command = ["loomflow", "migrate"]
    for option, name in (("--url", "url"), ("--audit-url", "audit_url")):
        if url := getattr(args, name, None):
            command += [option, shlex.quote(_masked_url(url))]
    shown = " ".join(command)
    if budget := getattr(args, "budget_url", None):
        shown = f"LOOMFLOW_BUDGET_URL={shlex.quote(_masked_url(budget))} {shown}"
    return shown


async def refuse_unready(
    urls: Sequence[str | None], timeout_s: float, migrate: str = "loomflow migrate"
) -> None:
    """Refuse databases a command that only reads or tidies would otherwise change: one
    that holds no loomflow store (another application's database, an empty file), and one
    whose schema is older than this loomflow's (upgrading it is ``loomflow migrate``'s job,
    done when every worker runs the new release, not a side effect of a listing).

    Raises:
        ConfigurationError: no loomflow store is in the database.
        MigrationError: a store's schema is behind this release, or the database holds only
            a loomflow 0.20 journal (``migrate`` creates this release's tables beside it and,
            with ``--import-0.20``, carries its runs over).

    ``migrate`` is the command the messages name: :func:`migrate_command`'s, which reaches
    the stores the refused command was pointed at.
    """
    for url in dict.fromkeys(u for u in urls if u):
        read = await _versions_of(url, timeout_s)
        if read is None:
            continue
        versions, dialect = read
        if versions is None:
            continue
        shown = _masked_url(url)
        if versions == _ONLY_0_20:
            raise MigrationError(
                f"{shown!r} holds a loomflow 0.20 journal and no store of this release: run "
                f"`{migrate} --import-0.20` once every worker runs this release, to add "
                "this release's tables and import its runs (docs/operations/upgrading.md); "
                "other commands add no tables to a database"
            )
        if not versions and (tables := await _lost_versions(url, dialect, timeout_s)):
            raise _versions_lost(shown, tables)
        if not versions:
            raise ConfigurationError(
                f"{shown!r} holds no loomflow store yet: check the URL, or run `{migrate}` "
                "first to create one (other commands add no tables to a database)"
            )
        assert isinstance(versions, dict)
        latest = _latest_versions(dialect)
        for component, version in sorted(versions.items()):
            if type(version) is int and component in latest and version < latest[component]:
                raise MigrationError(
                    f"the {component} schema in {shown!r} is at version {version} and this "
                    f"loomflow needs {latest[component]}: run `{migrate}` once every "
                    "worker runs this release (other commands never change a schema)"
                )


async def refuse_without(
    url: str | None, component: str, what: str, timeout_s: float, migrate: str = "loomflow migrate"
) -> None:
    """Refuse a database that holds loomflow stores but not ``component``, for a command
    that reads or writes it (``audit query``, the console, ``users hold``): opening it would
    create its tables, an empty store where the operator expected theirs (a forgotten
    ``--audit-url`` or ``LOOMFLOW_AUDIT_URL``, say)."""
    if not url:
        return
    read = await _versions_of(url, timeout_s)  # None: the JSON-lines log, memory
    versions = None if read is None else read[0]
    if isinstance(versions, dict) and versions and component not in versions:
        raise ConfigurationError(
            f"{_masked_url(url)!r} holds no {what}: check the URL (--audit-url, or "
            f"LOOMFLOW_AUDIT_URL when the log is kept elsewhere), or run `{migrate}` to "
            "create one there (other commands add no tables)"
        )


# -- a store whose version rows are gone -------------------------------------------------------

# Every loomflow table is named loom_*; the version table itself says nothing here.
_LOOM_TABLES = "loom\\_%"


def _sqlite_loom_tables(path: str) -> list[str]:
    try:
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
        conn.text_factory = read_text
    except sqlite3.Error:
        return []
    try:
        return [
            str(r[0])
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE ? "
                "ESCAPE '\\' AND name <> 'loom_schema_version' ORDER BY name",
                (_LOOM_TABLES,),
            )
        ]
    except sqlite3.Error:
        return []
    finally:
        conn.close()


async def _postgres_loom_tables(dsn: str, timeout_s: float) -> list[str]:
    import asyncpg

    conn = await _connect(dsn, timeout_s)
    if conn is None:
        return []
    try:
        rows = await conn.fetch(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') "
            "AND c.relname LIKE $1 AND c.relname <> 'loom_schema_version' ORDER BY 1",
            _LOOM_TABLES,
        )
        return [str(r[0]) for r in rows]
    except asyncpg.PostgresError:
        return []
    finally:
        await conn.close()


async def _lost_versions(url: str, dialect: str, timeout_s: float) -> list[str]:
    """The loomflow tables of a database whose version table records nothing (read only on
    that path): they were migrated once, so the version rows were lost, not never written."""
    if dialect == "postgres":
        return await _postgres_loom_tables(url, timeout_s)
    path = sqlite_path(url)
    return [] if path is None else await asyncio.to_thread(_sqlite_loom_tables, path)


def _versions_lost(shown: str, tables: Sequence[str]) -> MigrationError:
    named = ", ".join(tables[:4]) + (", ..." if len(tables) > 4 else "")
    return MigrationError(
        f"{shown!r} holds loomflow tables ({named}) but loom_schema_version records no "
        "schema version: the version table lost its rows (edited, or restored apart from the "
        "tables); restore them from a backup (`loomflow migrate` refuses until then, and "
        "other commands never change a schema)"
    )
