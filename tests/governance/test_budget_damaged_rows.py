"""Budget rows edited by hand or damaged: refused where they are met, never rewritten as clean
figures, and never a reason to refuse other users' calls."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import pytest

from loomflow.errors import BudgetError, BudgetExceededError, BudgetUnavailableError
from loomflow.governance.budget import Cap, StandardBudget
from loomflow.governance.budget.sql import SqlBudgetStore
from loomflow.messages import Usage


def sqlite_exec(path: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(path)
    try:
        with conn:
            return list(conn.execute(sql))
    finally:
        conn.close()


def _budget(url: str) -> StandardBudget:
    return StandardBudget([Cap("tokens_total", 100_000)], store=SqlBudgetStore(url))


@pytest.mark.parametrize(
    ("column", "value"),
    [("tokens_in", "'x'"), ("cost_nanousd", "x'00'"), ("reserved_in", "'9e9x'")],
)
async def test_a_text_total_on_sqlite_is_refused_not_reset(
    tmp_path: Path, column: str, value: str
) -> None:
    path = tmp_path / "budget.db"
    budget = _budget(f"sqlite:///{path}")
    try:
        ticket = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        await budget.commit(ticket, Usage(input_tokens=90_000, output_tokens=10), model="scripted")
        edit = f"UPDATE loom_budget_buckets SET {column} = {value}"
        await asyncio.to_thread(sqlite_exec, path, edit)
        # SQLite's arithmetic reads text as 0: the reservation's upsert used to store a clean
        # figure over it, so alice got her 90,010 spent tokens back and the damage was gone.
        with pytest.raises(BudgetUnavailableError, match="text or a blob"):
            await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        kind = f"SELECT typeof({column}) FROM loom_budget_buckets"
        assert await asyncio.to_thread(sqlite_exec, path, kind) in ([("text",)], [("blob",)])
    finally:
        await budget.close()


async def test_a_commit_does_not_write_over_a_text_total(tmp_path: Path) -> None:
    path = tmp_path / "budget.db"
    budget = _budget(f"sqlite:///{path}")
    try:
        ticket = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        edit = "UPDATE loom_budget_buckets SET tokens_out = 'x'"
        await asyncio.to_thread(sqlite_exec, path, edit)
        with pytest.raises(BudgetUnavailableError, match="text or a blob"):
            await budget.commit(ticket, Usage(input_tokens=9, output_tokens=1), model="scripted")
        read = "SELECT tokens_out FROM loom_budget_buckets"
        rows = await asyncio.to_thread(sqlite_exec, path, read)
        assert rows == [("x",)]
    finally:
        await budget.close()


async def _reclaim_past_a_damaged_bucket(
    url: str,
    execute: object,
    damage: str = "UPDATE loom_budget_buckets SET tokens_in = -5",
    why: str = "negative total",
) -> None:
    alice = _budget(url)
    bob = _budget(url)
    try:
        await alice.reserve(user_id="alice", model="scripted", max_tokens=10)
        # alice's worker died holding that call (its lease long gone), and her total was
        # damaged meanwhile.
        await execute("UPDATE loom_budget_reservations SET expires_at = 0")  # type: ignore[operator]
        await execute(damage)  # type: ignore[operator]
        # A sweep runs before bob's reservation: it used to raise on alice's row, so every
        # worker refused every user's calls.
        ticket = await bob.reserve(user_id="bob", model="scripted", max_tokens=10)
        await bob.commit(ticket, Usage(input_tokens=3, output_tokens=1), model="scripted")
        # alice's hold is left for an operator, and her calls are still refused.
        assert len(await bob.store.reservations()) == 1
        with pytest.raises(BudgetUnavailableError, match=why):
            await alice.reserve(user_id="alice", model="scripted", max_tokens=10)
    finally:
        await alice.close()
        await bob.close()


async def test_a_dead_hold_on_a_damaged_bucket_does_not_refuse_other_users_sqlite(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "budget.db"

    async def execute(sql: str) -> None:
        await asyncio.to_thread(sqlite_exec, path, sql)

    with caplog.at_level(logging.WARNING, logger="loomflow.governance.budget"):
        await _reclaim_past_a_damaged_bucket(f"sqlite:///{path}", execute)
    assert "is malformed and was not reclaimed" in caplog.text
    assert "negative total" in caplog.text


@pytest.mark.postgres
async def test_a_dead_hold_on_a_damaged_bucket_does_not_refuse_other_users_postgres(
    pg_dsn: str,
) -> None:
    import asyncpg

    async def execute(sql: str) -> None:
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    await _reclaim_past_a_damaged_bucket(pg_dsn, execute)


async def _two_holds(url: str) -> tuple[StandardBudget, str, str]:
    """A budget with a live hold for alice and one for bob; their reservation ids."""
    budget = _budget(url)
    alice = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
    bob = await budget.reserve(user_id="bob", model="scripted", max_tokens=10)
    return budget, alice.reservation.id, bob.reservation.id


async def _pg_execute(dsn: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _lists_past_a_damaged_hold(
    url: str, execute: object, column: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    budget, alice, bob = await _two_holds(url)
    try:
        edit = f"UPDATE loom_budget_reservations SET {column} = {value} WHERE id = '{bob}'"
        await execute(edit)  # type: ignore[operator]
        with caplog.at_level(logging.WARNING, logger="loomflow.governance.budget"):
            listed = await budget.store.reservations()
        # The listing used to fail as a whole (a ValueError, or a BudgetError on the bucket
        # list): alice's hold is listed, bob's is named in a warning saying why it is left out.
        assert [r.id for r in listed] == [alice]
        assert bob in caplog.text
        assert column in caplog.text
        assert "loom_budget_reservations" in caplog.text
    finally:
        await budget.close()


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("tokens_in", "'x'"),
        ("cost_nanousd", "x'00'"),
        ("tokens_out", "-5"),
        ("buckets", "'not json'"),
        ("buckets", "'[1]'"),
        ("on_expiry", "'maybe'"),
        ("created_at", "'yesterday'"),
        ("expires_at", "'nan'"),
        ("expires_at", "9e999"),
        ("owner", "x'ff'"),
        ("run_id", "x'ff'"),
    ],
)
async def test_a_damaged_hold_is_left_out_of_the_listing_sqlite(
    tmp_path: Path, column: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "budget.db"

    async def execute(sql: str) -> None:
        await asyncio.to_thread(sqlite_exec, path, sql)

    await _lists_past_a_damaged_hold(f"sqlite:///{path}", execute, column, value, caplog)


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("tokens_in", "-5"),
        ("buckets", "'{\"a\": 1}'"),
        ("on_expiry", "'maybe'"),
        ("created_at", "'NaN'"),
        ("expires_at", "'NaN'"),
        ("expires_at", "'Infinity'"),
    ],
)
async def test_a_damaged_hold_is_left_out_of_the_listing_postgres(
    pg_dsn: str, column: str, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def execute(sql: str) -> None:
        await _pg_execute(pg_dsn, sql)

    await _lists_past_a_damaged_hold(pg_dsn, execute, column, value, caplog)


async def _reclaims_an_unreadable_expiry(url: str, execute: object, value: str) -> None:
    budget, alice, bob = await _two_holds(url)
    try:
        edit = f"UPDATE loom_budget_reservations SET expires_at = {value} WHERE id = '{bob}'"
        await execute(edit)  # type: ignore[operator]
        # Comparing it with the clock is never true (NaN, an infinity, or text, which SQLite
        # sorts after every number): the hold used to block bob's budget for good.
        assert await budget.reclaim() == 1
        assert [r.id for r in await budget.store.reservations()] == [alice]
        bob_usage = await budget.store.usage("bob")
        assert bob_usage
        assert all(u.totals.reserved_in == 0 for u in bob_usage)
        assert all(u.totals.calls == 1 for u in bob_usage)  # charged, per on_expiry
        # alice's live hold is untouched.
        alice_usage = await budget.store.usage("alice")
        assert alice_usage
        assert all(u.totals.reserved_in > 0 for u in alice_usage)
    finally:
        await budget.close()


@pytest.mark.parametrize("value", ["'nan'", "9e999", "-9e999", "x'00'", "'2030-01-01'"])
async def test_an_unreadable_expiry_is_reclaimed_sqlite(tmp_path: Path, value: str) -> None:
    path = tmp_path / "budget.db"

    async def execute(sql: str) -> None:
        await asyncio.to_thread(sqlite_exec, path, sql)

    await _reclaims_an_unreadable_expiry(f"sqlite:///{path}", execute, value)


@pytest.mark.postgres
@pytest.mark.parametrize("value", ["'NaN'", "'Infinity'", "'-Infinity'"])
async def test_an_unreadable_expiry_is_reclaimed_postgres(pg_dsn: str, value: str) -> None:
    async def execute(sql: str) -> None:
        await _pg_execute(pg_dsn, sql)

    await _reclaims_an_unreadable_expiry(pg_dsn, execute, value)


async def _commits_past_a_damaged_hold_amount(url: str, execute: object, value: str) -> None:
    budget = _budget(url)
    try:
        ticket = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        edit = f"UPDATE loom_budget_reservations SET tokens_in = {value}"
        await execute(edit)  # type: ignore[operator]
        # The commit used to free the stored copy of the amount: text raised a bare
        # ValueError, a negative one an InvalidUsageError about the call's usage, and a
        # fraction freed too little, leaving tokens held in alice's bucket for good.
        await budget.commit(ticket, Usage(input_tokens=5, output_tokens=1), model="scripted")
        [usage] = await budget.store.usage("alice")
        assert (usage.totals.tokens_in, usage.totals.tokens_out, usage.totals.calls) == (5, 1, 1)
        held = (usage.totals.reserved_in, usage.totals.reserved_out)
        assert held == (0, 0)
        assert await budget.store.reservations() == []
    finally:
        await budget.close()


async def _releases_past_a_damaged_hold_amount(url: str, execute: object, value: str) -> None:
    budget = _budget(url)
    try:
        other = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        ticket = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        edit = f"UPDATE loom_budget_reservations SET tokens_in = {value} WHERE id = "
        await execute(f"{edit}'{ticket.reservation.id}'")  # type: ignore[operator]
        # A failed call's release used to free the stored copy: text or a negative figure
        # raised, a fraction freed too little (held for good: the hold was gone), and a large
        # one freed the other call's hold too, so alice could pass her cap meanwhile.
        assert await budget.release(ticket)
        [usage] = await budget.store.usage("alice")
        held = (usage.totals.reserved_in, usage.totals.reserved_out)
        assert held == (other.amount.tokens_in, other.amount.tokens_out)
        assert [r.id for r in await budget.store.reservations()] == [other.reservation.id]
    finally:
        await budget.close()


_SETTLES = {
    "commit": _commits_past_a_damaged_hold_amount,
    "release": _releases_past_a_damaged_hold_amount,
}


@pytest.mark.parametrize("settle", sorted(_SETTLES))
@pytest.mark.parametrize("value", ["'x'", "-50000", "3.7", "x'00'", "9000000"])
async def test_a_settlement_frees_what_was_reserved_past_a_damaged_hold_sqlite(
    tmp_path: Path, value: str, settle: str
) -> None:
    path = tmp_path / "budget.db"

    async def execute(sql: str) -> None:
        await asyncio.to_thread(sqlite_exec, path, sql)

    await _SETTLES[settle](f"sqlite:///{path}", execute, value)


@pytest.mark.postgres
@pytest.mark.parametrize("settle", sorted(_SETTLES))
@pytest.mark.parametrize("value", ["-50000", "9000000"])
async def test_a_settlement_frees_what_was_reserved_past_a_damaged_hold_postgres(
    pg_dsn: str, value: str, settle: str
) -> None:
    async def execute(sql: str) -> None:
        await _pg_execute(pg_dsn, sql)

    await _SETTLES[settle](pg_dsn, execute, value)


async def test_a_release_after_forget_user_does_not_write_the_user_back(tmp_path: Path) -> None:
    caps = [Cap("tokens_total", 100_000), Cap("tokens_total", 10**6, scope="global")]
    budget = StandardBudget(caps, store=SqlBudgetStore(f"sqlite:///{tmp_path / 'b.db'}"))
    try:
        ticket = await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        assert await budget.store.forget_user("alice") == 1
        # The erasure narrowed the live hold to the global bucket; the failed call's release
        # frees that, and must not bring back a bucket row naming alice.
        assert await budget.release(ticket)
        assert await budget.store.usage("alice") == []
        [everyone] = await budget.store.usage()
        assert (everyone.totals.reserved_in, everyone.totals.reserved_out) == (0, 0)
    finally:
        await budget.close()


@pytest.mark.parametrize("value", ["3.7", "-5"])
async def test_a_dead_hold_whose_amount_is_no_count_is_left_for_an_operator(
    tmp_path: Path, value: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "budget.db"
    budget, _, bob = await _two_holds(f"sqlite:///{path}")
    try:
        lapse = f"UPDATE loom_budget_reservations SET expires_at = 0, tokens_in = {value} WHERE "
        await asyncio.to_thread(sqlite_exec, path, f"{lapse}id = '{bob}'")
        # The sweep used to settle int(3.7) = 3 of the 1,024 tokens held and drop the hold:
        # the rest stayed held in bob's bucket for good, with no hold left to say why.
        with caplog.at_level(logging.WARNING, logger="loomflow.governance.budget"):
            assert await budget.reclaim() == 0
        assert "tokens_in" in caplog.text
        count = "SELECT COUNT(*) FROM loom_budget_reservations"
        assert await asyncio.to_thread(sqlite_exec, path, count) == [(2,)]
        [usage] = await budget.store.usage("bob")
        assert (usage.totals.tokens_in, usage.totals.reserved_in) == (0, 1024)
    finally:
        await budget.close()


async def test_forget_user_erases_past_a_hold_whose_id_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "budget.db"
    budget = _budget(f"sqlite:///{path}")
    try:
        await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        await budget.reserve(user_id="bob", model="scripted", max_tokens=10)
        # One of alice's holds (left by a dead worker) has an id edited into bytes that are
        # not UTF-8: binding it back raised a bare UnicodeEncodeError, and the erasure failed.
        edit = (
            "UPDATE loom_budget_reservations SET id = CAST(x'ff41' AS TEXT) WHERE id = "
            "(SELECT MIN(id) FROM loom_budget_reservations WHERE buckets LIKE '%alice%')"
        )
        await asyncio.to_thread(sqlite_exec, path, edit)
        assert await budget.store.forget_user("alice") == 1
        left = "SELECT buckets FROM loom_budget_reservations"
        rows = await asyncio.to_thread(sqlite_exec, path, left)
        assert len(rows) == 1
        assert "alice" not in str(rows)
        assert "bob" in str(rows)
    finally:
        await budget.close()


# A total no sum of calls reaches, edited in: charging alice's dead hold on it overflowed
# BIGINT on PostgreSQL, which failed the sweep before bob's reservation, so bob's calls were
# refused ("bigint out of range"); SQLite read it back as a cap reached.
_ABSURD = f"UPDATE loom_budget_buckets SET tokens_in = {2**63 - 10}"


async def test_an_absurd_total_does_not_refuse_other_users_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "budget.db"

    async def execute(sql: str) -> None:
        await asyncio.to_thread(sqlite_exec, path, sql)

    await _reclaim_past_a_damaged_bucket(f"sqlite:///{path}", execute, _ABSURD, "too large")


@pytest.mark.postgres
async def test_an_absurd_total_does_not_refuse_other_users_postgres(pg_dsn: str) -> None:
    async def execute(sql: str) -> None:
        await _pg_execute(pg_dsn, sql)

    await _reclaim_past_a_damaged_bucket(pg_dsn, execute, _ABSURD, "too large")


async def test_a_hold_owner_naming_no_possible_pid_does_not_fail_the_sweep(
    tmp_path: Path,
) -> None:
    from loomflow.runtime._owner import pid_namespace

    path = tmp_path / "budget.db"
    alice = _budget(f"sqlite:///{path}")
    try:
        await alice.reserve(user_id="alice", model="scripted", max_tokens=10)
        # A hand-edited owner of this pid namespace whose pid no process can have: checking
        # whether it is alive raised OverflowError out of the sweep, and so out of every
        # reservation that ran one.
        edit = f"UPDATE loom_budget_reservations SET owner = '{pid_namespace()}:{10**20}:h:x'"
        await asyncio.to_thread(sqlite_exec, path, edit)
        assert await alice.reclaim() == 0  # its lease still runs: left until it ends
        ticket = await alice.reserve(user_id="bob", model="scripted", max_tokens=10)
        await alice.release(ticket)
    finally:
        await alice.close()


async def test_a_lapsed_hold_whose_id_is_a_blob_is_reclaimed(tmp_path: Path) -> None:
    path = tmp_path / "budget.db"
    budget = _budget(f"sqlite:///{path}")
    try:
        await budget.reserve(user_id="alice", model="scripted", max_tokens=10)
        edit = "UPDATE loom_budget_reservations SET id = x'00ff', expires_at = 0"
        await asyncio.to_thread(sqlite_exec, path, edit)
        # Looked up again by its id as text, a blob id found no row: the hold was skipped
        # without a word, and its amount stayed held in alice's bucket for good.
        assert await budget.reclaim() == 1
        [usage] = await budget.store.usage("alice")
        assert (usage.totals.reserved_in, usage.totals.calls) == (0, 1)
        count = await asyncio.to_thread(
            sqlite_exec, path, "SELECT COUNT(*) FROM loom_budget_reservations"
        )
        assert count == [(0,)]
    finally:
        await budget.close()


@pytest.mark.parametrize(
    "key",
    [
        '["global","alice",""]',  # everyone's totals, carrying a user id
        '["user","alice","week:1"]',  # a period no window has
        '["user","alice","day:9999-99-99"]',
        '["user","alice","month:2026-05-01"]',
    ],
)
def test_a_key_naming_no_bucket_a_budget_has_is_refused(key: str) -> None:
    from loomflow.errors import InvalidArgumentError
    from loomflow.governance.budget import Bucket

    # Read back from a hand-edited hold, such a key was settled into a bucket row of its own
    # (a global one keeping alice's id through her erasure, a period no prune ends).
    with pytest.raises(InvalidArgumentError, match="names no bucket"):
        Bucket.from_key(key)


async def test_a_bucket_whose_scope_was_edited_is_still_listed_and_forgotten(
    tmp_path: Path,
) -> None:
    # A row naming alice whose scope was edited by hand: `budget show --user alice` said "no
    # budget usage recorded" and `users forget alice` left it (both looked at scope 'user'
    # only), while `budget show` listed it as alice's unreadable bucket.
    path = tmp_path / "budget.db"
    budget = _budget(f"sqlite:///{path}")
    try:
        for user in ("alice", "bob"):
            await budget.reserve(user_id=user, model="scripted", max_tokens=10)
        edit = "UPDATE loom_budget_buckets SET scope = 'bogus' WHERE user_id = 'alice'"
        await asyncio.to_thread(sqlite_exec, path, edit)
        listed = await budget.store.listing("alice")
        assert len(listed) == 1
        assert "does not match" in str(listed[0])
        assert await budget.store.forget_user("alice") == 1
        left = await asyncio.to_thread(sqlite_exec, path, "SELECT user_id FROM loom_budget_buckets")
        assert left == [("bob",)]
    finally:
        await budget.close()


async def test_malformed_holds_do_not_keep_a_sweep_from_the_sound_ones_behind_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "budget.db"
    budget, alice, bob = await _two_holds(f"sqlite:///{path}")
    try:
        # 150 copies of bob's hold with an amount no reservation writes, lapsed before
        # alice's sound one: a sweep read the 100 oldest, left them all, and never reached
        # hers, so her 1,034 tokens stayed held for good however often it ran.
        copies = (
            "INSERT INTO loom_budget_reservations (id, owner, buckets, tokens_in, tokens_out, "
            "cost_nanousd, on_expiry, created_at, expires_at) "
            "SELECT 'bad-' || n, owner, buckets, 3.7, tokens_out, cost_nanousd, on_expiry, "
            "created_at, 0 FROM loom_budget_reservations, "
            "(WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 150) "
            f"SELECT n FROM c) WHERE id = '{bob}'"
        )
        await asyncio.to_thread(sqlite_exec, path, copies)
        await asyncio.to_thread(
            sqlite_exec,
            path,
            f"UPDATE loom_budget_reservations SET expires_at = 1 WHERE id = '{alice}'",
        )
        assert await budget.reclaim() == 1
        [usage] = await budget.store.usage("alice")
        assert usage.totals.reserved_in == 0
        settled, left = await budget.store.reclaim_report()  # type: ignore[attr-defined]
        assert (settled, left) == (0, 150)
    finally:
        await budget.close()


# A dead worker's hold edited in beside a live call's: its buckets name alice's bucket once
# (an amount the bucket never held) or twice (a bucket list reserve never writes).
_FORGED_BUCKETS = {
    "once": "buckets",
    "twice": "'[' || substr(buckets, 2, length(buckets) - 2) || ', ' "
    "|| substr(buckets, 2, length(buckets) - 2) || ']'",
}


async def _forged_release_frees_no_live_hold(
    url: str, execute: object, buckets: str, caplog: pytest.LogCaptureFixture
) -> None:
    budget = StandardBudget([Cap("tokens_total", 1000)], store=SqlBudgetStore(url))
    try:
        live = await budget.reserve(
            user_id="alice", model="scripted", max_tokens=100, input_tokens=400
        )
        await execute(  # type: ignore[operator]
            "INSERT INTO loom_budget_reservations (id, owner, buckets, tokens_in, tokens_out, "
            "cost_nanousd, on_expiry, created_at, expires_at) "
            f"SELECT 'forged', 'elsewhere:1:h:o', {buckets}, tokens_in, tokens_out, "
            "cost_nanousd, 'release', created_at, 0 FROM loom_budget_reservations"
        )
        with caplog.at_level(logging.WARNING, logger="loomflow.governance.budget"):
            # Released, it freed the live call's 500 tokens from alice's bucket: the next two
            # calls of 500 were granted beside it, past her cap of 1,000.
            assert await budget.reclaim() == 0
        assert "forged" in caplog.text
        assert "malformed" in caplog.text
        await budget.reserve(user_id="alice", model="scripted", max_tokens=100, input_tokens=400)
        with pytest.raises(BudgetExceededError):
            await budget.reserve(
                user_id="alice", model="scripted", max_tokens=100, input_tokens=400
            )
        # Released by id, it is refused by name and frees nothing either.
        with pytest.raises(BudgetError, match=r"other calls hold|a bucket twice"):
            await budget.store.release("forged")
        totals = await budget.store.totals([live.reservation.buckets[0].key])
        assert [(t.reserved_in, t.reserved_out) for t in totals.values()] == [(800, 200)]
    finally:
        await budget.close()


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
@pytest.mark.parametrize("named", ["once", "twice"])
async def test_a_forged_dead_hold_frees_no_live_hold(
    tmp_path: Path,
    backend: str,
    named: str,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    path = tmp_path / "budget.db"
    url = f"sqlite:///{path}" if backend == "sqlite" else request.getfixturevalue("pg_dsn")

    async def execute(sql: str) -> None:
        if backend == "sqlite":
            await asyncio.to_thread(sqlite_exec, path, sql)
        else:
            await _pg_execute(url, sql)

    await _forged_release_frees_no_live_hold(url, execute, _FORGED_BUCKETS[named], caplog)
