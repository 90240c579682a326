"""``loomflow users export``: everything loomflow keeps about one user, in one JSON document.

For a data-subject access request: the user's journal (sessions and the steps recorded for
them), checkpoints, memory, budget totals and audit trail, each read from where the settings
put it. Nothing is changed. Step *values* are not included: they are replay data in
loomflow's codec, and what they hold of the conversation is in the checkpoints, memory and
(redacted) audit trail.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from ..audit import audit_store_for
from ..checkpoints import checkpoint_store_for
from ..config import Settings
from ..governance.budget import budget_store_for
from ..memory import memory_for
from ..runtime import JournalRuntime, runtime_from_url
from ..storage import Database
from ._format import iso_time
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
    runtime = runtime_from_url(existing(args.url or settings.runtime_url, "journal"))
    try:
        document = await export_user(runtime, user, settings)
    finally:
        await runtime.close()
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
    """The user's data from every store, JSON-ready (read only)."""
    sessions = await runtime.sessions(user_id=user_id, limit=1_000_000)
    entries = []
    for info in sessions:
        for entry in await runtime.entries(info.session_id, user_id):
            entries.append({**dataclasses.asdict(entry), "created_at": iso_time(entry.created_at)})
    shared = getattr(runtime, "database", None)
    database = shared if isinstance(shared, Database) else None
    checkpoints: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    if database is not None:
        checkpoints = await checkpoint_store_for(runtime).export_user(user_id)
        memory = await memory_for(runtime).export_user(user_id)
    audit = await _audit(settings, database, user_id)
    document: dict[str, Any] = {
        "user_id": user_id,
        "exported_at": iso_time(dt.datetime.now(dt.UTC)),
        "journal": {
            "sessions": [
                {**dataclasses.asdict(s), "updated_at": iso_time(s.updated_at)} for s in sessions
            ],
            "entries": entries,
        },
        "checkpoints": checkpoints,
        "memory": memory,
        "budget": await _budget(settings, database, user_id),
        "audit": audit,
    }
    document["counts"] = {
        "sessions": len(sessions),
        "journal entries": len(entries),
        "checkpoints": len(checkpoints.get("checkpoints", [])),
        "episodes": len(memory.get("episodes", [])),
        "audit entries": len(audit),
    }
    return document


async def _budget(
    settings: Settings, database: Database | None, user_id: str | None
) -> list[dict[str, Any]]:
    store = budget_store_for(settings, database)
    if store is None:
        return []
    try:
        usage = await store.usage(user_id)
    finally:
        await store.close()
    return [
        {
            "scope": u.bucket.scope,
            "period": u.bucket.period or "all",
            **dataclasses.asdict(u.totals),
            "updated_at": iso_time(u.updated_at),
        }
        for u in usage
    ]


async def _audit(
    settings: Settings, database: Database | None, user_id: str | None
) -> list[dict[str, Any]]:
    if settings.audit_url:
        existing(settings.audit_url, "audit log")
    store = audit_store_for(settings, database)
    if store is None:
        return []
    try:
        return [entry.to_json() async for entry in store.entries(user_id=user_id)]
    finally:
        await store.close()
