"""``loomflow audit query|export|verify|retain``: the audit trail for compliance teams.

The store comes from ``--audit-url`` or ``LOOMFLOW_AUDIT_URL``, else it is the journal's
database (``--url`` or ``LOOMFLOW_RUNTIME_URL``). Tables for people; ``--json``
for scripts. ``verify`` exits 1 when it finds a problem, so a cron job can alert on it, and
so does ``retain`` when it leaves a damaged trail alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..audit import (
    ANY_USER,
    AuditEntry,
    AuditStore,
    ChainHead,
    ChainProblem,
    VerifyReport,
    heads_from_json,
    verify_lines,
)
from ..audit._store import MAX_PAGE
from ..config import Settings
from ..errors import AuditError
from ..stores import Stores
from ._format import (
    DAMAGED_ROWS,
    damaged_rows,
    damaged_trail,
    duration,
    id_cell,
    json_text,
    login,
    positive_int,
    printable,
    some_path,
    table,
    user_cell,
    when,
)
from ._progress import add_no_progress, progress_bar
from ._stores import existing

__all__ = ["register"]


def _filters(parser: argparse.ArgumentParser) -> None:
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--user", dest="user_id", help="only this user's entries")
    who.add_argument("--anonymous", action="store_true", help="only entries without a user")
    parser.add_argument("--session", dest="session_id", help="only this session")
    parser.add_argument("--run", dest="run_id", help="only this run")
    parser.add_argument("--action", help="only this action, or a family such as 'tool.*'")
    parser.add_argument("--since", type=when, help="from this time or age (e.g. 24h, 2026-05-01)")
    parser.add_argument("--until", type=when, help="before this time or age")


def _page_size(text: str) -> int:
    """A query page of 1 to 10,000 entries (the store's cap), as an argparse type."""
    value = positive_int(text)
    if value > MAX_PAGE:
        raise argparse.ArgumentTypeError(f"{text!r} is more than a page holds ({MAX_PAGE})")
    return value


def register(subparsers: Any) -> None:
    """Add the ``audit`` command group to the CLI."""
    audit = subparsers.add_parser("audit", help="query, export and verify the audit log")
    audit.add_argument(
        "--audit-url",
        help="audit store URL (default: LOOMFLOW_AUDIT_URL, else the journal's database)",
    )
    commands = audit.add_subparsers(dest="audit_command", required=True)

    query = commands.add_parser("query", help="list entries, newest page last")
    _filters(query)
    query.add_argument("--limit", type=_page_size, default=50, help="page size (50, at most 10000)")
    query.add_argument("--cursor", help="next_cursor printed by the previous page")
    query.add_argument("--json", action="store_true", help="one JSON object for scripts")

    export = commands.add_parser("export", help="write entries as JSON lines")
    _filters(export)
    export.add_argument("-o", "--output", default="-", help="file to write ('-': stdout)")
    add_no_progress(export)

    verify = commands.add_parser("verify", help="check every user's hash chain")
    who = verify.add_mutually_exclusive_group()
    who.add_argument(
        "--user",
        dest="user_id",
        help="only this user's chain (with --file: the export is this user's trail alone; "
        "without, it is the whole log)",
    )
    who.add_argument(
        "--anonymous",
        action="store_true",
        help="only the chain of entries without a user (with --file: the export is theirs alone)",
    )
    verify.add_argument(
        "--file",
        type=some_path,
        help="check this export (JSON lines) instead of the store; no database needed",
    )
    verify.add_argument(
        "--heads",
        type=some_path,
        help="heads saved earlier (a `verify --json` report): the trail must still hold the "
        "entry each names, with --file or on the store",
    )
    verify.add_argument("--json", action="store_true", help="the report as JSON")
    add_no_progress(verify)

    retain = commands.add_parser(
        "retain",
        help="erase the payloads of entries older than an age, except for users on legal hold",
    )
    retain.add_argument(
        "--older-than", required=True, type=duration, help="an age such as 365d or 720h"
    )
    retain.add_argument("--dry-run", action="store_true", help="only count what would go")
    retain.add_argument("--yes", action="store_true", help="really erase (required)")
    retain.add_argument("--json", action="store_true", help="the report as JSON")

    audit.set_defaults(handler=_handle, unconfirmed=_unconfirmed)


def _user(args: argparse.Namespace) -> str | None:
    """The user a command acts on: ``--user``, ``--anonymous`` (``None``), else every user
    (``ANY_USER``). For ``verify --file``, never what the export's header says: no hash
    covers it."""
    if getattr(args, "anonymous", False):
        return None
    return ANY_USER if args.user_id is None else str(args.user_id)


def _filter_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "user_id": _user(args),
        "session_id": args.session_id,
        "run_id": args.run_id,
        "action": args.action,
        "since": args.since,
        "until": args.until,
    }


def _unconfirmed(args: argparse.Namespace) -> str | None:
    """Why the command may not run without --yes (the CLI exits 2 before anything else)."""
    if args.audit_command == "retain" and not (args.yes or args.dry_run):
        return (
            "audit retain erases payloads for good: pass --yes (or --dry-run to count them first)"
        )
    return None


async def _handle(args: argparse.Namespace) -> int:
    since, until = getattr(args, "since", None), getattr(args, "until", None)
    if since is not None and until is not None and since >= until:
        # "--since 1d --until 2d" read as "from one day back to two" selects nothing, and an
        # empty answer would pass for a trail with nothing in that time.
        print(
            f"loomflow: error: --since ({since.isoformat()}) is not before --until "
            f"({until.isoformat()}): the range selects nothing; an age counts back from now, "
            "so the older bound is the larger age",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "file", None) is not None:
        return _verify_file(args)
    settings = Settings()
    url = args.audit_url or settings.audit_url or args.url or settings.runtime_url
    existing(url, "audit log")
    if args.url:
        settings = settings.model_copy(update={"runtime_url": args.url})
    # No journal here: the audit log is at --audit-url, else LOOMFLOW_AUDIT_URL, else in the
    # journal's database, opened on a connection of its own (Settings.audit_store_url).
    stores = Stores(settings, journal=False, audit_url=args.audit_url)
    store = stores.audit
    try:
        if args.audit_command == "query":
            return await _query(store, args)
        if args.audit_command == "export":
            return await _export(store, args)
        if args.audit_command == "retain":
            return await _retain(store, args)
        return await _verify(store, args)
    finally:
        await stores.close()


# Shown first in the table's details column, since long payloads are cut at its width.
_FIRST = ("tool", "decision", "outcome", "reason", "cap", "model")


def _summary(entry: AuditEntry, width: int = 70) -> str:
    if entry.payload is None:
        return "[payload erased]"
    parts = []
    items = sorted(entry.payload.items(), key=lambda kv: (kv[0] not in _FIRST, _rank(kv[0])))
    for key, value in items:
        if value is None or value == [] or value == {}:
            continue
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        parts.append(f"{key}={text}")
    line = " ".join(parts).replace("\n", " ")
    return line if len(line) <= width else line[: width - 1] + "…"


def _rank(key: str) -> int:
    return _FIRST.index(key) if key in _FIRST else 0


async def _query(store: AuditStore, args: argparse.Namespace) -> int:
    page = await store.query(**_filter_args(args), limit=args.limit, cursor=args.cursor)
    # Rows that read as no entry, then entries whose payload alone is damaged (in the table
    # and the JSON, marked): the page goes on past them and says so, exit DAMAGED_ROWS.
    damaged = [p.to_json() for p in page.damaged]
    damaged += [
        {"user_id": e.user_id, "seq": e.seq, "position": None, "detail": e.unreadable}
        for e in page.entries
        if e.unreadable is not None
    ]
    status = DAMAGED_ROWS if damaged else 0
    if damaged:
        for line in damaged_rows(damaged, "this page"):
            print(line, file=sys.stderr)
    if args.json:
        answer: dict[str, Any] = {
            "entries": [e.to_json() for e in page.entries],
            "next_cursor": page.next_cursor,
        }
        if page.damaged:  # only then: the answer for an intact trail stays as it was
            answer["damaged"] = [p.to_json() for p in page.damaged]
        print(json_text(answer))
        return status
    if not page.entries and not page.damaged:
        print("no audit entries match")
        return status
    if page.entries:
        rows: list[tuple[str, ...]] = [
            ("time (UTC)", "user", "seq", "session", "actor", "action", "details")
        ]
        for e in page.entries:
            rows.append(
                (
                    e.time.strftime("%Y-%m-%d %H:%M:%S"),
                    user_cell(e.user_id),
                    str(e.seq),
                    id_cell(e.session_id),
                    e.actor,
                    e.action,
                    _summary(e),
                )
            )
        table(rows)
    if page.next_cursor is not None:
        # Also after a page of damaged rows only (named on stderr): the query goes on past them.
        gap = "\n" if page.entries else ""
        print(f"{gap}more entries: add --cursor {page.next_cursor}")
    return status


async def _export(store: AuditStore, args: argparse.Namespace) -> int:
    to_stdout = args.output == "-"
    # Lines written to the terminal the bar is drawn on would tangle with it.
    enabled = args.progress and not (to_stdout and sys.stdout.isatty())
    damaged: list[ChainProblem] = []
    with progress_bar("exporting", unit=" entries", enabled=enabled) as on_progress:
        count = await store.export(
            sys.stdout if to_stdout else args.output,
            on_progress=on_progress,
            on_damaged=damaged.append,
            **_filter_args(args),
        )
    if not to_stdout:
        print(f"exported {count} audit entries to {args.output}", file=sys.stderr)
    if damaged:
        for line in damaged_rows([p.to_json() for p in damaged], "the export"):
            print(line, file=sys.stderr)
    # The file carries entries, not the store's heads: a trail cut off at its end (head left
    # behind) or one whose head was moved exports as lines that verify on their own. Say what
    # the store knows, as `users export` does; the export itself stays as stored.
    with progress_bar("verifying", unit=" entries", enabled=enabled) as on_progress:
        report = await store.verify(user_id=_user(args), on_progress=on_progress)
    trails: dict[str | None, list[dict[str, Any]]] = {}
    for problem in report.problems:
        trails.setdefault(problem.user_id, []).append(problem.to_json())
    for user, problems in trails.items():
        print(damaged_trail(user, problems), file=sys.stderr)
    return DAMAGED_ROWS if damaged else 0


def _saved_heads(args: argparse.Namespace) -> list[ChainHead] | None:
    if args.heads is None:
        return None
    try:
        data = json.loads(args.heads.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "heads" not in data:
            # Another JSON document (a users export, say) would check nothing and pass.
            raise ValueError('it is not a `verify --json` report (no "heads")')
        return heads_from_json(data)
    except OSError as exc:
        raise AuditError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    except (ValueError, RecursionError) as exc:  # not JSON (or nested too deep), not heads
        raise AuditError(f"bad --heads file {args.heads}: {exc}") from exc


def _verify_file(args: argparse.Namespace) -> int:
    heads = _saved_heads(args)
    try:
        # A byte that is not UTF-8 makes its own line unreadable, not the whole file.
        with args.file.open(encoding="utf-8", errors="surrogateescape") as lines:
            report = verify_lines(lines, heads=heads, user_id=_user(args))
    except OSError as exc:
        raise AuditError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    return _report(report, args)


async def _verify(store: AuditStore, args: argparse.Namespace) -> int:
    heads = _saved_heads(args)
    with progress_bar("verifying", unit=" entries", enabled=args.progress) as on_progress:
        report: VerifyReport = await store.verify(
            user_id=_user(args),
            on_progress=on_progress,
            heads=heads or (),
        )
    return _report(report, args)


def _report(report: VerifyReport, args: argparse.Namespace) -> int:
    if report.entries == 0 and not report.problems:
        # Not a failure (a new deployment has no trail yet), but worth a look from a cron job.
        print("loomflow: warning: no audit entries to verify", file=sys.stderr)
    if args.json:
        print(json_text(report.to_json()))
        return 0 if report.ok else 1
    verdict = "OK" if report.ok else f"FAILED: {len(report.problems)} problem(s)"
    unauthorised = sum(1 for p in report.problems if p.kind == "erased")
    erased = ""
    if report.erased:
        # "on record" only when every erased payload has an erasure record that covers it.
        on_record = "on record" if not unauthorised else f"{unauthorised} with no erasure record"
        erased = f" ({report.erased} payloads erased, {on_record})"
    print(f"{verdict}: checked {report.entries} entries of {report.users} user(s){erased}")
    if report.export_filters:
        # What the exporter wrote; no hash covers it, so it narrowed nothing (the lines were
        # held to it, and an "unscoped" warning below says which --user checks it alone).
        named = ", ".join(f"{k}={v!r}" for k, v in report.export_filters.items())
        print(f"the export says it was made with {named}")
    findings = [("problem", p) for p in report.problems] + [("warning", w) for w in report.warnings]
    if findings:
        rows: list[tuple[str, ...]] = [("", "user", "kind", "seq", "stored at", "what")]
        for label, p in findings:
            rows.append(
                (
                    label,
                    user_cell(p.user_id),
                    p.kind,
                    "-" if p.seq is None else str(p.seq),
                    "-" if p.position is None else str(p.position),
                    p.detail,
                )
            )
        print()
        table(rows)
    return 0 if report.ok else 1


async def _retain(store: AuditStore, args: argparse.Namespace) -> int:
    report = await store.retain(args.older_than, actor=f"cli:{login()}", dry_run=args.dry_run)
    failed = 1 if report.refused else 0
    if args.json:
        print(json_text(report.to_json() | {"dry_run": args.dry_run}))
        return failed
    total = sum(report.erased.values())
    verb = "would erase" if args.dry_run else "erased"
    print(
        f"{verb} {total} payload(s) of {len(report.erased)} user(s) written before "
        f"{report.cutoff.isoformat(timespec='seconds')}"
    )
    for user in report.held:
        print(f"kept (legal hold): {printable(user_cell(user))}")
    for problem in report.refused.values():
        # Exit 1, as verify does on a damaged trail, so a cron job alerts on it.
        print(f"loomflow: error: {problem}", file=sys.stderr)
    return failed
