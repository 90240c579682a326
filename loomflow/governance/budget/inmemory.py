"""A budget store in process memory: for tests, demos and single-process services.

Totals vanish with the process and are not shared between workers; use
:class:`~loomflow.governance.budget.SqlBudgetStore` for anything that must survive a restart.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..._ids import check_id
from ._store import BudgetStore
from ._types import (
    Amount,
    Bucket,
    BucketLimit,
    BucketUsage,
    CommitResult,
    Denial,
    Reservation,
    ReservationInfo,
    Totals,
    UnreadableBucket,
    ended_periods,
    evaluate,
    late_calls,
    late_charge,
    lease_seconds,
    period_ended,
    sweep_limit,
)

__all__ = ["InMemoryBudgetStore"]


@dataclass(slots=True)
class _Row:
    bucket: Bucket
    totals: Totals
    updated_at: float


@dataclass(slots=True)
class _Hold:
    reservation: Reservation
    created_at: float
    expires_at: float


class InMemoryBudgetStore:
    """Budget totals in a dict. Operations never await while they change state, so each one
    is atomic within the event loop, like a transaction.

    Args:
        clock: Unix time for leases (a test may pass a fake one).
    """

    backend = "memory"

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._rows: dict[str, _Row] = {}
        self._holds: dict[str, _Hold] = {}

    def __repr__(self) -> str:
        return f"InMemoryBudgetStore(buckets={len(self._rows)}, holds={len(self._holds)})"

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def migrate(self) -> int:
        return 0

    def _add(self, bucket: Bucket, spent: Amount, held: Amount, sign: int, calls: int) -> Totals:
        row = self._rows.get(bucket.key)
        if row is None:
            row = self._rows[bucket.key] = _Row(bucket, Totals(), self._clock())
        t = row.totals
        row.totals = Totals(
            t.tokens_in + spent.tokens_in,
            t.tokens_out + spent.tokens_out,
            t.cost_nanousd + spent.cost_nanousd,
            t.wall_s + spent.wall_s,
            t.calls + calls,
            max(0, t.reserved_in + sign * held.tokens_in),
            max(0, t.reserved_out + sign * held.tokens_out),
            max(0, t.reserved_cost_nanousd + sign * held.cost_nanousd),
        )
        row.updated_at = self._clock()
        return row.totals

    async def reserve(
        self,
        reservation: Reservation,
        limits: Sequence[BucketLimit],
        *,
        hard: bool,
        lease_s: float,
    ) -> Denial | None:
        lease = lease_seconds(lease_s)
        before = {
            b.key: self._rows[b.key].totals for b in reservation.buckets if b.key in self._rows
        }
        denial = evaluate(before, limits, reservation.amount, hard=hard)
        if denial is not None:
            return denial
        now = self._clock()
        for bucket in reservation.buckets:
            self._add(bucket, Amount(), reservation.amount, +1, 0)
        self._holds[reservation.id] = _Hold(reservation, now, now + lease)
        return None

    async def commit(self, reservation: Reservation, actual: Amount) -> CommitResult:
        hold = self._holds.pop(reservation.id, None)
        found = hold is not None
        charged = actual if found else late_charge(reservation, actual)
        released = reservation.amount if found else Amount()
        calls = 1 if found else late_calls(reservation)
        totals = {b.key: self._add(b, charged, released, -1, calls) for b in reservation.buckets}
        return CommitResult(charged, totals, found)

    async def record(self, buckets: Sequence[Bucket], actual: Amount) -> CommitResult:
        totals = {b.key: self._add(b, actual, Amount(), 0, 1) for b in buckets}
        return CommitResult(actual, totals, True)

    async def release(self, reservation: Reservation | str) -> bool:
        reservation_id = reservation.id if isinstance(reservation, Reservation) else reservation
        check_id("reservation_id", reservation_id)
        hold = self._holds.pop(reservation_id, None)
        if hold is None:
            return False
        for bucket in hold.reservation.buckets:
            self._add(bucket, Amount(), hold.reservation.amount, -1, 0)
        return True

    async def renew(self, reservation_id: str, lease_s: float) -> bool:
        check_id("reservation_id", reservation_id)
        lease = lease_seconds(lease_s)
        hold = self._holds.get(reservation_id)
        if hold is None:
            return False
        hold.expires_at = self._clock() + lease
        return True

    async def reclaim(self, *, limit: int = 100) -> int:
        limit = sweep_limit(limit)
        now = self._clock()
        expired = sorted(
            (h for h in self._holds.values() if h.expires_at < now), key=lambda h: h.expires_at
        )[:limit]
        for hold in expired:
            del self._holds[hold.reservation.id]
            amount = hold.reservation.amount
            charge = hold.reservation.on_expiry == "charge"
            for bucket in hold.reservation.buckets:
                self._add(bucket, amount if charge else Amount(), amount, -1, 1 if charge else 0)
        return len(expired)

    async def totals(self, keys: Sequence[str]) -> dict[str, Totals]:
        return {k: self._rows[k].totals for k in keys if k in self._rows}

    async def usage(self, user_id: str | None = None) -> list[BucketUsage]:
        check_id("user_id", user_id)  # refused as the SQL store refuses it
        rows = [
            BucketUsage(r.bucket, r.totals, r.updated_at)
            for r in self._rows.values()
            if user_id is None or (r.bucket.scope == "user" and r.bucket.user_id == user_id)
        ]
        return sorted(rows, key=lambda u: _order(u.bucket))

    async def listing(self, user_id: str | None = None) -> list[BucketUsage | UnreadableBucket]:
        """:meth:`usage`, as ``SqlBudgetStore.listing`` gives it (memory holds no damage)."""
        return list(await self.usage(user_id))

    async def forget_user(self, user_id: str | None) -> int:
        check_id("user_id", user_id)
        gone = [
            key
            for key, row in self._rows.items()
            if row.bucket.scope == "user" and row.bucket.user_id == user_id
        ]
        for key in gone:
            del self._rows[key]
        # A dead worker's hold on the user's buckets must not write them back on reclaim.
        for hold_id, hold in list(self._holds.items()):
            buckets = hold.reservation.buckets
            keep = tuple(b for b in buckets if not (b.scope == "user" and b.user_id == user_id))
            if len(keep) == len(buckets):
                continue
            if keep:
                hold.reservation = dataclasses.replace(hold.reservation, buckets=keep)
            else:
                del self._holds[hold_id]
        return len(gone)

    async def prune(self, *, ended_before: float, dry_run: bool = False) -> int:
        ended_periods(ended_before)  # refuses a cutoff no date holds, as the SQL store does
        gone = [
            key
            for key, row in self._rows.items()
            if period_ended(row.bucket.period, ended_before) and not _holds_anything(row.totals)
        ]
        if not dry_run:
            for key in gone:
                del self._rows[key]
        return len(gone)

    async def reservations(self) -> list[ReservationInfo]:
        return [
            ReservationInfo(
                h.reservation.id,
                h.reservation.owner,
                h.reservation.buckets,
                h.reservation.amount,
                h.reservation.on_expiry,
                h.created_at,
                h.expires_at,
                h.reservation.run_id,
            )
            for h in sorted(self._holds.values(), key=lambda h: h.created_at)
        ]


def _holds_anything(t: Totals) -> bool:
    return bool(t.reserved_in or t.reserved_out or t.reserved_cost_nanousd)


def _order(bucket: Bucket) -> tuple[str, str, str]:
    return (bucket.scope, bucket.user_id or "", bucket.period)


_check: type[BudgetStore] = InMemoryBudgetStore  # the class must satisfy the protocol
