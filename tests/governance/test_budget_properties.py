"""Property: whatever the order of reservations, commits and releases, a hard cap holds and the
store's figures equal the sum of what happened."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from ulid import ULID

from loomflow.governance.budget import (
    Amount,
    Bucket,
    BucketLimit,
    InMemoryBudgetStore,
    Reservation,
)

ALICE = Bucket("user", "alice")
EVERYONE = Bucket("global", None)
CAPS = [
    BucketLimit(ALICE.key, "user.tokens_total", "tokens_total", 500),
    BucketLimit(EVERYONE.key, "global.cost_usd", "cost_usd", 0.000_01),  # 10 000 nano-USD
]

operation = st.one_of(
    st.tuples(
        st.just("reserve"),
        st.integers(0, 120),
        st.integers(0, 120),
        st.integers(0, 3000),
    ),
    st.tuples(st.just("commit"), st.integers(0, 50), st.floats(0, 1), st.just(0)),
    st.tuples(st.just("release"), st.integers(0, 50), st.just(0.0), st.just(0)),
)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(operation, max_size=60))
def test_a_hard_cap_holds_under_any_interleaving(ops: list[tuple[str, int, float, int]]) -> None:
    asyncio.run(_check(ops))


async def _check(ops: list[tuple[str, int, float, int]]) -> None:
    store = InMemoryBudgetStore()
    open_holds: list[Reservation] = []
    spent_tokens = 0
    spent_cost = 0
    for kind, a, b, c in ops:
        if kind == "reserve":
            r = Reservation(str(ULID()), "w", (ALICE, EVERYONE), Amount(a, int(b), c))
            if await store.reserve(r, CAPS, hard=True, lease_s=60) is None:
                open_holds.append(r)
        elif open_holds:
            r = open_holds.pop(a % len(open_holds))
            if kind == "commit":
                # A call spends at most what it reserved (output is capped by max_tokens).
                held = r.amount
                actual = Amount(
                    int(held.tokens_in * b), int(held.tokens_out * b), int(held.cost_nanousd * b)
                )
                await store.commit(r, actual)
                spent_tokens += actual.tokens_in + actual.tokens_out
                spent_cost += actual.cost_nanousd
            else:
                assert await store.release(r.id)
        totals = await store.totals([ALICE.key, EVERYONE.key])
        user = totals.get(ALICE.key)
        world = totals.get(EVERYONE.key)
        if user is None or world is None:
            assert not open_holds
            assert spent_tokens == 0
            continue
        held_tokens = sum(h.amount.tokens_in + h.amount.tokens_out for h in open_holds)
        held_cost = sum(h.amount.cost_nanousd for h in open_holds)
        assert user.tokens_in + user.tokens_out == spent_tokens
        assert user.reserved_in + user.reserved_out == held_tokens
        assert world.cost_nanousd == spent_cost
        assert world.reserved_cost_nanousd == held_cost
        assert spent_tokens + held_tokens <= 500
        assert spent_cost + held_cost <= 10_000
