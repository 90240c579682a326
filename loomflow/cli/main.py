"""Command-line entry point.

Exit codes scripts can rely on: 0 success, 1 a loomflow error (message on stderr),
2 bad usage, 3 an audit query or export written past damaged audit rows (each named on
stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import errno
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pydantic import SecretStr

from .. import __version__
from .._ids import check_id
from ..config import (
    _URL_SETTINGS,
    Settings,
    _check_store_url,
    _masked_url,
    env_file_variables,
    lower_scheme,
)
from ..errors import (
    ConfigurationError,
    CorruptEntryError,
    LoomflowError,
    NewerEntryError,
    UserError,
)
from ..runtime import RUN_STATES, EntryInfo, JournalRuntime, SessionInfo
from ..runtime._states import UNREADABLE
from ..runtime._store import path_key
from ..storage._roles import app_role_problem
from ..stores import SCHEMES, Stores
from ._format import (
    exception_line,
    id_cell,
    iso_time,
    login,
    one_line,
    positive_int,
    printable,
    prune_age,
    some_path,
    table,
    table_time,
    user_cell,
    who,
)
from ._progress import add_no_progress, progress_bar
from ._stores import (
    existing,
    migrate_command,
    not_in_process,
    refuse_unready,
    refuse_without,
    session_of,
)
from ._upgrade import legacy_note, quiet_on_open


class _Parser(argparse.ArgumentParser):
    """argparse's parser, naming a missing command by the commands there are: argparse says
    "the following arguments are required: runs_command", the name the code reads it by."""

    given: Sequence[str] = ()  # the command line main() parses, for error()

    def error(self, message: str) -> NoReturn:
        if message.startswith(_REQUIRED):
            missing = message.removeprefix(_REQUIRED).split(", ")
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and action.dest in missing:
                    message = f"choose a command: {', '.join(action.choices)}"
        if message.startswith(_MISSING) or message.endswith(_NO_VALUE):
            message += self._dash_hint(message)
        super().error(message)

    def _dash_hint(self, message: str) -> str:
        """A hint for an id that starts with "-" (a user "-x"): argparse reads it as an
        unknown option and then reports the id as missing, never naming the token."""
        for token in self.given:
            if token == "--":
                break
            if self._unknown_option(token):
                if message.endswith(_NO_VALUE):  # "argument -o/--output: expected ..."
                    option = message.split(":")[0].split("/")[-1].removeprefix("argument ")
                    return (
                        f" ({token!r} starts with '-', so it was read as an option: "
                        f"write {option}={token})"
                    )
                return (
                    f" ({token!r} starts with '-', so it was read as an option: give the "
                    f"options first and the id after '--', as in {self.prog} ... -- {token})"
                )
        return ""

    def _unknown_option(self, token: str) -> bool:
        """Whether argparse read ``token`` as an option it does not know. By its rules "-"
        (stdout, for -o), a negative number and a token with a space are values, and the
        start of a known option (``--js``, ``-oFILE``) is that option."""
        if not token.startswith("-") or token == "-" or " " in token:
            return False
        name = token.split("=", 1)[0]
        known = self._option_string_actions
        if name in known or token[:2] in known or self._negative_number_matcher.match(token):
            return False
        return not (name.startswith("--") and any(o.startswith(name) for o in known))


_REQUIRED = "the following arguments are required: "
_MISSING = ("the following arguments are required: ", "one of the arguments ")
_NO_VALUE = ": expected one argument"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loomflow", description="Durable, governed and observable agent runs.")
    parser.add_argument("--version", action="version", version=f"loomflow {__version__}")
    parser.add_argument("--url", help=_URL_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="crash a worker mid-run, resume it, show the replay")
    demo.add_argument("--postgres", metavar="DSN", help="run the story on PostgreSQL")
    demo.add_argument("--workdir", type=some_path, help="keep the journal and ledger here")
    demo.add_argument(
        "--kill-after",
        type=positive_int,
        default=3,
        help="kill the worker before this model turn: 1-3 with the scripted model (3)",
    )
    demo.add_argument(
        "--model",
        help="a provider's model, e.g. anthropic:claude-sonnet-4-5 or openai:gpt-5-mini "
        "(needs its API key; default: the offline scripted model)",
    )

    shown = sub.add_parser("settings", help="the effective LOOMFLOW_* settings (secrets hidden)")
    shown.add_argument("--json", action="store_true", help="one JSON object for scripts")

    migrate = sub.add_parser(
        "migrate",
        help="apply pending schema migrations: journal, checkpoints, memory, budget, audit",
    )
    migrate.add_argument(
        "--audit-url", help="the audit store (default: LOOMFLOW_AUDIT_URL, else the journal's)"
    )
    migrate.add_argument(
        "--import-0.20",
        dest="import_0_20",
        action="store_true",
        help="also import a loomflow 0.20 journal found in the database (its tables are only "
        "read), so its finished steps replay and its open runs resume",
    )
    migrate.add_argument(
        "--app-role",
        metavar="NAME",
        help="PostgreSQL: grant this role (created NOLOGIN if missing) only what the "
        "application needs; audit entries can then only be appended (docs/security.md)",
    )
    migrate.add_argument(
        "--app-login",
        action="store_true",
        help="with --app-role: the role may log in (created with LOGIN, or given it)",
    )

    runs = sub.add_parser("runs", help="inspect journaled runs").add_subparsers(
        dest="runs_command", required=True
    )
    listing = runs.add_parser("list", help="sessions in the journal, most recent first")
    who = listing.add_mutually_exclusive_group()
    who.add_argument("--user", dest="user_id", help="only this user's sessions")
    who.add_argument("--anonymous", action="store_true", help="only sessions without a user")
    listing.add_argument("--limit", type=positive_int, default=50, help="at most N (50)")
    listing.add_argument("--json", action="store_true", help="JSON lines for scripts")
    listing.add_argument(
        "--state",
        choices=(*RUN_STATES, "unreadable"),
        help="only runs in this state (running, orphaned, open, finished, ...)",
    )
    cancel = runs.add_parser(
        "cancel",
        help="cancel a session's open run (it stops at its next step, wherever it runs) or "
        "its interrupted one (one waiting for approval is then never resumed)",
    )
    cancel.add_argument("session_id")
    who = cancel.add_mutually_exclusive_group()
    who.add_argument(
        "--user", dest="user_id", help="whose run (needed when several users share the id)"
    )
    who.add_argument("--anonymous", action="store_true", help="the run without a user")
    cancel.add_argument(
        "--audit-url", help="the audit store (default: LOOMFLOW_AUDIT_URL, else the journal's)"
    )
    cancel.add_argument("--json", action="store_true")
    show = runs.add_parser("show", help="a session's journal entries")
    show.add_argument("session_id")
    who = show.add_mutually_exclusive_group()
    who.add_argument(
        "--user", dest="user_id", help="whose run (needed when several users share the id)"
    )
    who.add_argument("--anonymous", action="store_true", help="the run without a user")
    show.add_argument("--json", action="store_true", help="JSON lines for scripts")

    journal = sub.add_parser("journal", help="journal maintenance").add_subparsers(
        dest="journal_command", required=True
    )
    prune = journal.add_parser("prune", help="delete entries of finished runs")
    prune.add_argument(
        "--older-than",
        type=prune_age,
        help=(
            "e.g. 7d, 12h (default: LOOMFLOW_JOURNAL_RETENTION_DAYS; unset: any age, once "
            "--session, --user or --all says which runs)"
        ),
    )
    prune.add_argument("--session", dest="session_id")
    prune.add_argument("--user", dest="user_id")
    prune.add_argument("--include-open", action="store_true", help="also delete open runs")
    prune.add_argument(
        "--all",
        dest="everything",
        action="store_true",
        help="with no other filter: every finished run, whatever its age",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
    )
    prune.add_argument(
        "--batch-size",
        type=positive_int,
        default=5000,
        help="rows deleted per statement, each its own short transaction (5000)",
    )
    prune.add_argument("--json", action="store_true")
    add_no_progress(prune)

    for module in _command_modules():
        module.register(sub)
    _urls_after_commands(parser)
    return parser


_URL_HELP = "journal URL (default: LOOMFLOW_RUNTIME_URL or sqlite:///.loomflow/journal.db)"
# The store options a command group takes before its command (`loomflow --url ...`,
# `loomflow audit --audit-url ...`, `loomflow budget --budget-url ...`).
_GROUP_URLS = ("url", "audit_url", "budget_url")
# Commands that open no store a URL names: their refusal of --url says why (see _command).
_NO_URL = {
    "demo": "demo takes no --url: it makes a journal of its own, in --workdir (SQLite) or in "
    "the database --postgres names",
    "worker": "worker takes no --url: it recovers the journal of the agents APP registers "
    "(their runtime decides where it is)",
}


def _urls_after_commands(
    parser: argparse.ArgumentParser, inherited: tuple[argparse.Action, ...] = ()
) -> None:
    """Accept a group's store options after its commands too (``loomflow runs list --url
    ...``, ``loomflow budget reclaim --budget-url ...``), where people put them once they
    have typed the command. Suppressed as defaults, so one given before the command is kept
    when none comes after it; the later one wins."""
    options = inherited + tuple(
        a for a in parser._actions if a.dest in _GROUP_URLS and a.option_strings
    )
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for name, command in action.choices.items():
            for option in options:
                if any(o in command._option_string_actions for o in option.option_strings):
                    continue  # the command's own (migrate --audit-url)
                hidden = option.dest == "url" and name in _NO_URL  # refused, not offered
                command.add_argument(
                    *option.option_strings,
                    dest=option.dest,
                    default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS if hidden else option.help,
                )
            _urls_after_commands(command, options)


# Command groups that live in their own modules (audit, budget, checkpoints, ...): each has
# ``register(subparsers)`` adding its parser with ``set_defaults(handler=...)``, where the
# handler is ``async def handler(args) -> int``.
_PLUGINS = ("approvals", "audit", "budget", "checkpoints", "console", "users", "worker")


def _command_modules() -> list[Any]:
    import importlib

    modules = []
    for name in _PLUGINS:
        try:
            modules.append(importlib.import_module(f"loomflow.cli.{name}"))
        except ModuleNotFoundError as exc:
            if exc.name != f"loomflow.cli.{name}":
                raise
    return modules


# Drivers whose warnings a command shows too. asyncpg's pool logs each failed reconnection
# while the database is away ("Failed to restore the pool connection floor"), with a
# traceback: through Python's last-resort handler that was some twenty lines a time, between
# the CLI's one-line warnings.
_DRIVER_LOGGERS = ("asyncpg",)


def _log_warnings_to_stderr() -> None:
    """The library logs to a NullHandler; the CLI is an application, so its warnings show
    (and those of the drivers it uses), one line each."""
    logger = logging.getLogger("loomflow")
    if logging.getLogger().handlers or any(isinstance(h, _CliLogHandler) for h in logger.handlers):
        return  # the embedding application (or a test harness) set up logging itself
    handler = _CliLogHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    for name in ("loomflow", *_DRIVER_LOGGERS):
        logging.getLogger(name).addHandler(handler)


class _CliLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """One line a record, as the CLI's own errors: the exception a record carries is named
    with its message (``sweep failed ...: StoreUnavailableError: ...``), never as a
    traceback, and whatever the line quotes is escaped. A driver's record names the driver
    (``loomflow: warning: asyncpg: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        origin = record.name.partition(".")[0]
        where = "" if origin == "loomflow" else f"{printable(origin)}: "
        line = f"loomflow: {record.levelname.lower()}: {where}{printable(record.getMessage())}"
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            return f"{line}: {exception_line(exc)}"
        # A record scrubbed by the log redaction keeps only the exception's line, redacted.
        scrubbed = getattr(record, "exc_line", None)
        return f"{line}: {one_line(scrubbed)}" if isinstance(scrubbed, str) else line


# Options of some command groups only (``migrate``/``runs cancel``/``audit``/``console`` take
# --audit-url, ``budget`` --budget-url): before the group, argparse read the URL after one as
# the command ("invalid choice: 'sqlite:///audit.db'").
_GROUP_OPTIONS = ("--audit-url", "--budget-url")


def _misplaced_option(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    commands = {
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    }
    for token in argv:
        if token in commands:
            return None
        option = token.split("=", 1)[0]
        if option in _GROUP_OPTIONS:
            group = "budget" if option == "--budget-url" else "audit"
            return (
                f"{option} goes after its command group, not before it: e.g. loomflow "
                f"{group} {option} URL ... (only --url goes before the command)"
            )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    given = list(sys.argv[1:] if argv is None else argv)
    if (problem := _misplaced_option(parser, given)) is not None:
        parser.error(problem)
    _Parser.given = given
    args = parser.parse_args(given)
    _log_warnings_to_stderr()
    try:
        code = _command(args)
        sys.stdout.flush()  # a full disk under stdout is reported here, not at exit
        return code
    except LoomflowError as exc:
        # One line, whatever the message quotes: a reason or id read from a store may hold
        # line breaks or terminal escapes.
        print(f"loomflow: error: {printable(exc)}", file=sys.stderr)
        return 1
    except UnicodeDecodeError as exc:  # a .env saved as UTF-16 or Latin-1
        print(f"loomflow: error: a file read is not UTF-8 text (a .env saved as UTF-16?): {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    except ImportError as exc:
        if "pip install 'loomflow[" not in str(exc):
            raise
        print(f"loomflow: error: {exc}", file=sys.stderr)  # an optional extra is missing
        return 1
    except BrokenPipeError:
        # The reader went away (`loomflow ... | head`): stop quietly, as other tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:
        if exc.filename is not None:
            # `-o` into a directory that does not exist, a file without permission, ...
            print(f"loomflow: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        elif exc.errno in _WRITE_FAILURES:  # a full disk under -o or stdout
            _drop_pending_output()
            print(f"loomflow: error: the output could not be written: {exc.strerror}",
                  file=sys.stderr)  # fmt: skip
        else:
            raise  # not about the output or a path the user gave: a bug, shown in full
        return 1
    except KeyboardInterrupt:
        return 130


# Errors of a write that are the output's place, not loomflow: a full disk or quota, a file
# too large, a read-only filesystem, a device error.
_WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def _drop_pending_output() -> None:
    """Point stdout at /dev/null, so that what could not be written is not retried (and
    failed again, as a traceback) when the interpreter flushes it at exit."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _command(args: argparse.Namespace) -> int:
    """Run the parsed command; ``main`` turns what it raises into one line and an exit code."""
    # Every command reads the settings (the demo's worker too): a bad LOOMFLOW_* value is
    # reported here, in one line, before anything runs.
    settings = Settings()
    if args.command in _NO_URL and args.url is not None:
        print(f"loomflow: error: {_NO_URL[args.command]}", file=sys.stderr)
        return 2
    _check_text_args(args)
    _check_urls(args)
    # A deletion without --yes is bad usage, said before any database is looked at (a
    # journal without an audit log answered exit 1, as if --yes would have been enough).
    unconfirmed = getattr(args, "unconfirmed", None)
    why = unconfirmed(args) if unconfirmed is not None else None
    if why:
        print(f"loomflow: error: {why}", file=sys.stderr)
        return 2
    if args.command not in _CHANGES_SCHEMAS and not getattr(args, "hash_token", False):
        migrate = migrate_command(args)  # what the refusals tell the user to run
        timeout_s = settings.postgres_timeout_seconds
        asyncio.run(refuse_unready(_databases(args, settings), timeout_s, migrate))
        # They never create an audit log: a hold placed in an empty one made beside the
        # journal (a forgotten LOOMFLOW_AUDIT_URL) is one the real log never has, and an
        # erasure checked against one finds none of the real log's holds.
        if _uses_audit_log(args):
            journal = args.url or settings.runtime_url
            audit = getattr(args, "audit_url", None) or settings.audit_url or journal
            asyncio.run(refuse_without(audit, "audit", "audit log", timeout_s, migrate))
    if args.command == "demo":
        if args.postgres is not None and not args.postgres.startswith(_POSTGRES):
            # Anything else would run the story somewhere other than the report says.
            print(
                "loomflow: error: --postgres takes a postgresql:// DSN, not "
                f"{_masked_url(args.postgres)!r} (without --postgres the demo uses SQLite)",
                file=sys.stderr,
            )
            return 2
        from .demo import run_demo

        return run_demo(
            postgres=args.postgres,
            workdir=args.workdir,
            stop_after=args.kill_after,
            model=args.model,
        )
    if args.command == "settings":
        return _show_settings(args)
    handler = getattr(args, "handler", None)
    if handler is not None:
        return int(asyncio.run(handler(args)))
    return asyncio.run(_dispatch(args))


def _uses_audit_log(args: argparse.Namespace) -> bool:
    """Whether the command reads the audit log, places, lifts or lists legal holds in it,
    or deletes a user's data as its holds allow (`audit verify --file` reads a file)."""
    if args.command in ("audit", "console"):
        return getattr(args, "file", None) is None
    if args.command == "journal":  # prune keeps the held users' runs
        return getattr(args, "journal_command", None) == "prune"
    if args.command == "checkpoints":
        return getattr(args, "checkpoints_command", None) == "forget"
    return args.command == "users" and args.users_command in ("hold", "release", "holds", "forget")


# The commands that create or upgrade tables: the others read or tidy a store and must not
# change the schema of a database they are pointed at (another application's, an old one).
_CHANGES_SCHEMAS = ("migrate", "demo", "worker", "settings")


def _databases(args: argparse.Namespace, settings: Settings) -> list[str | None]:
    """The store URLs a command may open: its own options first, then the settings."""
    journal = args.url or settings.runtime_url
    audit = getattr(args, "audit_url", None) or settings.audit_url
    budget = getattr(args, "budget_url", None) or settings.budget_url
    if args.command == "audit":
        return [audit or journal]
    if args.command == "budget":
        return [budget or journal]
    return [journal, audit, budget]


_POSTGRES = ("postgresql://", "postgres://")
# The URL options of the commands, and the stores they may name.
_URL_OPTIONS = {
    "url": ("--url", SCHEMES["journal"]),
    "audit_url": ("--audit-url", SCHEMES["audit"]),
    "budget_url": ("--budget-url", SCHEMES["budget"]),
    "postgres": ("--postgres", ("postgresql", "postgres")),
}


def _check_text_args(args: argparse.Namespace) -> None:
    """Refuse an argument that is not text (bytes that are not UTF-8, kept by Python as lone
    surrogates): no store can hold it, and the driver would fail with a traceback. Session
    and user ids get the SDK's own rule, so an empty, overlong or control-character id is
    named as such instead of being looked up (and echoed back whole) as "no session"."""
    for value in vars(args).values():
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise UserError(f"the argument {value!r} is not valid UTF-8 text") from None
    for dest in _ID_ARGUMENTS:
        value = getattr(args, dest, None)
        if isinstance(value, str):
            check_id(dest, value)


_ID_ARGUMENTS = ("session_id", "user_id")


def _check_urls(args: argparse.Namespace) -> None:
    """A store URL given on the command line is checked as the same setting would be."""
    for dest, (option, schemes) in _URL_OPTIONS.items():
        url = getattr(args, dest, None)
        if url is None:
            continue
        # SQLITE:// or POSTGRESQL:// is the store's scheme too; in lower case from here on, so
        # that the checks against creating a store where none is see it for what it is.
        setattr(args, dest, url := lower_scheme(url))
        if dest == "postgres" and not url.startswith(_POSTGRES):
            continue
        if url.startswith("memory:"):
            continue  # a valid store, refused by each command that would open it, with why
        try:
            # memory:// is not offered: no command can open a store in another process.
            _check_store_url(url, tuple(s for s in schemes if s != "memory"), option)
        except ValueError as exc:
            raise ConfigurationError(f"{option}: {exc}") from None


# Values that may carry credentials: shown only as set or not.
_SECRET_SETTINGS = ("redact_secrets", "otlp_headers")


def _show_settings(args: argparse.Namespace) -> int:
    settings = Settings()  # which logs the LOOMFLOW_* variables that name no setting
    _warn_incomplete(settings)
    in_environment = {variable.upper() for variable in os.environ}
    config = Settings.model_config
    in_env_file = {
        variable.upper()
        for variable, _ in env_file_variables(
            config.get("env_file"), config.get("env_file_encoding") or "utf-8"
        )
    }
    rows: list[tuple[Any, ...]] = [("variable", "value", "from")]
    document = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr) and value.get_secret_value():
            value = "(set, hidden)"  # every secret field (console token, keys), by its type
        elif name in _SECRET_SETTINGS or name in _URL_SETTINGS:  # otlp_endpoint is a URL too
            value = _masked(name, value)
        source = "default"
        if name in settings.model_fields_set:
            # The environment wins over .env, as the settings read them.
            variable = f"LOOMFLOW_{name.upper()}"
            source = (
                "environment"
                if variable in in_environment
                else ".env"
                if variable in in_env_file
                else "environment or .env"
            )
        if name == "runtime_url" and args.url is not None:
            # `loomflow --url X settings`: what the other commands would use is X.
            value, source = _masked(name, args.url), "--url"
        document[name] = {"value": value, "from": source}
        rows.append((f"LOOMFLOW_{name.upper()}", json.dumps(value), source))
    if args.json:
        print(json.dumps(document))
    else:
        table(rows)
    return 0


def _warn_incomplete(settings: Settings) -> None:
    """Settings each valid alone that the telemetry set-up refuses together."""
    key = settings.telemetry_user_id_key
    if settings.telemetry_user_ids == "hashed" and key is None:
        print(
            "loomflow: warning: LOOMFLOW_TELEMETRY_USER_IDS=hashed needs "
            "LOOMFLOW_TELEMETRY_USER_ID_KEY (16 characters or more): an agent with the default "
            "telemetry (Agent(...), Agent.from_settings) refuses to be built without it, unless "
            "the code passes Telemetry(user_id_key=...)",
            file=sys.stderr,
        )


def _masked(name: str, value: Any) -> Any:
    """Credentials out of what is printed: secret values, headers, URL passwords."""
    if value in (None, "", []):
        return value
    if name in _SECRET_SETTINGS:
        return "(set, hidden)"
    return _masked_url(str(value))


def _one_line(text: str) -> str:
    return " ".join(text.split())


async def _dispatch(args: argparse.Namespace) -> int:
    settings = Settings()
    url = args.url or settings.runtime_url
    if args.command == "migrate":
        not_in_process(url, "journal")  # migrating it would report a schema nobody keeps
    else:
        existing(url, "journal")
        if getattr(args, "audit_url", None):  # runs cancel: its record must reach the real log
            existing(args.audit_url, "audit log")
    stores = Stores(
        settings.model_copy(update={"runtime_url": url}),
        audit_url=getattr(args, "audit_url", None),
    )
    runtime = stores.runtime
    assert runtime is not None  # Stores builds the journal unless told not to
    if args.command == "migrate" or (args.command == "runs" and args.runs_command == "list"):
        quiet_on_open(runtime)  # these commands say what a 0.20 journal holds themselves
    try:
        if args.command == "migrate":
            return await _migrate(stores, args)
        if args.command == "runs" and args.runs_command == "list":
            return await _runs_list(runtime, args)
        if args.command == "runs" and args.runs_command == "cancel":
            return await _runs_cancel(stores, args)
        if args.command == "runs":
            return await _runs_show(runtime, args)
        if args.command == "journal":
            return await _prune(stores, args)
        raise AssertionError(args.command)  # argparse only lets known commands through
    finally:
        await stores.close()


async def _migrate(stores: Stores, args: argparse.Namespace) -> int:
    """Bring every store this deployment uses up to date: a deploy step, run once."""
    if args.app_login and args.app_role is None:
        print("loomflow: error: --app-login goes with --app-role NAME", file=sys.stderr)
        return 2
    if args.app_role is not None and not stores.on_postgres():
        # Said before migrating: a command that cannot do what was asked changes nothing.
        print("loomflow: error: --app-role needs a PostgreSQL database", file=sys.stderr)
        return 2
    if args.app_role is not None and (problem := app_role_problem(args.app_role)) is not None:
        print(f"loomflow: error: --app-role: {printable(problem)}", file=sys.stderr)
        return 2
    report = await stores.migrate(
        app_role=args.app_role, app_login=args.app_login, import_legacy=args.import_0_20
    )
    for step in report.steps:
        print(step.message)
    if args.app_role is not None and not report.app_role_granted:
        print("loomflow: error: --app-role needs a PostgreSQL database", file=sys.stderr)
        return 2
    return 0


async def _runs_list(runtime: JournalRuntime, args: argparse.Namespace) -> int:
    filters: dict[str, Any] = {"limit": args.limit}
    if args.anonymous:
        filters["user_id"] = None  # the anonymous bucket, not every user
    elif args.user_id is not None:
        filters["user_id"] = args.user_id
    if args.state is not None:
        filters["state"] = args.state
    sessions = await runtime.sessions(**filters)
    note = await legacy_note(runtime, pending_only=True)
    if note is not None and args.json:
        print(f"loomflow: {note}", file=sys.stderr)  # stdout stays JSON lines
    if args.json:
        for s in sessions:
            print(
                json.dumps(
                    {
                        "session_id": s.session_id,
                        "user_id": s.user_id,
                        "state": s.state,
                        "agent": s.agent,
                        "attempts": s.attempts,
                        "last_error": s.last_error,
                        "epoch": s.epoch,
                        "open": s.open,
                        "owner": s.owner,
                        "updated_at": iso_time(s.updated_at),
                        "entries": s.entries,
                    }
                )
            )
        return 0
    if not sessions:
        which = "" if args.state is None else f"{args.state} "
        whose = (
            " without a user"
            if args.anonymous
            else ""
            if args.user_id is None
            else f" of user {printable(repr(args.user_id))}"
        )
        print(
            f"no {which}runs{whose} in the journal"
            if which or whose
            else "no sessions in the journal"
        )
        if note is not None:
            print(note)
        return 0
    rows: list[tuple[Any, ...]] = [
        ("session", "user", "runs", "last run", "agent", "steps", "updated (UTC)")
    ]
    for s in sessions:
        runs_done = s.epoch + (1 if s.open else 0)
        state = "open (resumable)" if s.state == "open" else s.state
        if s.state == "failed" and s.last_error:
            state = f"failed: {s.last_error[:60]}"
        rows.append(
            (
                id_cell(s.session_id),
                user_cell(s.user_id),
                runs_done,
                state,
                s.agent or "-",
                s.entries,
                table_time(s.updated_at),
            )
        )
    table(rows)
    if note is not None:
        print(note)
    return 0


async def _runs_cancel(stores: Stores, args: argparse.Namespace) -> int:
    """Cancel an open or interrupted run, audited with the person at the terminal as actor."""
    from ..audit import AuditLog
    from ..recovery import cancel_run

    runtime = stores.runtime
    assert runtime is not None
    user_id = None if args.anonymous else args.user_id
    if not args.anonymous and user_id is None:  # the one user who ran it, as `runs show` finds
        user_id = (await session_of(runtime, args.session_id, None, anonymous=False)).user_id
    audit = AuditLog(stores.audit, on_error="raise", redact_logs=False)
    cancelled = await cancel_run(
        runtime, args.session_id, user_id=user_id, audit=audit, actor=f"cli:{login()}"
    )
    if args.json:
        print(
            json.dumps({"session_id": args.session_id, "user_id": user_id, "cancelled": cancelled})
        )
    elif cancelled:
        print(f"cancelled the run of session {args.session_id!r} of {who(user_id)}")
    else:
        print(
            f"loomflow: error: session {args.session_id!r} of {who(user_id)} has no open or "
            "interrupted run to cancel",
            file=sys.stderr,
        )
    return 0 if cancelled else 1


async def _runs_show(runtime: JournalRuntime, args: argparse.Namespace) -> int:
    info = await session_of(runtime, args.session_id, args.user_id, anonymous=args.anonymous)
    if args.user_id is not None or args.anonymous:
        # The row was found by its key, made from the ids asked for; its id columns may be
        # damaged (a blob reads as no id), and would send the reads to another run.
        info = dataclasses.replace(info, session_id=args.session_id, user_id=args.user_id)
    entries = await runtime.entries(args.session_id, info.user_id)
    tools, unreadable, newer_keys = await _read_back(runtime, info, {e.epoch for e in entries})

    def damage(e: EntryInfo) -> str | None:
        return e.damage or unreadable.get((e.epoch, path_key(e.path), e.name))

    def newer(e: EntryInfo) -> bool:
        return (e.epoch, path_key(e.path), e.name) in newer_keys

    if args.json:
        for e in entries:
            print(
                json.dumps(
                    {
                        "session_id": e.session_id,
                        "user_id": e.user_id,
                        "epoch": e.epoch,
                        "path": list(e.path),
                        "name": e.name,
                        "tool": tools.get((e.epoch, path_key(e.path), e.name)),
                        "kind": e.kind,
                        "size": e.size,
                        "seq": e.seq,
                        "created_at": iso_time(e.created_at),
                        "damage": damage(e),
                    }
                )
            )
        return 0
    if not entries and info.state == UNREADABLE and args.user_id is None and not args.anonymous:
        # Its user column is damaged, so the entries were looked for under another user
        # (unless one was named: then they were looked for under the key it was found by).
        raise CorruptEntryError(
            f"session {args.session_id!r} has an unreadable row (edited by hand or damaged), "
            "so whose run it is cannot be read from it: name the user with --user"
        )
    if not entries:
        # Pruned, or its runs stopped before their first step (a model that could not start).
        print(f"session {args.session_id!r} has no journal entries")
        return 0
    rows: list[tuple[Any, ...]] = [
        ("epoch", "step", "tool", "sub-run", "kind", "bytes", "on resume", "written (UTC)")
    ]
    for e in entries:
        last = e.epoch == (info.epoch if info.open else info.epoch - 1)
        status = "replays" if last else "kept (earlier run)"
        if newer(e):
            # Not run again: a resume stops with NewerEntryError (upgrade the process).
            status = "newer loomflow: resume stops" if last else "newer loomflow"
        elif damage(e) is not None:
            status = "damaged: runs again" if last else "damaged"
        tool = tools.get((e.epoch, path_key(e.path), e.name), "-")
        where = "/".join(e.path) or "-"
        written = table_time(e.created_at)
        rows.append((e.epoch, e.name, tool, where, e.kind, e.size, status, written))
    table(rows)
    return 0


async def _read_back(
    runtime: JournalRuntime, info: SessionInfo, epochs: set[int]
) -> tuple[
    dict[tuple[int, str, str], str], dict[tuple[int, str, str], str], set[tuple[int, str, str]]
]:
    """What the session's stored values say, by (epoch, sub-run key, step name): the tool each
    tool step ran, why a value cannot be read back (a resume runs that step again), and the
    steps a newer loomflow wrote (a resume stops there instead: ``NewerEntryError``).

    A tool step's name carries only a hash of the call; the tool it ran is in the journaled
    reply of the model call before it, so every value is read back (JSON values only: the CLI
    never unpickles, and a value it cannot read leaves the hashed name alone).
    """
    from ..messages import ModelResponse
    from ..runtime._names import tool_step_name
    from ..runtime._store import Scope

    names: dict[tuple[int, str, str], str] = {}
    unreadable: dict[tuple[int, str, str], str] = {}
    newer: set[tuple[int, str, str]] = set()
    store = getattr(runtime, "_store", None)
    if store is None:
        return names, unreadable, newer
    for epoch in sorted(epochs):
        for row in await store.load_run(Scope(info.session_id, info.user_id), epoch):
            if row.damaged() is not None:
                continue  # a hand-edited row of no run, or with a name that is no text
            if row.format == "pickle":
                continue  # the runtime's serializer decides; never unpickled here
            try:
                value = runtime._decode(row)  # what a resume reads, by the same checks
            except NewerEntryError as exc:  # most likely sound: never run again
                unreadable[(epoch, row.path, row.name)] = f"{exc}"[:200]
                newer.add((epoch, row.path, row.name))
                continue
            except CorruptEntryError as exc:  # untrusted data, and a step that runs again
                unreadable[(epoch, row.path, row.name)] = f"an unreadable value: {exc}"[:200]
                continue
            turn = row.name.removeprefix("model_call_")
            if turn == row.name or not (turn.isascii() and turn.isdigit()):
                continue
            replies = value if isinstance(value, list) else [value]
            for reply in replies:
                if isinstance(reply, ModelResponse):
                    for slot, call in enumerate(reply.tool_calls):
                        step = tool_step_name(int(turn), slot, call)
                        names[(epoch, row.path, step)] = call.name
    return names, unreadable, newer


async def _prune(stores: Stores, args: argparse.Namespace) -> int:
    older_than = args.older_than
    retention = Settings().journal_retention_days
    if older_than is None and retention is not None:
        older_than = dt.timedelta(days=retention)
    unfiltered = older_than is None and args.session_id is None and args.user_id is None
    if unfiltered and not args.everything:
        # Deleting every finished run is rarely meant: a redelivered task would run again.
        print(
            "loomflow: error: say what to prune: --older-than AGE (or set "
            "LOOMFLOW_JOURNAL_RETENTION_DAYS), --session, --user, or --all for every finished run",
            file=sys.stderr,
        )
        return 2
    filters: dict[str, Any] = {"older_than": older_than, "include_open": args.include_open}
    if args.session_id is not None:
        filters["session_id"] = args.session_id
    if args.user_id is not None:
        filters["user_id"] = args.user_id
    # Users under legal hold keep everything; a prune of one of them is refused.
    filters["actor"] = f"cli:{login()}"
    if args.dry_run:
        count = await stores.prune_journal(**filters, dry_run=True)
        print(
            json.dumps({"would_delete": count})
            if args.json
            else f"would delete {count} journal entries (dry run: nothing deleted)"
        )
        return 0
    with progress_bar("pruning", unit=" rows", enabled=args.progress) as on_progress:
        deleted = await stores.prune_journal(
            **filters, batch_size=args.batch_size, on_progress=on_progress
        )
    print(json.dumps({"deleted": deleted}) if args.json else f"deleted {deleted} journal entries")
    return 0
