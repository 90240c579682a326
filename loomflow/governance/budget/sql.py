"""The budget store on SQLite or PostgreSQL: the SQL is written once for both.

Atomicity comes from one transaction per operation. A reservation upserts each of its buckets
in key order (so two reservations never wait on each other in opposite orders), and each
upsert both locks the row and returns its new totals; the shared ``evaluate`` then decides
and, on a refusal, the transaction rolls back. PostgreSQL row locks let reservations on
different users run in parallel; SQLite takes its write lock up front (``BEGIN IMMEDIATE``).

Measured with ``benchmarks/budget_contention.py`` on a 2-core machine (loopback PostgreSQL,
a user with an all-time and a daily cap, so two buckets per call): a reservation plus its
commit, the budget's whole share of one model call, costs a median 1.7 ms on PostgreSQL and
1.2-1.4 ms on SQLite with ``synchronous=FULL`` (two transactions, each one fsync), against
0.09 ms in memory. That is small next to a model call of a second or more.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from ..._ids import check_id
from ..._printable import is_unicode, shown, text_of
from ...config import Settings
from ...errors import BudgetError, InvalidArgumentError, InvalidUsageError, StorageError
from ...storage import Database, database_from_url
from ...storage._component import SqlLifecycle
from ._owner import owner_is_dead, pid_namespace
from ._store import BudgetStore
from ._types import (
    Amount,
    Bucket,
    BucketLimit,
    BucketUsage,
    CommitResult,
    Denial,
    OnExpiry,
    Reservation,
    ReservationInfo,
    Totals,
    UnreadableBucket,
    ended_periods,
    evaluate,
    late_calls,
    late_charge,
    lease_seconds,
    sweep_limit,
)
from .migrations import COMPONENT, MIGRATIONS

__all__ = ["SqlBudgetStore"]

log = logging.getLogger("loomflow.governance.budget")

_COLUMNS = (
    "tokens_in, tokens_out, cost_nanousd, wall_s, calls, reserved_in, reserved_out, "
    "reserved_cost_nanousd"
)

# No sum of calls gets near this (a call adds at most 10**7 tokens or 10**14 nano-USD), and
# adding one call to it cannot pass the BIGINT range: a larger total was edited in.
_MOST = 2**62


def _spent(column: str, arg: int, kind: str = "BIGINT") -> str:
    # Spent amounts only grow, and a negative or absurd one (edited by hand) stays as it is,
    # so RETURNING shows the damage: adding to a negative one would turn it into a plausible
    # figure short by that much, and to an absurd one fail with an overflow (on PostgreSQL),
    # which would fail the sweep of dead workers' holds for every user.
    old = f"loom_budget_buckets.{column}"
    return (
        f"{column} = CASE WHEN {old} < 0 OR {old} > {_MOST} THEN {old} "
        f"ELSE {old} + CAST(${arg} AS {kind}) END"
    )


def _held(column: str, arg: int) -> str:
    # Held amounts move by a signed delta and never drop below zero (a bucket recreated after
    # a manual clean-up must not start with a negative hold); an absurd one stays, as above.
    old, new = (
        f"loom_budget_buckets.{column}",
        f"loom_budget_buckets.{column} + CAST(${arg} AS BIGINT)",
    )
    return f"{column} = CASE WHEN {old} > {_MOST} THEN {old} WHEN {new} > 0 THEN {new} ELSE 0 END"


_UPSERT = f"""
INSERT INTO loom_budget_buckets
    (bucket, scope, user_id, period, {_COLUMNS}, updated_at)
VALUES ($1, $2, $3, $4, CAST($5 AS BIGINT), CAST($6 AS BIGINT), CAST($7 AS BIGINT),
    CAST($8 AS DOUBLE PRECISION), CAST($9 AS BIGINT),
    CASE WHEN CAST($10 AS BIGINT) > 0 THEN CAST($10 AS BIGINT) ELSE 0 END,
    CASE WHEN CAST($11 AS BIGINT) > 0 THEN CAST($11 AS BIGINT) ELSE 0 END,
    CASE WHEN CAST($12 AS BIGINT) > 0 THEN CAST($12 AS BIGINT) ELSE 0 END,
    {{now}})
ON CONFLICT (bucket) DO UPDATE SET
    {_spent("tokens_in", 5)},
    {_spent("tokens_out", 6)},
    {_spent("cost_nanousd", 7)},
    {_spent("wall_s", 8, "DOUBLE PRECISION")},
    {_spent("calls", 9)},
    {_held("reserved_in", 10)},
    {_held("reserved_out", 11)},
    {_held("reserved_cost_nanousd", 12)},
    updated_at = {{now}}
RETURNING {_COLUMNS}
"""
# SQLite keeps text or a blob in a number column and its arithmetic reads them as 0, so the
# upsert would turn a damaged total into a clean figure (a spent total of 'x' becoming this
# call's amount: the cap loosened and the damage erased). The row is read as stored first.
_STORED = f"SELECT {_COLUMNS} FROM loom_budget_buckets WHERE bucket = $1"
_HOLD = """
INSERT INTO loom_budget_reservations
    (id, owner, buckets, tokens_in, tokens_out, cost_nanousd, on_expiry, created_at, expires_at,
    run_id)
VALUES ($1, $2, $3, CAST($4 AS BIGINT), CAST($5 AS BIGINT), CAST($6 AS BIGINT), $7, {now},
    {now} + CAST($8 AS DOUBLE PRECISION), $9)
"""
_TAKE = """
DELETE FROM loom_budget_reservations WHERE id = $1
RETURNING buckets, tokens_in, tokens_out, cost_nanousd
"""
# A reclaimer re-checks, inside its own transaction, that the hold is still expired (its
# owner may have renewed it meanwhile) unless it saw the owner's process is gone.
# An expiry no lease writes (edited by hand: NaN, an infinity, and on SQLite text, a blob or
# NULL) is never below the clock, so as a live lease it would hold its amount in the user's
# buckets for good: it counts as lapsed. ``now + lease_s`` is a finite number, and both
# databases sort what is none above every number (PostgreSQL's NaN, SQLite's text and blobs).
_LAPSED = (
    "(expires_at < {now} OR expires_at > CAST(1e308 AS DOUBLE PRECISION) OR expires_at IS NULL)"
)
_TAKE_DEAD = f"""
DELETE FROM loom_budget_reservations
WHERE id = $1 AND ({_LAPSED} OR owner = $2)
RETURNING buckets, tokens_in, tokens_out, cost_nanousd, on_expiry
"""
_RENEW = """
UPDATE loom_budget_reservations SET expires_at = {now} + CAST($2 AS DOUBLE PRECISION)
WHERE id = $1 RETURNING 1
"""
# Malformed holds stay where they are (for an operator), so a sweep pages past them: the
# offset is the number it has left so far; what it settled is gone from the set.
_EXPIRED = f"""
SELECT id, owner FROM loom_budget_reservations WHERE {_LAPSED}
ORDER BY expires_at, id LIMIT $1 OFFSET $2
"""
# Pages one sweep reads at most: past this many malformed holds in a row it stops, and the
# next sweep (or `budget reclaim`) starts again from the oldest.
_RECLAIM_PAGES = 10
# Owner ids start with the pid namespace, so a worker can find holds of dead local processes.
_LOCAL = "SELECT id, owner FROM loom_budget_reservations WHERE owner LIKE $1 LIMIT $2"
# The holds left once one is settled by its stored copy (see _check_freed).
_OTHER_HOLDS = "SELECT buckets, tokens_in, tokens_out, cost_nanousd FROM loom_budget_reservations"
_USAGE = f"SELECT bucket, {_COLUMNS}, updated_at, scope, user_id, period FROM loom_budget_buckets"
# Period names sort by time (see ended_periods); a bucket still holding a call is kept.
_PRUNABLE = """
WHERE ((period >= 'day:' AND period < $1) OR (period >= 'month:' AND period < $2))
    AND reserved_in = 0 AND reserved_out = 0 AND reserved_cost_nanousd = 0
"""
_PRUNE = f"DELETE FROM loom_budget_buckets {_PRUNABLE} RETURNING 1"
_PRUNABLE_COUNT = f"SELECT COUNT(*) FROM loom_budget_buckets {_PRUNABLE}"
_RESERVATIONS = """
SELECT id, owner, buckets, tokens_in, tokens_out, cost_nanousd, on_expiry, created_at,
    expires_at, run_id
FROM loom_budget_reservations ORDER BY created_at, id
"""


class _DamagedRow(StorageError):
    """A bucket row whose totals cannot be what loomflow wrote (edited by hand, or damaged)."""


class _Refused(Exception):
    """Raised inside a reservation's transaction to roll it back."""

    def __init__(self, denial: Denial) -> None:
        self.denial = denial


def _damage(row: Sequence[Any]) -> str | None:
    """Why a bucket row's totals cannot be what loomflow wrote, or ``None``.

    SQLite keeps text or a blob in a number column; either database keeps a negative total
    or (for ``wall_s``) an infinite one, which no sum of calls makes: read as figures, a
    negative total would give headroom under a cap, an infinite one prints as bare
    ``Infinity`` in JSON.
    """
    numbers = (*row[:3], *row[4:8])
    if not all(type(n) is int for n in numbers) or type(row[3]) not in (int, float):
        return "text or a blob where a number belongs"
    if any(n < 0 for n in numbers):
        return "a negative total"
    if not math.isfinite(row[3]) or row[3] < 0:
        return "a negative or non-finite model time"
    if any(n > _MOST for n in (*numbers, row[3])):
        return f"a total too large for any sum of calls (over {_MOST})"
    return None


def _totals(row: Sequence[Any], bucket: object = None) -> Totals:
    """A bucket row's totals; a row edited by hand or damaged is a typed error naming it,
    not a ValueError in the middle of a listing, nor figures the budget would trust."""
    why = _damage(row)
    if why is not None:
        figures = ", ".join(repr(v)[:40] for v in row[:8])
        named = "" if bucket is None else f"bucket {shown(bucket)}, "
        raise _DamagedRow(
            f"a budget bucket row is damaged ({named}{why}: totals {figures}): repair or "
            "delete it in loom_budget_buckets"
        )
    tokens_in, tokens_out, cost, calls, reserved_in, reserved_out, reserved_cost = (
        *row[:3],
        *row[4:8],
    )
    return Totals(
        tokens_in, tokens_out, cost, float(row[3]), calls, reserved_in, reserved_out, reserved_cost
    )


def _damaged(key: object, why: str) -> StorageError:
    return _DamagedRow(
        f"a budget bucket row is damaged (bucket {shown(key)}: {why}): repair or delete it in "
        "loom_budget_buckets"
    )


def _usage(row: Sequence[Any]) -> BucketUsage:
    """A row of ``_USAGE`` as a report shows it; a damaged row is a :class:`StorageError`."""
    key = row[0]
    if not isinstance(key, str):
        raise _damaged(key, "the key is not text")
    if not is_unicode(key):  # bytes that are not UTF-8, see storage/_sqlite.read_text
        raise _damaged(key, "the key is text that is not UTF-8")
    try:
        bucket = Bucket.from_key(key)
    except InvalidArgumentError as exc:  # the message names the key
        raise _DamagedRow(
            f"a budget bucket row is damaged ({exc}): repair or delete it in loom_budget_buckets"
        ) from None
    if (bucket.scope, bucket.user_id, bucket.period) != tuple(row[10:13]):
        # The user_id column is what a user's report selects on: a key naming someone else
        # must not put their totals in this user's export.
        raise _damaged(key, "the key does not match the scope, user_id and period columns")
    totals = _totals(row[1:9], key)
    updated = row[9]
    try:
        if type(updated) not in (int, float):
            raise TypeError(f"a {type(updated).__name__}")
        dt.datetime.fromtimestamp(updated, dt.UTC)  # a time a report can print
    except (TypeError, ValueError, OverflowError, OSError) as exc:
        raise _damaged(key, f"updated_at holds {shown(updated)} ({exc})") from None
    return BucketUsage(bucket, totals, float(updated))


def _readable(row: Sequence[Any]) -> BucketUsage | UnreadableBucket:
    try:
        return _usage(row)
    except StorageError as exc:
        return UnreadableBucket(
            text_of(row[0]) or "", text_of(row[10]), text_of(row[11]), text_of(row[12]), str(exc)
        )


def _order(u: BucketUsage | UnreadableBucket) -> tuple[str, str, str]:
    if isinstance(u, UnreadableBucket):
        return (u.scope or "", u.user_id or "", u.period or "")
    return (u.bucket.scope, u.bucket.user_id or "", u.bucket.period)


def _bucket_args(bucket: Bucket) -> tuple[str, str, str | None, str]:
    return (bucket.key, bucket.scope, bucket.user_id, bucket.period)


def _keys(buckets: Sequence[Bucket]) -> str:
    return json.dumps([b.key for b in buckets])


def _still_held(buckets: Sequence[Bucket], stored: object) -> Sequence[Bucket]:
    """The buckets of ``buckets`` a hold's stored list still names; all of them when that list
    cannot be read (edited by hand): what reserve added there is freed either way."""
    try:
        keys = json.loads(stored) if isinstance(stored, str) else None
    except (ValueError, RecursionError):
        keys = None
    if not isinstance(keys, list):
        return buckets
    return [b for b in buckets if b.key in keys]


def _id_as_read(value: object) -> str | bytes:
    return value if isinstance(value, bytes) else str(value)


class _MalformedHold(BudgetError):
    """A reservation row that cannot be read back (edited by hand, or damaged)."""


def _on_expiry(value: object) -> OnExpiry:
    """What a reclaim does with a hold. Anything else (a hand-edited row, text that is not
    UTF-8) is a malformed hold: read as one of the two, a damaged ``charge`` would free the
    held amount of a call that may have been billed without charging it."""
    if value == "charge" or value == "release":
        return value
    raise _MalformedHold(f"its on_expiry {shown(value)} is neither 'charge' nor 'release'")


def _buckets(text: str) -> tuple[Bucket, ...]:
    try:
        buckets = tuple(Bucket.from_key(k) for k in json.loads(text))
    except (ValueError, TypeError, RecursionError) as exc:
        raise _MalformedHold(f"its buckets {str(text)[:80]!r} cannot be read: {exc}") from exc
    if len({b.key for b in buckets}) != len(buckets):
        # Reserve holds once per bucket: settled, a bucket named twice is charged and freed
        # twice.
        raise _MalformedHold(f"its buckets {str(text)[:80]!r} name a bucket twice")
    return buckets


class SqlBudgetStore:
    """Budget totals in SQLite or PostgreSQL, shared by every worker on that database.

    Args:
        database: A :class:`~loomflow.storage.Database` to share (a runtime's
            ``runtime.database``, which this store then never closes), or a store URL
            (``sqlite:///budget.db``, ``postgresql://...``) for a connection of its own.
        auto_migrate: Create or upgrade the tables on first use (default from settings).
        settings: Where defaults come from (``LOOMFLOW_*``).

    Example:
        >>> store = SqlBudgetStore(runtime.database)  # doctest: +SKIP
        >>> store = SqlBudgetStore("postgresql://budget@db/loom")  # doctest: +SKIP
    """

    def __init__(
        self,
        database: Database | str,
        *,
        auto_migrate: bool | None = None,
        settings: Settings | None = None,
    ) -> None:
        s = settings or Settings()
        if isinstance(database, str):
            self.db = database_from_url(database, settings=s)
            self._owns_db = True
        else:
            self.db = database
            self._owns_db = False
        self.backend = self.db.backend
        self._auto_migrate = s.auto_migrate if auto_migrate is None else auto_migrate
        self._life = SqlLifecycle(
            self.db, COMPONENT, MIGRATIONS, owns_db=self._owns_db, auto_migrate=self._auto_migrate
        )

    def __repr__(self) -> str:
        return f"SqlBudgetStore({self.db!r})"

    async def open(self) -> None:
        await self._life.ensure_open()

    async def close(self) -> None:
        await self._life.close()

    async def migrate(self) -> int:
        return await self._life.migrate()

    async def reserve(
        self,
        reservation: Reservation,
        limits: Sequence[BucketLimit],
        *,
        hard: bool,
        lease_s: float,
    ) -> Denial | None:
        lease = lease_seconds(lease_s)
        await self.open()
        held = reservation.amount
        try:
            async with self.db.transaction(what="budget reservation") as tx:
                before: dict[str, Totals] = {}
                for bucket in sorted(reservation.buckets, key=lambda b: b.key):
                    await self._check_stored(tx, bucket)
                    rows = await tx.fetch(
                        _UPSERT,
                        *_bucket_args(bucket),
                        0,
                        0,
                        0,
                        0.0,
                        0,
                        held.tokens_in,
                        held.tokens_out,
                        held.cost_nanousd,
                    )
                    after = _totals(rows[0], bucket.key)
                    before[bucket.key] = Totals(
                        after.tokens_in,
                        after.tokens_out,
                        after.cost_nanousd,
                        after.wall_s,
                        after.calls,
                        after.reserved_in - held.tokens_in,
                        after.reserved_out - held.tokens_out,
                        after.reserved_cost_nanousd - held.cost_nanousd,
                    )
                    was = before[bucket.key]
                    if min(was.reserved_in, was.reserved_out, was.reserved_cost_nanousd) < 0:
                        # Not reachable by the upsert (it stops a hold at zero): a negative
                        # hold stored by hand, which would count this call as held already.
                        raise _damaged(bucket.key, "a negative held total")
                denial = evaluate(before, limits, held, hard=hard)
                if denial is not None:
                    raise _Refused(denial)
                await tx.execute(
                    _HOLD,
                    reservation.id,
                    reservation.owner,
                    _keys(reservation.buckets),
                    held.tokens_in,
                    held.tokens_out,
                    held.cost_nanousd,
                    reservation.on_expiry,
                    lease,
                    reservation.run_id,
                )
        except _Refused as refused:
            return refused.denial
        return None

    async def commit(self, reservation: Reservation, actual: Amount) -> CommitResult:
        await self.open()
        async with self.db.transaction(what="budget commit") as tx:
            found = bool(await tx.fetch(_TAKE, reservation.id))
            if found:
                # What reserve added to the buckets is the ticket's amount (no statement
                # changes a stored hold's amount): a copy edited by hand must not decide what
                # is freed, nor fail the commit and lose the call's charge.
                held = reservation.amount
                charged = actual
            else:  # reclaimed meanwhile
                held = Amount()
                charged = late_charge(reservation, actual)
            totals = {}
            calls = 1 if found else late_calls(reservation)
            for bucket in sorted(reservation.buckets, key=lambda b: b.key):
                totals[bucket.key] = await self._move(tx, bucket, charged, held, calls)
        return CommitResult(charged, totals, found)

    async def _check_stored(self, tx: Any, bucket: Bucket) -> None:
        """Refuse a damaged row before an upsert writes over it (see ``_STORED``); only
        SQLite needs this: PostgreSQL's typed columns keep what ``RETURNING`` shows."""
        if self.backend != "sqlite":
            return
        for row in await tx.fetch(_STORED, bucket.key):
            _totals(row, bucket.key)

    async def _move(
        self, tx: Any, bucket: Bucket, spent: Amount, freed: Amount, calls: int
    ) -> Totals:
        await self._check_stored(tx, bucket)
        rows = await tx.fetch(
            _UPSERT,
            *_bucket_args(bucket),
            spent.tokens_in,
            spent.tokens_out,
            spent.cost_nanousd,
            spent.wall_s,
            calls,
            -freed.tokens_in,
            -freed.tokens_out,
            -freed.cost_nanousd,
        )
        return _totals(rows[0], bucket.key)

    async def record(self, buckets: Sequence[Bucket], actual: Amount) -> CommitResult:
        await self.open()
        async with self.db.transaction(what="budget record") as tx:
            totals = {}
            for bucket in sorted(buckets, key=lambda b: b.key):  # the lock order of reserve
                totals[bucket.key] = await self._move(tx, bucket, actual, Amount(), 1)
        return CommitResult(actual, totals, True)

    async def release(self, reservation: Reservation | str) -> bool:
        reservation_id = reservation.id if isinstance(reservation, Reservation) else reservation
        check_id("reservation_id", reservation_id)
        await self.open()
        async with self.db.transaction(what="budget release") as tx:
            rows = await tx.fetch(_TAKE, reservation_id)
            if not rows:
                return False
            if isinstance(reservation, Reservation):
                # As in commit: what reserve added is the ticket's amount, so a stored copy
                # edited by hand neither fails the release nor frees other calls' holds. The
                # stored bucket list still narrows it: a user's erasure drops their buckets
                # from it, and freeing those would write a row naming the user back.
                held, buckets = reservation.amount, _still_held(reservation.buckets, rows[0][0])
            else:
                held, buckets = _stored_amount(rows[0][1:4]), _buckets(rows[0][0])
            after = {}
            for bucket in sorted(buckets, key=lambda b: b.key):
                after[bucket.key] = await self._move(tx, bucket, Amount(), held, 0)
            if not isinstance(reservation, Reservation):
                await _check_freed(tx, after)
        return True

    async def renew(self, reservation_id: str, lease_s: float) -> bool:
        check_id("reservation_id", reservation_id)
        lease = lease_seconds(lease_s)
        await self.open()
        rows = await self.db.fetch(_RENEW, reservation_id, lease, what="budget lease renewal")
        return bool(rows)

    async def reclaim(self, *, limit: int = 100) -> int:
        return (await self.reclaim_report(limit=limit))[0]

    async def reclaim_report(self, *, limit: int = 100) -> tuple[int, int]:
        """:meth:`reclaim`, returning ``(settled, left)``: ``left`` counts the malformed holds
        met and left in place for an operator (each logged as a warning saying why)."""
        limit = sweep_limit(limit)
        await self.open()
        # Ids are kept as read: a blob id (edited in on SQLite) finds its row only as a blob,
        # and as text would be skipped without a word, its amount held for good.
        candidates: dict[str | bytes, str] = {}
        for row in await self.db.fetch(_EXPIRED, limit, 0, what="budget reclaim"):
            candidates[_id_as_read(row[0])] = ""
        expired = set(candidates)
        full_page = len(candidates) == limit
        namespace = pid_namespace()
        if namespace != "unknown":
            for row in await self.db.fetch(_LOCAL, f"{namespace}:%", limit, what="budget reclaim"):
                if owner_is_dead(str(row[1])):
                    candidates[_id_as_read(row[0])] = str(row[1])
        reclaimed, kept = await self._settle(candidates)
        seen = set(candidates)
        offset, pages = len(kept & expired), 1
        # A page the sweep could not settle (malformed holds, left in place) must not hide
        # the sound ones behind it for good: it reads on past what it left.
        while full_page and reclaimed < limit and pages < _RECLAIM_PAGES:
            rows = await self.db.fetch(_EXPIRED, limit, offset, what="budget reclaim")
            pages += 1
            full_page = len(rows) == limit
            page = {_id_as_read(r[0]): "" for r in rows}
            fresh = {k: v for k, v in page.items() if k not in seen}
            if not fresh:
                break
            seen.update(fresh)
            settled, left_here = await self._settle(fresh)
            reclaimed += settled
            kept |= left_here
            offset += len(left_here)
        return reclaimed, len(kept)

    async def _settle(self, candidates: dict[str | bytes, str]) -> tuple[int, set[str | bytes]]:
        """Settle each hold (``{id: dead owner or ""}``) in its own transaction; return how
        many it settled and the ids of the malformed ones it left in place."""
        reclaimed, left = 0, set[str | bytes]()
        for reservation_id, dead_owner in candidates.items():
            text = reservation_id if isinstance(reservation_id, str) else ""
            if not (is_unicode(text) and is_unicode(dead_owner)):
                # Text that is not UTF-8 (see storage/_sqlite.read_text) cannot be bound to
                # find the row again: left in place, as a malformed hold is.
                log.warning(
                    "budget reservation %r is malformed and was not reclaimed: its id or "
                    "owner is text that is not UTF-8",
                    reservation_id,
                )
                left.add(reservation_id)
                continue
            # One transaction per hold: a reclaimer never holds two holds' locks at once, so
            # it cannot deadlock with a worker committing one of them.
            try:
                async with self.db.transaction(what="budget reclaim") as tx:
                    rows = await tx.fetch(_TAKE_DEAD, reservation_id, dead_owner)
                    if not rows:
                        continue
                    held = _stored_amount(rows[0][1:4])
                    charge = _on_expiry(rows[0][4]) == "charge"
                    after = {}
                    for bucket in sorted(_buckets(rows[0][0]), key=lambda b: b.key):
                        after[bucket.key] = await self._move(
                            tx, bucket, held if charge else Amount(), held, 1 if charge else 0
                        )
                    await _check_freed(tx, after)
                    reclaimed += 1
            except (_MalformedHold, _DamagedRow, ValueError, TypeError) as exc:
                # Rolled back and left in place: one bad row (the hold, or a bucket it names)
                # must not fail the model calls of every worker (reclaim runs before
                # reservations), nor be settled blindly.
                log.warning(
                    "budget reservation %r is malformed and was not reclaimed: %s",
                    reservation_id,
                    exc,
                )
                left.add(reservation_id)
        return reclaimed, left

    async def totals(self, keys: Sequence[str]) -> dict[str, Totals]:
        if not keys:
            return {}
        await self.open()
        marks = ", ".join(f"${i}" for i in range(1, len(keys) + 1))
        rows = await self.db.fetch(f"{_USAGE} WHERE bucket IN ({marks})", *keys, what="budget read")
        return {str(r[0]): _totals(r[1:9], r[0]) for r in rows}

    async def usage(self, user_id: str | None = None) -> list[BucketUsage]:
        """Every bucket (or one user's); a damaged row is a :class:`StorageError` naming it
        (see :meth:`listing` for a report that shows it instead)."""
        return sorted((_usage(r) for r in await self._usage_rows(user_id)), key=_order)

    async def listing(self, user_id: str | None = None) -> list[BucketUsage | UnreadableBucket]:
        """:meth:`usage` for people: a row that cannot be read back (edited by hand, a
        negative or infinite total) is an :class:`UnreadableBucket` saying why, instead of
        failing the report."""
        return sorted((_readable(r) for r in await self._usage_rows(user_id)), key=_order)

    async def _usage_rows(self, user_id: str | None) -> Sequence[Sequence[Any]]:
        check_id("user_id", user_id)  # a driver error would read as the store being down
        await self.open()
        if user_id is None:
            return await self.db.fetch(_USAGE, what="budget read")
        # Only a user bucket names a user: a row naming this one is theirs whatever its scope
        # (one edited by hand is listed, unreadable, rather than hidden from their report).
        return await self.db.fetch(f"{_USAGE} WHERE user_id = $1", user_id, what="budget read")

    async def forget_user(self, user_id: str | None) -> int:
        check_id("user_id", user_id)  # an id no bucket has is no erasure to report as done
        await self.open()
        # As in a listing, a row naming the user is erased whatever its scope.
        cond, args = (
            ("scope = 'user' AND user_id IS NULL", [])
            if user_id is None
            else ("user_id = $1", [user_id])
        )
        async with self.db.transaction(what="budget forget") as tx:
            rows = await tx.fetch(
                f"DELETE FROM loom_budget_buckets WHERE {cond} RETURNING 1", *args
            )
            # A hold left by a dead worker names the user's buckets: without this, it would
            # keep the user's id and a reclaim would write their bucket back afterwards.
            # Holds are found by their bucket list, not their id: an id edited into text
            # that is not UTF-8 cannot be bound, and must not fail the erasure; holds with
            # the same list are all changed alike anyway.
            for (text,) in await tx.fetch("SELECT DISTINCT buckets FROM loom_budget_reservations"):
                if not (isinstance(text, str) and is_unicode(text)):
                    continue  # left for an operator, as reclaim leaves it
                try:
                    buckets = _buckets(text)
                except _MalformedHold:
                    continue
                keep = [b for b in buckets if not (b.scope == "user" and b.user_id == user_id)]
                if len(keep) == len(buckets):
                    continue
                if keep:  # everyone's buckets keep their share of the hold
                    await tx.execute(
                        "UPDATE loom_budget_reservations SET buckets = $1 WHERE buckets = $2",
                        _keys(keep),
                        text,
                    )
                else:
                    await tx.execute(
                        "DELETE FROM loom_budget_reservations WHERE buckets = $1", text
                    )
        return len(rows)

    async def prune(self, *, ended_before: float, dry_run: bool = False) -> int:
        await self.open()
        days, months = ended_periods(ended_before)
        if dry_run:
            rows = await self.db.fetch(_PRUNABLE_COUNT, days, months, what="budget read")
            return int(rows[0][0])
        rows = await self.db.fetch(_PRUNE, days, months, what="budget prune")
        return len(rows)

    async def reservations(self) -> list[ReservationInfo]:
        """Every hold, oldest first; a row that cannot be read back (edited by hand) is left
        out with a warning naming it and why, instead of failing the listing."""
        await self.open()
        listed = []
        for row in await self.db.fetch(_RESERVATIONS, what="budget read"):
            try:
                listed.append(_reservation(row))
            except _MalformedHold as exc:
                log.warning(
                    "budget reservation %s is unreadable and left out of the listing (%s): "
                    "repair or delete it in loom_budget_reservations",
                    shown(row[0]),
                    exc,
                )
        return listed


async def _check_freed(tx: Any, after: dict[str, Totals]) -> None:
    """Refuse (a :class:`_MalformedHold`, rolling the settlement back) a hold settled by its
    stored copy that freed what other holds still hold: their buckets' held totals, once it
    is gone, must still cover every hold left in them.

    Reserve and settle move a hold's amount in its buckets and its row in one transaction,
    so only a row edited in (a bucket named twice, an amount its buckets never held) breaks
    this. Released, such a row would free the holds of calls still in flight, and a hard
    cap would let the next calls through past it. The settling transaction already locks
    each bucket (its upsert), so no hold in them comes or goes while the others are summed.
    One read of every hold: there are as many as calls in flight, and settling by the
    stored copy happens only to dead workers' holds and ``release(id)``.
    """
    left = {key: [0, 0, 0] for key in after}
    for stored, *amount in await tx.fetch(_OTHER_HOLDS):
        try:
            keys = {b.key for b in _buckets(stored)} & left.keys()
            counted = _stored_amount(amount)
        except (_MalformedHold, TypeError):
            continue  # an unreadable hold is counted by no one (and settled by no one)
        for key in keys:
            for i, value in enumerate(
                (counted.tokens_in, counted.tokens_out, counted.cost_nanousd)
            ):
                left[key][i] += value
    for key, totals in after.items():
        held = (totals.reserved_in, totals.reserved_out, totals.reserved_cost_nanousd)
        if any(h < o for h, o in zip(held, left[key], strict=True)):
            raise _MalformedHold(
                f"settling it would free what other calls hold in bucket {shown(key)} (the "
                f"bucket would hold {held[0]}/{held[1]} tokens and {held[2]} nano-USD, its "
                f"other holds {left[key][0]}/{left[key][1]} and {left[key][2]}): its amount "
                "or bucket list was edited"
            )


def _stored_amount(values: Sequence[Any]) -> Amount:
    """A hold's stored ``tokens_in, tokens_out, cost_nanousd``, as reserve wrote them; else a
    :class:`_MalformedHold` naming the column (``int()`` would read 3.7 as 3 or '9' as 9, and
    settle a part of what the buckets hold, the rest held for good with no hold to say why)."""
    for column, value in zip(("tokens_in", "tokens_out", "cost_nanousd"), values, strict=True):
        if type(value) is not int or value < 0:
            raise _MalformedHold(f"its {column} {shown(value)} is no amount")
    try:
        return Amount(*values)
    except InvalidUsageError as exc:  # beyond what one call can hold
        raise _MalformedHold(f"its amount cannot be what a call reserved: {exc}") from None


def _reservation(row: Sequence[Any]) -> ReservationInfo:
    """A row of ``_RESERVATIONS``; a :class:`_MalformedHold` naming the column that cannot be
    what loomflow wrote (text where a number belongs, a negative amount, a time that is no
    finite number, an id, owner or run id that is not UTF-8 text). A NULL run id is a hold
    stored before the column existed, or made outside a run: unknown, not malformed."""
    for column, value in (("id", row[0]), ("owner", row[1]), ("buckets", row[2])):
        if not (isinstance(value, str) and is_unicode(value)):
            raise _MalformedHold(f"its {column} {shown(value)} is not text")
    run_id = row[9]
    if run_id is not None and not (isinstance(run_id, str) and is_unicode(run_id)):
        raise _MalformedHold(f"its run_id {shown(run_id)} is not text")
    buckets = _buckets(row[2])
    amount = _stored_amount(row[3:6])
    for column, value in (("created_at", row[7]), ("expires_at", row[8])):
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _MalformedHold(f"its {column} {shown(value)} is no time")
    return ReservationInfo(
        row[0],
        row[1],
        buckets,
        amount,
        _on_expiry(row[6]),
        float(row[7]),
        float(row[8]),
        run_id,
    )


_check: type[BudgetStore] = SqlBudgetStore  # the class must satisfy the protocol
