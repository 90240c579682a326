"""``loomflow budget``: what users and everyone have spent, from the shared budget store.

The store is the one ``LOOMFLOW_BUDGET_URL`` names; unset, it is the journal's database
(``--url`` or ``LOOMFLOW_RUNTIME_URL``), where a budget sharing the runtime keeps its tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from typing import Any

from .._ids import user_label
from ..config import Settings
from ..errors import ConfigurationError
from ..governance.budget import BucketUsage, ReservationInfo, UnreadableBucket
from ..governance.budget.sql import SqlBudgetStore
from ..stores import Stores
from ._format import duration, id_cell, iso_time, json_text, printable, table_iso, user_cell
from ._format import table as print_table
from ._stores import existing

__all__ = ["register"]


def register(subparsers: Any) -> None:
    """Add the ``budget`` command group to the top-level parser."""
    budget = subparsers.add_parser("budget", help="budget usage (tokens, cost, model time)")
    budget.add_argument(
        "--budget-url",
        help="budget store URL (default: LOOMFLOW_BUDGET_URL, else the journal URL)",
    )
    commands = budget.add_subparsers(dest="budget_command", required=True)
    show = commands.add_parser("show", help="spent and held totals, per user and for everyone")
    show.add_argument("--user", dest="user_id", help="only this user's totals")
    show.add_argument("--json", action="store_true", help="JSON lines for scripts")
    show.set_defaults(handler=_show)
    holds = commands.add_parser(
        "holds", help="reservations held for model calls in flight (or of dead workers)"
    )
    holds.add_argument("--user", dest="user_id", help="only this user's reservations")
    holds.add_argument("--json", action="store_true", help="JSON lines for scripts")
    holds.set_defaults(handler=_holds)
    reclaim = commands.add_parser("reclaim", help="settle the reservations of dead workers now")
    reclaim.add_argument("--json", action="store_true")
    reclaim.set_defaults(handler=_reclaim)
    prune = commands.add_parser(
        "prune", help="delete day and month totals whose period ended long enough ago"
    )
    prune.add_argument(
        "--older-than",
        type=duration,
        required=True,
        help="how long after its end a period's totals are kept, e.g. 90d",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
    )
    prune.add_argument("--json", action="store_true")
    prune.set_defaults(handler=_prune)


def _stores(args: argparse.Namespace) -> Stores:
    """The budget store the options name, through the composition root (no journal opened)."""
    settings = Settings()
    url = existing(_url(args, settings), "budget store")
    return Stores(settings.model_copy(update={"budget_url": url}), journal=False)


def _url(args: argparse.Namespace, settings: Settings) -> str:
    url: str = args.budget_url or settings.budget_url or args.url or settings.runtime_url
    if url.startswith("memory:"):
        raise ConfigurationError(
            "a memory:// budget lives inside one process and cannot be inspected from here; "
            "point LOOMFLOW_BUDGET_URL (or --budget-url) at its SQLite file or PostgreSQL"
        )
    return url


def _row(usage: BucketUsage | UnreadableBucket) -> dict[str, Any]:
    if isinstance(usage, UnreadableBucket):
        # What the row still tells, and why it counts for nothing: never figures read from it.
        return {
            "scope": usage.scope,
            "user_id": usage.user_id,
            "period": usage.period or "all",
            "bucket": usage.key,
            "unreadable": usage.unreadable,
        }
    t = usage.totals
    return {
        "scope": usage.bucket.scope,
        "user_id": usage.bucket.user_id,
        "period": usage.bucket.period or "all",
        "tokens_in": t.tokens_in,
        "tokens_out": t.tokens_out,
        "tokens_total": t.tokens_in + t.tokens_out,
        "cost_usd": t.cost_nanousd / 1e9,
        "model_seconds": round(t.wall_s, 3),
        "calls": t.calls,
        "held_tokens": t.reserved_in + t.reserved_out,
        "held_cost_usd": t.reserved_cost_nanousd / 1e9,
        "updated_at": iso_time(usage.updated_at),
    }


async def _show(args: argparse.Namespace) -> int:
    async with _stores(args) as stores:
        store = stores.budget
        # A row edited by hand or damaged is listed as unreadable, with why, instead of
        # failing the report or being shown as figures; a store without ``listing`` (one
        # written before it) reports what it can read.
        listing = getattr(store, "listing", store.usage)
        usage: list[BucketUsage | UnreadableBucket] = list(await listing(args.user_id))
    rows = [_row(u) for u in usage]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        who = f" for {user_label(args.user_id)}" if args.user_id is not None else ""
        print(f"no budget usage recorded{who}")
        return 0
    table: list[tuple[Any, ...]] = [
        (
            "scope",
            "user",
            "period",
            "tokens in",
            "tokens out",
            "cost USD",
            "model seconds",
            "calls",
            "held tokens",
            "updated (UTC)",
        )
    ]
    for r in rows:
        if "unreadable" in r:
            who = user_cell(r["user_id"])
            table.append((r["scope"] or "-", who, r["period"], "unreadable", *("-",) * 6))
            continue
        when = table_iso(r["updated_at"])
        table.append(
            (
                r["scope"],
                user_cell(r["user_id"]),
                r["period"],
                r["tokens_in"],
                r["tokens_out"],
                f"{r['cost_usd']:.6f}",
                f"{r['model_seconds']:.1f}",
                r["calls"],
                r["held_tokens"],
                when,
            )
        )
    print_table(table)
    for r in rows:
        if "unreadable" in r:
            print(f"loomflow: {printable(r['unreadable'])}", file=sys.stderr)
    return 0


_HOLD_COLUMNS: tuple[str, ...] = ("scope", "user", "held tokens", "held USD", "since (UTC)")
_HOLD_COLUMNS += ("lease ends (UTC)", "reservation", "run", "worker")

# What a hold that names no run shows: one stored before holds named their run (or made by a
# direct StandardBudget.reserve() outside a run). JSON says null.
_UNKNOWN_RUN = "unknown"


def _hold(info: ReservationInfo) -> dict[str, Any]:
    # Every user bucket of a hold is one user's; a hold naming none is left with only global
    # buckets (its user was erased by `users forget` while a dead worker's call held it).
    users = [b.user_id for b in info.buckets if b.scope == "user"]
    amount = info.amount
    return {
        "reservation_id": info.id,
        "scope": "user" if users else "global",
        "user_id": users[0] if users else None,
        "tokens_in": amount.tokens_in,
        "tokens_out": amount.tokens_out,
        "held_tokens": amount.tokens_in + amount.tokens_out,
        "held_cost_usd": amount.cost_nanousd / 1e9,
        "since": iso_time(info.created_at),
        "lease_expires": iso_time(info.expires_at),
        "lease_lapsed": info.expires_at <= time.time(),
        "on_expiry": info.on_expiry,
        "run_id": info.run_id,
        "owner": info.owner,
        "buckets": [[b.scope, b.user_id, b.period or "all"] for b in info.buckets],
    }


async def _holds(args: argparse.Namespace) -> int:
    async with _stores(args) as stores:
        # A hold whose row cannot be read back is left out with a warning naming it (see
        # SqlBudgetStore.reservations), printed on stderr like every log warning.
        listed = await stores.budget.reservations()
    rows = [_hold(info) for info in listed]
    if args.user_id is not None:
        rows = [r for r in rows if r["scope"] == "user" and r["user_id"] == args.user_id]
    # Per user (the anonymous one first, erased ones last), oldest first within each.
    rows.sort(key=lambda r: (r["scope"] != "user", r["user_id"] is not None, r["user_id"] or ""))
    if args.json:
        for row in rows:
            print(json_text(row))
        return 0
    if not rows:
        who = f" for user {user_cell(args.user_id)}" if args.user_id is not None else ""
        print(f"no budget reservations held{who}")
        return 0
    table: list[tuple[Any, ...]] = [_HOLD_COLUMNS]
    for r in rows:
        lease = table_iso(r["lease_expires"])
        table.append(
            (
                r["scope"],
                user_cell(r["user_id"]),
                r["held_tokens"],
                f"{r['held_cost_usd']:.6f}",
                table_iso(r["since"]),
                f"{lease} (lapsed)" if r["lease_lapsed"] else lease,
                r["reservation_id"],
                _UNKNOWN_RUN if r["run_id"] is None else id_cell(r["run_id"]),
                r["owner"],
            )
        )
    print_table(table)
    return 0


_RECLAIM_BATCH = 100


async def _reclaim(args: argparse.Namespace) -> int:
    async with _stores(args) as stores:
        store = stores.budget
        # "Now" means every dead hold, not one worker sweep's worth: sweeps go on while a
        # whole one was settled. The malformed holds left are those the last sweep met.
        count = left = 0
        while True:
            if isinstance(store, SqlBudgetStore):
                settled, left = await store.reclaim_report(limit=_RECLAIM_BATCH)
            else:
                settled = await store.reclaim(limit=_RECLAIM_BATCH)
            count += settled
            if settled < _RECLAIM_BATCH:
                break
    if args.json:
        print(json.dumps({"reclaimed": count, "left": left}))
    elif left:
        print(f"reclaimed {count} reservations, left {left} malformed in place")
    else:
        print(f"reclaimed {count} reservations")
    if not left:
        return 0
    # A hold left in place keeps its amount held until an operator repairs or deletes its
    # row: a script running reclaim must see that, as audit verify's failed check is seen.
    held = (
        "reservation is malformed and was" if left == 1 else "reservations are malformed and were"
    )
    print(
        f"loomflow: {left} {held} left in place, its amount still held, for an operator "
        "to repair or delete (each is named in a warning above)",
        file=sys.stderr,
    )
    return 1


async def _prune(args: argparse.Namespace) -> int:
    if args.older_than < dt.timedelta(days=1):
        # Workers' clocks may lag this host's: a period just ended here may be current there.
        print(
            "loomflow: error: --older-than must be at least 1d, so no worker can still be "
            "counting against a period this prune deletes",
            file=sys.stderr,
        )
        return 2
    async with _stores(args) as stores:
        store = stores.budget
        count = await store.prune(
            ended_before=time.time() - args.older_than.total_seconds(), dry_run=args.dry_run
        )
    if args.dry_run:
        print(
            json.dumps({"would_delete": count})
            if args.json
            else f"would delete {count} budget buckets (dry run: nothing deleted)"
        )
    else:
        print(json.dumps({"deleted": count}) if args.json else f"deleted {count} budget buckets")
    return 0
