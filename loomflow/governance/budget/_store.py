"""The storage seam under the budget: one protocol, sibling backends.

The budget logic (``_budget.py``) is written once against :class:`BudgetStore`. A store keeps
per-bucket totals and the reservations of calls in flight, and makes each operation atomic:
a reservation locks every bucket it touches, re-reads their totals, decides with the shared
:func:`~loomflow.governance.budget._types.evaluate`, and either records the hold everywhere or
nowhere.

Reservations carry a lease. A worker renews the lease while its call runs; a reservation whose
lease ran out (or whose owner process is gone, on the same host) belonged to a dead worker and is
*reclaimed*. By default (``on_expiry="charge"``) its held amounts are then charged as spent,
because the call may well have reached the provider (and been billed) before the worker died:
that overcounts a crashed call rather than ever undercounting one. ``on_expiry="release"``
gives the capacity back instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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
)

__all__ = ["BudgetStore"]


class BudgetStore(Protocol):
    """Storage operations the budget needs; implemented once per backend."""

    backend: str

    async def open(self) -> None:
        """Connect and bring the schema up to date (idempotent)."""

    async def close(self) -> None: ...

    async def migrate(self) -> int:
        """Apply pending migrations; return the schema version now in place."""

    async def reserve(
        self,
        reservation: Reservation,
        limits: Sequence[BucketLimit],
        *,
        hard: bool,
        lease_s: float,
    ) -> Denial | None:
        """Hold ``reservation.amount`` in every one of its buckets, or in none.

        Returns ``None`` when the hold is recorded, or the first limit it would break.
        A ``lease_s`` that is not a finite, positive number is an
        :class:`~loomflow.errors.InvalidArgumentError` (see ``_types.lease_seconds``).
        """

    async def commit(self, reservation: Reservation, actual: Amount) -> CommitResult:
        """Charge what the call really spent and drop its hold, in one transaction.

        If the reservation was reclaimed meanwhile, a charged hold already counts the held
        amount, so only the part of ``actual`` above it is charged; a released one charges
        ``actual`` in full.
        """

    async def record(self, buckets: Sequence[Bucket], actual: Amount) -> CommitResult:
        """Charge a call that held nothing (no cap watches its buckets), in one transaction.

        Counts one call in each bucket, like :meth:`commit` of a found hold.
        """

    async def release(self, reservation: Reservation | str) -> bool:
        """Drop a hold without charging it (the call failed); ``False`` if it was gone.

        Given the :class:`Reservation`, its amount is freed from its buckets, as
        :meth:`commit` frees it; given only an id, the stored copy of the hold is.
        """

    async def renew(self, reservation_id: str, lease_s: float) -> bool:
        """Extend a hold's lease; ``False`` if it was gone (reclaimed)."""

    async def reclaim(self, *, limit: int = 100) -> int:
        """Settle up to ``limit`` (a positive integer) holds of dead workers, per their
        ``on_expiry``; return how many. A hold whose expiry is no number counts as lapsed."""

    async def totals(self, keys: Sequence[str]) -> dict[str, Totals]:
        """The totals of the given buckets (missing buckets are left out)."""

    async def usage(self, user_id: str | None = None) -> list[BucketUsage]:
        """Every bucket, or with ``user_id`` only that user's, in a stable order (a user id
        no bucket can have is an :class:`~loomflow.errors.InvalidIdError`)."""

    async def reservations(self) -> list[ReservationInfo]:
        """Every hold in the store, oldest first."""

    async def forget_user(self, user_id: str | None) -> int:
        """Delete every bucket of one user (``None``: the anonymous user's); return how many.

        Global buckets keep their totals, which name no user. Holds still in the store (left
        by a worker that died during a call) drop the user's buckets, and a hold that named
        only theirs goes, so a later reclaim cannot write the user's buckets back. A user id
        no bucket can have is an :class:`~loomflow.errors.InvalidIdError`."""

    async def prune(self, *, ended_before: float, dry_run: bool = False) -> int:
        """Delete the day and month buckets whose period ended by the Unix time
        ``ended_before`` and that hold nothing; return how many went (with ``dry_run``, would
        go). All-time buckets stay."""
