"""One conformance suite for every budget store.

Subclass :class:`BudgetStoreConformance` in a test module and provide a ``make_store``
fixture: an async factory whose every call returns a store over the *same* storage (as another
worker process would see it)::

    class TestMyStore(BudgetStoreConformance):
        @pytest.fixture
        async def make_store(self):
            stores = []
            async def factory():
                store = MyBudgetStore(DSN)
                stores.append(store)
                return store
            yield factory
            for store in stores:
                await store.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence

import pytest
from ulid import ULID

from ..errors import InvalidArgumentError, InvalidIdError
from ..governance.budget import (
    Amount,
    Bucket,
    BucketLimit,
    BudgetStore,
    Cap,
    OnExpiry,
    Reservation,
)

__all__ = ["BudgetStoreConformance", "StoreFactory"]

StoreFactory = Callable[[], Awaitable[BudgetStore]]

_ALICE = Bucket("user", "alice")
_BOB = Bucket("user", "bob")
_EVERYONE = Bucket("global", None)


def _hold(
    *buckets: Bucket,
    tokens_in: int = 10,
    tokens_out: int = 20,
    cost: int = 0,
    on_expiry: OnExpiry = "charge",
) -> Reservation:
    """A reservation of a fixed amount in ``buckets``."""
    return Reservation(
        str(ULID()),
        "conformance:0:test:x",
        buckets,
        Amount(tokens_in, tokens_out, cost),
        on_expiry,
    )


def _limit(bucket: Bucket, metric: str, value: float) -> BucketLimit:
    cap = Cap(metric, value, scope=bucket.scope)  # type: ignore[arg-type]
    return BucketLimit(bucket.key, cap.name, cap.metric, value)


async def _reserve(
    store: BudgetStore,
    reservation: Reservation,
    limits: Sequence[BucketLimit] = (),
    *,
    hard: bool = True,
    lease_s: float = 60.0,
) -> bool:
    return await store.reserve(reservation, limits, hard=hard, lease_s=lease_s) is None


class BudgetStoreConformance:
    """Behaviour every budget store must show (see the module docstring)."""

    @pytest.fixture
    async def store(self, make_store: StoreFactory) -> BudgetStore:
        return await make_store()

    async def test_a_hold_is_visible_until_committed(self, store: BudgetStore) -> None:
        r = _hold(_ALICE)
        assert await _reserve(store, r)
        totals = (await store.totals([_ALICE.key]))[_ALICE.key]
        assert (totals.reserved_in, totals.reserved_out, totals.tokens_in) == (10, 20, 0)
        result = await store.commit(r, Amount(7, 5, 0, 0.25))
        assert result.reservation_found
        assert result.charged == Amount(7, 5, 0, 0.25)
        after = result.totals[_ALICE.key]
        assert (after.tokens_in, after.tokens_out, after.wall_s, after.calls) == (7, 5, 0.25, 1)
        assert (after.reserved_in, after.reserved_out) == (0, 0)
        assert await store.reservations() == []

    async def test_a_hold_names_its_run(self, store: BudgetStore) -> None:
        r = dataclasses.replace(_hold(_ALICE), run_id="01RUNOFTHECALL")
        anonymous = _hold(_ALICE)  # made outside a run: the run is unknown
        assert await _reserve(store, r)
        assert await _reserve(store, anonymous)
        listed = {x.id: x.run_id for x in await store.reservations()}
        assert listed == {r.id: "01RUNOFTHECALL", anonymous.id: None}

    async def test_record_charges_without_a_hold(self, store: BudgetStore) -> None:
        result = await store.record((_ALICE, _EVERYONE), Amount(3, 4, 9, 0.5))
        assert result.charged == Amount(3, 4, 9, 0.5)
        again = await store.record((_ALICE,), Amount(1, 1, 1, 0.0))
        alice = again.totals[_ALICE.key]
        assert (alice.tokens_in, alice.tokens_out, alice.cost_nanousd, alice.calls) == (4, 5, 10, 2)
        assert (alice.reserved_in, alice.reserved_out, alice.reserved_cost_nanousd) == (0, 0, 0)
        everyone = (await store.totals([_EVERYONE.key]))[_EVERYONE.key]
        assert (everyone.tokens_in, everyone.calls) == (3, 1)
        assert await store.reservations() == []
        # A hold taken meanwhile by another call is left as it is.
        r = _hold(_ALICE)
        assert await _reserve(store, r)
        held = (await store.record((_ALICE,), Amount(1, 0, 0))).totals[_ALICE.key]
        assert (held.reserved_in, held.tokens_in) == (10, 5)

    async def test_release_frees_the_hold_without_charging(self, store: BudgetStore) -> None:
        r = _hold(_ALICE, _EVERYONE)
        assert await _reserve(store, r)
        assert await store.release(r.id)
        assert not await store.release(r.id)  # a second release finds nothing
        by_ticket = _hold(_ALICE, _EVERYONE)
        assert await _reserve(store, by_ticket)
        assert await store.release(by_ticket)  # StandardBudget passes the Reservation
        assert not await store.release(by_ticket)
        for totals in (await store.totals([_ALICE.key, _EVERYONE.key])).values():
            assert (totals.tokens_in, totals.reserved_in, totals.reserved_out) == (0, 0, 0)

    async def test_hard_mode_refuses_what_would_cross_and_changes_nothing(
        self, store: BudgetStore
    ) -> None:
        cap = [_limit(_ALICE, "tokens_total", 100)]
        first, second, third = (
            _hold(_ALICE),
            _hold(_ALICE),
            _hold(_ALICE, tokens_in=50, tokens_out=1),
        )
        assert await _reserve(store, first, cap)  # 30 held
        assert await _reserve(store, second, cap)  # 60 held
        denial = await store.reserve(third, cap, hard=True, lease_s=60)
        assert denial is not None
        assert (denial.cap, denial.limit, denial.used, denial.reserved) == (
            "user.tokens_total",
            100,
            0,
            60,
        )
        assert denial.requested == 51
        totals = (await store.totals([_ALICE.key]))[_ALICE.key]
        assert totals.reserved_in + totals.reserved_out == 60
        assert {r.id for r in await store.reservations()} == {first.id, second.id}

    async def test_soft_mode_refuses_only_once_the_cap_is_used_up(self, store: BudgetStore) -> None:
        cap = [_limit(_ALICE, "tokens_total", 40)]
        assert await _reserve(store, _hold(_ALICE), cap, hard=False)  # 30 of 40 held
        assert await _reserve(store, _hold(_ALICE), cap, hard=False)  # 60: soft lets it overshoot
        assert not await _reserve(store, _hold(_ALICE), cap, hard=False)

    async def test_a_reservation_is_all_or_nothing_across_buckets(self, store: BudgetStore) -> None:
        assert await _reserve(store, _hold(_BOB, _EVERYONE, tokens_in=90, tokens_out=0))
        caps = [_limit(_ALICE, "tokens_total", 1000), _limit(_EVERYONE, "tokens_in", 99)]
        assert not await _reserve(store, _hold(_ALICE, _EVERYONE), caps)
        totals = await store.totals([_ALICE.key, _EVERYONE.key])
        alice = totals.get(_ALICE.key)
        assert alice is None or alice.reserved_in == 0  # nothing held for alice either
        assert totals[_EVERYONE.key].reserved_in == 90

    async def test_users_do_not_share_buckets(self, store: BudgetStore) -> None:
        tricky = Bucket("user", '["alice"]')
        anonymous = Bucket("user", None)
        for bucket in (_ALICE, tricky, anonymous):
            r = _hold(bucket)
            assert await _reserve(store, r)
            await store.commit(r, Amount(1, 1))
        assert len({_ALICE.key, tricky.key, anonymous.key}) == 3
        mine = await store.usage("alice")
        assert [u.bucket for u in mine] == [_ALICE]
        assert mine[0].totals.tokens_in == 1
        assert {u.bucket for u in await store.usage()} == {_ALICE, tricky, anonymous}

    async def test_forget_user_drops_only_that_users_buckets(self, store: BudgetStore) -> None:
        tricky = Bucket("user", '["alice"]')
        anonymous = Bucket("user", None)
        for bucket in (_ALICE, tricky, anonymous):
            r = _hold(bucket, _EVERYONE)
            assert await _reserve(store, r)
            await store.commit(r, Amount(1, 1))
        assert await store.forget_user("alice") == 1
        assert await store.usage("alice") == []
        left = {u.bucket for u in await store.usage()}
        assert left == {tricky, anonymous, _EVERYONE}  # global totals name no user: kept
        assert await store.forget_user(None) == 1
        assert await store.forget_user("alice") == 0

    async def test_forget_user_takes_the_user_out_of_a_dead_workers_holds(
        self, make_store: StoreFactory
    ) -> None:
        # A worker died during a call: its hold names the user's bucket. Forgetting the user
        # must not leave their id in the hold, nor let a reclaim write their bucket back.
        dead, alive = await make_store(), await make_store()
        both, only_alice, bobs = _hold(_ALICE, _EVERYONE), _hold(_ALICE), _hold(_BOB)
        for r in (both, only_alice, bobs):
            assert await _reserve(dead, r, lease_s=0.05)
        assert await alive.forget_user("alice") == 1
        held = {x.id: set(x.buckets) for x in await alive.reservations()}
        assert held == {both.id: {_EVERYONE}, bobs.id: {_BOB}}
        await asyncio.sleep(0.3)
        assert await alive.reclaim() == 2
        assert await alive.usage("alice") == []
        totals = await alive.totals([_EVERYONE.key, _BOB.key])
        assert (totals[_EVERYONE.key].tokens_in, totals[_EVERYONE.key].reserved_in) == (10, 0)
        assert (totals[_BOB.key].tokens_in, totals[_BOB.key].reserved_in) == (10, 0)

    async def test_concurrent_reservations_never_overshoot_a_hard_cap(
        self, make_store: StoreFactory
    ) -> None:
        # Two store objects stand for two workers; 40 calls race for room for exactly 13.
        stores = [await make_store(), await make_store()]
        cap = [_limit(_ALICE, "tokens_total", 400), _limit(_EVERYONE, "tokens_total", 10_000)]
        holds = [_hold(_ALICE, _EVERYONE) for _ in range(40)]
        granted = await asyncio.gather(
            *(_reserve(stores[i % 2], h, cap) for i, h in enumerate(holds))
        )
        assert sum(granted) == 13  # 13 * 30 = 390 <= 400 < 14 * 30
        totals = (await stores[0].totals([_ALICE.key]))[_ALICE.key]
        assert totals.reserved_in + totals.reserved_out == 390
        for h, ok in zip(holds, granted, strict=True):
            if ok:
                await stores[1].commit(h, Amount(10, 20))
        after = await stores[0].totals([_ALICE.key, _EVERYONE.key])
        assert after[_ALICE.key].tokens_in + after[_ALICE.key].tokens_out == 390
        assert after[_EVERYONE.key].calls == 13

    async def test_cost_caps_compare_exactly(self, store: BudgetStore) -> None:
        # 0.3 USD is not exact in binary; a cap of exactly the spend must still admit it.
        cap = [_limit(_ALICE, "cost_usd", 0.3)]
        for _ in range(3):
            r = _hold(_ALICE, cost=100_000_000)
            assert await _reserve(store, r, cap)
            await store.commit(r, Amount(10, 20, 100_000_000))
        assert not await _reserve(store, _hold(_ALICE, cost=1), cap)

    async def test_a_time_cap_refuses_once_reached(self, store: BudgetStore) -> None:
        cap = [_limit(_ALICE, "wall_clock_s", 1.0)]
        r = _hold(_ALICE)
        assert await _reserve(store, r, cap)
        await store.commit(r, Amount(1, 1, 0, 1.5))  # the call ran past the cap
        assert not await _reserve(store, _hold(_ALICE), cap)

    async def test_an_expired_hold_is_reclaimed_and_charged_in_full(
        self, make_store: StoreFactory
    ) -> None:
        dead, alive = await make_store(), await make_store()
        r = _hold(_ALICE, _EVERYONE)
        assert await _reserve(dead, r, lease_s=0.05)
        kept = _hold(_ALICE)
        assert await _reserve(alive, kept, lease_s=60)
        await asyncio.sleep(0.3)
        assert await alive.reclaim() == 1
        assert await alive.reclaim() == 0
        totals = await alive.totals([_ALICE.key, _EVERYONE.key])
        # Charged as spent (the call may have been billed), and no longer held.
        assert (totals[_ALICE.key].tokens_in, totals[_ALICE.key].tokens_out) == (10, 20)
        assert totals[_ALICE.key].reserved_in == 10  # only the live hold is left
        assert totals[_EVERYONE.key].reserved_in == 0
        assert [x.id for x in await alive.reservations()] == [kept.id]
        # The worker that was thought dead commits late: only the excess is charged.
        late = await dead.commit(r, Amount(15, 5))
        assert not late.reservation_found
        assert late.charged == Amount(5, 0)
        assert late.totals[_ALICE.key].tokens_in == 15
        assert late.totals[_ALICE.key].reserved_in == 10
        assert late.totals[_ALICE.key].calls == 1  # counted once, by the reclaim

    async def test_an_expired_hold_can_be_released_instead(self, make_store: StoreFactory) -> None:
        dead, alive = await make_store(), await make_store()
        cap = [_limit(_ALICE, "tokens_total", 40)]
        r = _hold(_ALICE, on_expiry="release")
        assert await _reserve(dead, r, cap, lease_s=0.05)
        assert not await _reserve(alive, _hold(_ALICE), cap)  # 30 held + 30 > 40
        await asyncio.sleep(0.3)
        [info] = await alive.reservations()
        assert info.on_expiry == "release"
        assert await alive.reclaim() == 1
        totals = (await alive.totals([_ALICE.key]))[_ALICE.key]
        assert (totals.tokens_in, totals.reserved_in, totals.calls) == (0, 0, 0)
        assert await _reserve(alive, _hold(_ALICE), cap)  # the room is back
        late = await dead.commit(r, Amount(15, 5))  # nothing was charged for it: all counts
        assert late.charged == Amount(15, 5)
        # ... and so does the call, which the release did not count.
        assert late.totals[_ALICE.key].calls == 1

    async def test_renewal_keeps_a_hold_alive(self, store: BudgetStore) -> None:
        r = _hold(_ALICE)
        assert await _reserve(store, r, lease_s=0.2)
        for _ in range(3):
            await asyncio.sleep(0.1)
            assert await store.renew(r.id, 0.2)
        assert await store.reclaim() == 0
        assert not await store.renew("no-such-reservation", 1.0)
        await store.release(r.id)
        assert not await store.renew(r.id, 1.0)

    async def test_totals_are_shared_by_every_store_object(self, make_store: StoreFactory) -> None:
        first = await make_store()
        r = _hold(_ALICE)
        assert await _reserve(first, r)
        await first.commit(r, Amount(3, 4))
        second = await make_store()
        totals = (await second.totals([_ALICE.key]))[_ALICE.key]
        assert (totals.tokens_in, totals.tokens_out, totals.calls) == (3, 4, 1)
        listed = await second.usage()
        assert listed[0].updated_at > 0

    async def test_prune_drops_ended_window_buckets_only(self, store: BudgetStore) -> None:
        # 2026-05-08T12:00Z: the day before and April have ended; May 8 and May have not.
        cutoff = 1778241600.0
        names = {
            "old day": Bucket("user", "alice", "day:2026-05-07"),
            "old month": Bucket("global", None, "month:2026-04"),
            "today": Bucket("user", "alice", "day:2026-05-08"),
            "this month": Bucket("user", "alice", "month:2026-05"),
            "all time": Bucket("user", "alice", ""),
            "old but held": Bucket("user", "bob", "day:2026-01-01"),
        }
        for name, bucket in names.items():
            r = _hold(bucket)
            assert await _reserve(store, r)
            if name != "old but held":
                await store.commit(r, Amount(1, 1))
        assert await store.prune(ended_before=cutoff, dry_run=True) == 2
        assert len(await store.usage()) == len(names)  # a dry run deletes nothing
        assert await store.prune(ended_before=cutoff) == 2
        left = {u.bucket.key for u in await store.usage()}
        assert left == {b.key for n, b in names.items() if n not in ("old day", "old month")}
        assert await store.prune(ended_before=cutoff) == 0  # idempotent

    @pytest.mark.parametrize("user_id", [5, b"alice", "", "\udcff", "a\x00b", "a" * 300])
    async def test_a_user_id_no_bucket_has_is_refused_by_name(
        self, store: BudgetStore, user_id: object
    ) -> None:
        assert await _reserve(store, _hold(_ALICE))
        # Not an empty answer (an erasure reported done), nor a driver error read as the
        # store being down.
        for call in (store.usage, getattr(store, "listing", store.usage), store.forget_user):
            with pytest.raises(InvalidIdError, match="user_id"):
                await call(user_id)  # type: ignore[arg-type]  # the point of the test
        assert [u.bucket for u in await store.usage("alice")] == [_ALICE]

    async def test_bad_store_arguments_are_refused_by_name(self, store: BudgetStore) -> None:
        kept = _hold(_ALICE)
        assert await _reserve(store, kept)
        # Each used to differ by backend: memory swept all holds but the last for limit=-1,
        # SQLite all of them and PostgreSQL failed as if down; a NaN lease stored an expiry
        # no clock passes; a surrogate id raised a bare UnicodeEncodeError.
        for limit in (-1, 0, True, "5", 1.5):
            with pytest.raises(InvalidArgumentError, match="limit"):
                await store.reclaim(limit=limit)  # type: ignore[arg-type]  # the point
        for lease in (float("nan"), float("inf"), 0, -1.0, "60", True):
            with pytest.raises(InvalidArgumentError, match="lease_s"):
                await store.renew(kept.id, lease)  # type: ignore[arg-type]  # the point
            with pytest.raises(InvalidArgumentError, match="lease_s"):
                await _reserve(store, _hold(_BOB), lease_s=lease)  # type: ignore[arg-type]
        for bad_id in ("\udcff", 5, "", "a\x00"):
            with pytest.raises(InvalidIdError, match="reservation_id"):
                await store.release(bad_id)  # type: ignore[arg-type]  # the point
            with pytest.raises(InvalidIdError, match="reservation_id"):
                await store.renew(bad_id, 60.0)  # type: ignore[arg-type]  # the point
        assert [r.id for r in await store.reservations()] == [kept.id]
