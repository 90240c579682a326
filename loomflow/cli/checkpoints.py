"""``loomflow checkpoints list|show|export|forget``: the transcript snapshots of sessions.

Checkpoints live beside the journal, so the store is the journal's: ``--url`` or
``LOOMFLOW_RUNTIME_URL``. Tables for people; ``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from .._files import write_private
from ..checkpoints import Checkpoint, CheckpointStore, UnreadableCheckpoint
from ..config import Settings
from ..errors import CheckpointNotFoundError
from ..stores import Stores
from ._format import iso_time, json_text, login, positive_int, printable, table, who
from ._format import some_path as file_path
from ._stores import existing, session_of

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``checkpoints`` command group to the CLI."""
    group = subparsers.add_parser(
        "checkpoints", help="list, show, export or forget transcript snapshots"
    )
    commands = group.add_subparsers(dest="checkpoints_command", required=True)

    listing = commands.add_parser("list", help="a session's checkpoints, newest first")
    listing.add_argument("session_id")
    who = listing.add_mutually_exclusive_group()
    who.add_argument(
        "--user", dest="user_id", help="whose session (needed when several users share the id)"
    )
    who.add_argument("--anonymous", action="store_true", help="the session without a user")
    listing.add_argument("--limit", type=positive_int, help="only the newest N")
    listing.add_argument("--json", action="store_true", help="JSON lines for scripts")

    show = commands.add_parser("show", help="one checkpoint with its transcript, as JSON")
    show.add_argument("session_id")
    show.add_argument("checkpoint_id")
    who = show.add_mutually_exclusive_group()
    who.add_argument(
        "--user", dest="user_id", help="whose session (needed when several users share the id)"
    )
    who.add_argument("--anonymous", action="store_true", help="the session without a user")

    export = commands.add_parser("export", help="every checkpoint of a user, as one JSON document")
    _whose(export)
    export.add_argument(
        "-o", "--output", type=file_path, default="-", help="file to write ('-': stdout)"
    )

    forget = commands.add_parser("forget", help="delete every checkpoint of a user")
    _whose(forget)
    forget.add_argument("--yes", action="store_true", help="really delete (required)")
    forget.add_argument("--json", action="store_true")

    group.set_defaults(handler=_handle, unconfirmed=_unconfirmed)


def _whose(parser: argparse.ArgumentParser) -> None:
    # The runs without a user are a bucket of their own: their snapshots are exported and
    # erased like any user's.
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", dest="user_id", help="the user id")
    who.add_argument("--anonymous", action="store_true", help="the snapshots without a user")


def _unconfirmed(args: argparse.Namespace) -> str | None:
    """Why the command may not run without --yes (the CLI exits 2 before anything else)."""
    if args.checkpoints_command == "forget" and not args.yes:
        return "checkpoints forget deletes every snapshot of the user: add --yes to confirm"
    return None


async def _handle(args: argparse.Namespace) -> int:
    settings = Settings()
    url = existing(args.url or settings.runtime_url, "journal")
    # The checkpoints on a connection of their own: export never opens the journal (forget
    # reads it, for runs of the user in progress, as list and show do for who ran a session).
    async with Stores(
        settings.model_copy(update={"runtime_url": url}), checkpoints_url=url
    ) as stores:
        if args.checkpoints_command in ("list", "show"):
            # Which user's snapshots: the journal beside them knows who ran the session.
            runtime = stores.runtime
            assert runtime is not None  # Stores has a journal by default
            info = await session_of(
                runtime, args.session_id, args.user_id, anonymous=args.anonymous
            )
            args.user_id = info.user_id
        store = stores.checkpoints
        assert store is not None  # checkpoints_url was given
        if args.checkpoints_command == "list":
            return await _list(store, args)
        if args.checkpoints_command == "show":
            return await _show(store, args)
        if args.checkpoints_command == "export":
            return await _export(store, args)
        # Refused for a user under legal hold; noted in the user's audit trail.
        deleted = await stores.forget_checkpoints(args.user_id, actor=f"cli:{login()}")
        if args.json:
            print(json.dumps({"user_id": args.user_id, "deleted": deleted}))
        else:
            print(f"deleted {deleted} checkpoints of {who(args.user_id)}")
        return 0


async def _list(store: CheckpointStore, args: argparse.Namespace) -> int:
    # A row edited by hand is listed as unreadable, with why, instead of failing the list;
    # a store without ``listing`` (one written before it) lists what it can read.
    listing = getattr(store, "listing", store.list_checkpoints)
    found: list[Checkpoint | UnreadableCheckpoint] = list(
        await listing(args.session_id, user_id=args.user_id, limit=args.limit)
    )
    if args.json:
        for checkpoint in found:
            summary = checkpoint.summary()
            if isinstance(checkpoint, Checkpoint):
                summary["created_at"] = iso_time(checkpoint.created_at)
            print(json.dumps(summary))
        return 0
    if not found:
        print(f"no checkpoints for session {args.session_id!r} of {who(args.user_id)}")
        return 0
    table(
        [("checkpoint", "written (UTC)", "epoch", "turn", "final", "msgs", "tokens", "parent")]
        + [_row(c) for c in found]
    )
    for damaged in found:
        if isinstance(damaged, UnreadableCheckpoint):
            print(f"loomflow: {printable(damaged.unreadable)}", file=sys.stderr)
    return 0


def _row(c: Checkpoint | UnreadableCheckpoint) -> tuple[str, ...]:
    if isinstance(c, UnreadableCheckpoint):
        return (c.id, "unreadable", "-", "-", "-", "-", "-", "-")
    when = c.created_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if c.created_at else "-"
    return (
        c.id,
        when,
        str(c.epoch),
        str(c.turn),
        "yes" if c.final else "no",
        str(len(c.messages)),
        f"{c.usage.input_tokens}/{c.usage.output_tokens}",
        c.parent_id or "-",
    )


async def _show(store: CheckpointStore, args: argparse.Namespace) -> int:
    found = await store.get(args.checkpoint_id, session_id=args.session_id, user_id=args.user_id)
    if found is None:
        raise CheckpointNotFoundError(
            f"no checkpoint {args.checkpoint_id!r} in session {args.session_id!r} of "
            f"{who(args.user_id)}"
        )
    print(json_text(found.model_dump(mode="json"), indent=2))
    return 0


async def _export(store: CheckpointStore, args: argparse.Namespace) -> int:
    exported = await store.export_user(args.user_id)
    document = json_text(exported)
    if str(args.output) == "-":
        print(document)
    else:
        await asyncio.to_thread(write_private, args.output, document + "\n")
        count = len(exported.get("checkpoints", []))
        # On stderr, as `audit export` does: stdout stays free for the document itself.
        print(
            f"exported {count} checkpoints of {who(args.user_id)} to {args.output}",
            file=sys.stderr,
        )
    return 0
