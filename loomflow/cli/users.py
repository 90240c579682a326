"""``loomflow users export|forget|hold|release|holds``: one user's data across every store.

``export``, for a data-subject access request: the user's journal (sessions and the steps
recorded for them), checkpoints, memory, budget totals and audit trail, each read from where
the settings put it. Nothing is changed. Step *values* are not included: they are replay data
in loomflow's codec, and what they hold of the conversation is in the checkpoints, memory and
(redacted) audit trail.

``forget``, for an erasure request: deletes the user's journal entries, checkpoints, memory
and budget buckets and erases their audit payloads, keeping the chain verifiable (see
``Stores.forget_user``). ``hold``/``release`` place and lift a legal hold, which forget and
``audit retain`` respect; ``holds`` lists them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

from .._files import write_private
from ..audit._entry import UNREADABLE
from ..config import Settings
from ..runtime import JournalRuntime
from ..stores import Stores, spelled_otherwise
from ._format import (
    DAMAGED_ROWS,
    damaged_rows,
    damaged_trail,
    json_text,
    login,
    some_path,
    table,
    user_cell,
    who,
)
from ._stores import existing

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``users`` command group to the CLI."""
    group = subparsers.add_parser("users", help="what loomflow keeps about a user")
    commands = group.add_subparsers(dest="users_command", required=True)
    export = commands.add_parser(
        "export", help="journal, checkpoints, memory, budget and audit trail of one user, as JSON"
    )
    who = export.add_mutually_exclusive_group(required=True)
    who.add_argument("user_id", nargs="?", help="the user id")
    who.add_argument("--anonymous", action="store_true", help="the runs without a user")
    export.add_argument(
        "-o", "--output", type=some_path, help="write here instead of stdout ('-': stdout)"
    )

    forget = commands.add_parser(
        "forget",
        help="delete a user's journal, checkpoints, memory and budget; erase audit payloads",
    )
    _who(forget)
    forget.add_argument("--yes", action="store_true", help="really erase (required)")
    forget.add_argument("--json", action="store_true", help="the report as JSON")

    hold = commands.add_parser("hold", help="place a legal hold: nothing of the user is erased")
    _who(hold)
    hold.add_argument("--reason", required=True, help="why (kept in the audit trail)")

    release = commands.add_parser("release", help="lift a user's legal hold")
    _who(release)
    release.add_argument("--reason", default="", help="why (kept in the audit trail)")

    holds = commands.add_parser("holds", help="list the users under legal hold")
    holds.add_argument("--json", action="store_true", help="as JSON")
    group.set_defaults(handler=_handle, unconfirmed=_unconfirmed)


def _who(parser: argparse.ArgumentParser) -> None:
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("user_id", nargs="?", help="the user id")
    who.add_argument("--anonymous", action="store_true", help="the runs without a user")


def _stores(args: argparse.Namespace) -> Stores:
    settings = Settings()
    url = existing(args.url or settings.runtime_url, "journal")
    if settings.audit_url:
        existing(settings.audit_url, "audit log")
    return Stores(settings.model_copy(update={"runtime_url": url}))


def _unconfirmed(args: argparse.Namespace) -> str | None:
    """Why the command may not run without --yes (the CLI exits 2 before anything else)."""
    if args.users_command == "forget" and not args.yes:
        return "users forget deletes the user's data for good: pass --yes"
    return None


async def _handle(args: argparse.Namespace) -> int:
    command = args.users_command
    if command == "export":
        return await _export(args)
    user: str | None = None
    if command != "holds":
        user = None if args.anonymous else args.user_id
    async with _stores(args) as stores:
        audit = stores.audit
        if command == "forget":
            report = await stores.forget_user(user, actor=f"cli:{login()}")
            if args.json:
                print(json_text(report.to_json()))
            else:
                gone = ", ".join(f"{k}: {v}" for k, v in report.deleted().items())
                print(
                    f"forgot {who(user)}: deleted {gone}; erased {report.audit_erased} audit "
                    f"payload(s), recorded as audit entry {report.audit_record_seq}"
                    + (
                        f"; erased {report.console_erased} console payload(s) naming them"
                        if report.console_erased
                        else ""
                    )
                )
        elif command == "hold":
            known = await stores.knows_user(user)
            placed = await audit.place_hold(user, reason=args.reason, actor=f"cli:{login()}")
            print(f"{who(user)} is under legal hold (audit entry {placed.seq})")
            if not known:
                # Placed all the same (a hold may come before the user's data), but a mistyped
                # id would leave the real user's data erasable without a word.
                print(
                    f"loomflow: warning: no store held anything about {who(user)} before this "
                    "hold: check the id (the hold protects that id alone)",
                    file=sys.stderr,
                )
        elif command == "release":
            await audit.release_hold(user, actor=f"cli:{login()}", reason=args.reason)
            print(f"released the legal hold of {who(user)}")
        else:
            found = await audit.legal_holds()
            if args.json:  # JSON Lines, as every listing
                for h in found:
                    print(json_text(h.to_json()))
            elif not found:
                print("no user is under legal hold")
            else:
                rows: list[tuple[Any, ...]] = [("user", "placed (UTC)", "by", "reason")]
                for h in found:
                    reason = h.reason if len(h.reason) <= 60 else h.reason[:57] + "..."
                    since = h.placed_at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
                    user = user_cell(h.user_id)
                    rows.append((user, since, h.actor, reason))
                table(rows)  # escapes what a crafted id or reason could do to a terminal
    return 0


async def _export(args: argparse.Namespace) -> int:
    settings = Settings()
    user: str | None = None if args.anonymous else args.user_id
    url = existing(args.url or settings.runtime_url, "journal")
    if settings.audit_url:
        existing(settings.audit_url, "audit log")
    async with Stores(settings.model_copy(update={"runtime_url": url})) as stores:
        document = await stores.export_user(user)
        held = [*document["counts"].values(), document["budget"]]  # memory's facts and blocks too
        others = [] if any(held) else await stores.other_spellings(user)
    text = json_text(document, indent=2)
    if args.output is None or str(args.output) == "-":  # "-" is stdout, as for the others
        print(text)
    else:
        write_private(args.output, text + "\n")  # one person's data: owner-only
        counts = ", ".join(f"{k}: {v}" for k, v in document["counts"].items())
        print(f"exported {who(user)} to {args.output} ({counts})", file=sys.stderr)
    status = 0
    if rows := [item for item in document["audit"] if UNREADABLE in item]:
        # Exported all the same, marked in place: a data-subject request is not held up by
        # one damaged row, nor answered as if the document were whole.
        for line in damaged_rows(rows, "the export's audit trail"):
            print(line, file=sys.stderr)
        status = DAMAGED_ROWS
    if damage := document["audit_problems"]:
        print(damaged_trail(user, damage), file=sys.stderr)
    if not any(held):
        # Still exported (an empty export is the answer to "what do you hold about X?"), but
        # a mistyped id must not pass for that answer: `forget` refuses it outright.
        print(
            f"loomflow: warning: no store holds anything about {who(user)}"
            + ((spelled_otherwise(others) or ": check the id") if user is not None else ""),
            file=sys.stderr,
        )
    return status


async def export_user(
    runtime: JournalRuntime, user_id: str | None, settings: Settings
) -> dict[str, Any]:
    """The user's data from every store, JSON-ready (read only); see ``Stores.export_user``."""
    async with Stores(settings, runtime=runtime) as stores:
        return await stores.export_user(user_id)
