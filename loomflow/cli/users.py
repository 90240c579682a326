"""``loomflow users export``: everything loomflow keeps about one user, in one JSON document.

For a data-subject access request: the user's journal (sessions and the steps recorded for
them), checkpoints, memory, budget totals and audit trail, each read from where the settings
put it. Nothing is changed. Step *values* are not included: they are replay data in
loomflow's codec, and what they hold of the conversation is in the checkpoints, memory and
(redacted) audit trail.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import Settings
from ..runtime import JournalRuntime
from ..stores import Stores
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
    export.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    group.set_defaults(handler=_export)


async def _export(args: argparse.Namespace) -> int:
    settings = Settings()
    user: str | None = None if args.anonymous else args.user_id
    url = existing(args.url or settings.runtime_url, "journal")
    if settings.audit_url:
        existing(settings.audit_url, "audit log")
    async with Stores(settings.model_copy(update={"runtime_url": url})) as stores:
        document = await stores.export_user(user)
    text = json.dumps(document, ensure_ascii=False, indent=2)
    if args.output is None:
        print(text)
    else:
        args.output.write_text(text + "\n", encoding="utf-8")
        counts = ", ".join(f"{k}: {v}" for k, v in document["counts"].items())
        print(f"exported user {user!r} to {args.output} ({counts})", file=sys.stderr)
    return 0


async def export_user(
    runtime: JournalRuntime, user_id: str | None, settings: Settings
) -> dict[str, Any]:
    """The user's data from every store, JSON-ready (read only); see ``Stores.export_user``."""
    async with Stores(settings, runtime=runtime) as stores:
        return await stores.export_user(user_id)
