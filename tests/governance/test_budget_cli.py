"""``loomflow budget``, run as a real subprocess against a store a real agent wrote."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.governance.budget import Cap, SqlBudgetStore, StandardBudget
from loomflow.messages import ModelResponse, Usage
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime


def loomflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


async def spend(url: str) -> None:
    budget = StandardBudget(
        [Cap("tokens_total", 10_000), Cap("tokens_total", 50_000, scope="global")],
        store=SqlBudgetStore(url),
    )
    model = FunctionModel(
        lambda m, t: ModelResponse(text="ok", usage=Usage(input_tokens=7, output_tokens=5))
    )
    agent = Agent("x", model=model, budget=budget)
    for user in ("alice", "alice", "bob"):
        await agent.run("go", user_id=user)
    await budget.close()


@pytest.fixture
def budget_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'budget.db'}"
    asyncio.run(spend(url))
    return url


def test_show_lists_every_bucket_as_json(budget_url: str) -> None:
    result = loomflow("budget", "--budget-url", budget_url, "show", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    by_who = {(r["scope"], r["user_id"]): r for r in rows}
    assert set(by_who) == {("global", None), ("user", "alice"), ("user", "bob")}
    assert by_who[("user", "alice")]["tokens_total"] == 24
    assert by_who[("user", "alice")]["calls"] == 2
    assert by_who[("global", None)]["tokens_in"] == 21
    assert all(r["held_tokens"] == 0 for r in rows)


def test_show_one_user_as_a_table(budget_url: str) -> None:
    result = loomflow("budget", "show", "--user", "bob", env={"LOOMFLOW_BUDGET_URL": budget_url})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["scope", "user", "period"]
    assert len(lines) == 2
    assert lines[1].split()[:5] == ["user", "bob", "all", "7", "5"]
    nobody = loomflow("budget", "--budget-url", budget_url, "show", "--user", "zoe")
    assert nobody.stdout.strip() == "no budget usage recorded for user 'zoe'"


def test_the_budget_defaults_to_the_journal_database(tmp_path: Path) -> None:
    journal = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(spend(journal))
    result = loomflow("--url", journal, "budget", "show", "--json")
    assert len(result.stdout.splitlines()) == 3
    reclaimed = loomflow("--url", journal, "budget", "reclaim", "--json")
    assert json.loads(reclaimed.stdout) == {"reclaimed": 0, "left": 0}
    assert reclaimed.returncode == 0


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["budget", "--budget-url", "memory://", "show"], 1, "memory://"),
        (["budget", "--budget-url", "mysql://x", "show"], 1, "scheme"),
        (["budget", "show", "--bogus"], 2, "unrecognized"),
        (["budget"], 2, "choose a command"),
    ],
)
def test_errors_have_the_documented_exit_codes(args: list[str], code: int, message: str) -> None:
    result = loomflow(*args)
    assert result.returncode == code
    assert message in result.stderr


def test_an_unreachable_store_is_a_loomflow_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = loomflow("budget", "--budget-url", f"sqlite:///{blocker / 'b.db'}", "show")
    assert result.returncode == 1
    assert result.stderr.startswith("loomflow: error:")


def test_prune_removes_ended_day_totals_and_keeps_the_rest(tmp_path: Path) -> None:
    # A daily cap writes day buckets; with a clock 40 days back, those days have long ended.
    url = f"sqlite:///{tmp_path / 'budget.db'}"

    async def spend_long_ago() -> None:
        import time

        budget = StandardBudget(
            [Cap("tokens_total", 10_000, window="day")],
            store=SqlBudgetStore(url),
            clock=lambda: time.time() - 40 * 86400,
        )
        model = FunctionModel(
            lambda m, t: ModelResponse(text="ok", usage=Usage(input_tokens=7, output_tokens=5))
        )
        await Agent("x", model=model, budget=budget).run("go", user_id="alice")
        await budget.close()

    asyncio.run(spend_long_ago())
    asyncio.run(spend(url))  # today's all-time totals
    before = loomflow("budget", "--budget-url", url, "show", "--json").stdout.splitlines()
    assert any(json.loads(r)["period"].startswith("day:") for r in before)
    kept = loomflow("budget", "--budget-url", url, "prune", "--older-than", "60d", "--json")
    assert json.loads(kept.stdout) == {"deleted": 0}
    dry = loomflow("budget", "--budget-url", url, "prune", "--older-than", "30d", "--dry-run")
    assert dry.stdout.strip() == "would delete 1 budget buckets (dry run: nothing deleted)"
    pruned = loomflow("budget", "--budget-url", url, "prune", "--older-than", "30d", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout) == {"deleted": 1}
    after = [
        json.loads(r)
        for r in loomflow("budget", "--budget-url", url, "show", "--json").stdout.splitlines()
    ]
    assert {r["period"] for r in after} == {"all"}
    alice = next(r for r in after if r["user_id"] == "alice")
    assert alice["calls"] == 3  # the all-time total still counts the old call
    too_soon = loomflow("budget", "--budget-url", url, "prune", "--older-than", "12h")
    assert too_soon.returncode == 2
    assert "at least 1d" in too_soon.stderr
    bad = loomflow("budget", "--budget-url", url, "prune", "--older-than", "soon")
    assert bad.returncode == 2
    assert "not a duration" in bad.stderr


HOSTILE_USERS = ("-", "   ", " bob", "'bob'", "a  b")


async def _spend_as(url: str, users: tuple[str | None, ...]) -> None:
    budget = StandardBudget([Cap("tokens_total", 10_000)], store=SqlBudgetStore(url))
    model = FunctionModel(
        lambda m, t: ModelResponse(text="ok", usage=Usage(input_tokens=7, output_tokens=5))
    )
    agent = Agent("x", model=model, budget=budget, runtime=SqliteRuntime(url.removeprefix(
        "sqlite:///")))  # fmt: skip
    for n, user in enumerate(users):
        await agent.run("go", session_id=f"s{n}", user_id=user)
    await budget.close()


def test_tables_tell_hostile_user_ids_from_the_anonymous_user(tmp_path: Path) -> None:
    # A user named "-" looked like the anonymous user, one named "   " showed a blank cell,
    # in `runs list` and `budget show` alike; --json was always unambiguous.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_spend_as(url, (None, *HOSTILE_USERS, "bob")))
    expected = {"-", "'-'", "'   '", "' bob'", "\"'bob'\"", "'a  b'", "bob"}
    for command, after in ((["runs", "list"], "runs"), (["budget", "show"], "period")):
        done = loomflow("--url", url, *command)
        assert done.returncode == 0, done.stderr
        header, *rows = done.stdout.splitlines()
        start, end = header.index("user"), header.index(after)
        # The anonymous user as -, the others quoted where the plain text would mislead.
        assert {row[start:end].rstrip() for row in rows} == expected, done.stdout
    # Every table with a user column says it the same way (legal holds, the audit trail).
    # (Holds go into an audit log the database holds: migrate creates it.)
    assert loomflow("--url", url, "migrate").returncode == 0
    for user in ("-", "   "):
        held = loomflow("--url", url, "users", "hold", user, "--reason", "review")
        assert held.returncode == 0, held.stderr
    for command, after in ((["users", "holds"], "placed"), (["audit", "query"], "seq")):
        done = loomflow("--url", url, *command)
        assert done.returncode == 0, done.stderr
        header, *rows = done.stdout.splitlines()
        start, end = header.index("user"), header.index(after)
        assert {row[start:end].rstrip() for row in rows} == {"'-'", "'   '"}, done.stdout


async def _two_dead_holds(path: Path) -> None:
    """Holds of alice and bob whose workers died (leases long gone); bob's amount edited."""
    budget = StandardBudget(
        [Cap("tokens_total", 10_000)], store=SqlBudgetStore(f"sqlite:///{path}")
    )
    for user in ("alice", "bob"):
        await budget.reserve(user_id=user, model="scripted", max_tokens=10)
    await budget.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE loom_budget_reservations SET expires_at = 0")
        conn.execute(
            "UPDATE loom_budget_reservations SET tokens_in = -3 WHERE buckets LIKE '%bob%'"
        )
    conn.close()


@pytest.mark.parametrize("as_json", [False, True])
def test_reclaim_says_how_many_holds_it_left_and_exits_1(tmp_path: Path, as_json: bool) -> None:
    # A malformed hold is left for an operator; reclaim printed only the ones it settled and
    # exited 0, so a script running it could not tell anything was left.
    path = tmp_path / "budget.db"
    asyncio.run(_two_dead_holds(path))
    args = ["budget", "--budget-url", f"sqlite:///{path}", "reclaim"]
    result = loomflow(*args, *(["--json"] if as_json else []))
    assert result.returncode == 1, result.stderr
    if as_json:
        assert json.loads(result.stdout) == {"reclaimed": 1, "left": 1}
    else:
        assert result.stdout.strip() == "reclaimed 1 reservations, left 1 malformed in place"
    assert "1 reservation is malformed and was left in place" in result.stderr
    assert "tokens_in -3 is no amount" in result.stderr
    # Again: alice's is gone, bob's still left, and said again.
    again = loomflow(*args, "--json")
    assert (again.returncode, json.loads(again.stdout)) == (1, {"reclaimed": 0, "left": 1})


async def _dead_holds(path: Path, count: int) -> None:
    budget = StandardBudget(
        [Cap("tokens_total", 10_000_000)], store=SqlBudgetStore(f"sqlite:///{path}")
    )
    for n in range(count):
        await budget.reserve(user_id=f"user-{n % 7}", model="scripted", max_tokens=10)
    await budget.close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE loom_budget_reservations SET expires_at = 0")
    conn.close()


def test_reclaim_settles_every_dead_hold_not_the_first_hundred(tmp_path: Path) -> None:
    # "Settle the reservations of dead workers now" settled one sweep's worth (100) and said
    # so, leaving the rest held until a worker's sweeps got round to them.
    path = tmp_path / "budget.db"
    asyncio.run(_dead_holds(path, 250))
    result = loomflow("budget", "--budget-url", f"sqlite:///{path}", "reclaim", "--json")
    assert (result.returncode, json.loads(result.stdout)) == (0, {"reclaimed": 250, "left": 0})
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM loom_budget_reservations").fetchone() == (0,)
    conn.close()


# -- holds ---------------------------------------------------------------------------------

LONG_USER = "ü" * 128  # 256 bytes of UTF-8: the longest id a store takes


async def _hold_for(url: str, users: tuple[str | None, ...]) -> None:
    """One reservation per user, left held (the workers "died" during their calls)."""
    budget = StandardBudget(
        [Cap("tokens_total", 10**9), Cap("cost_usd", 1000.0, scope="global")],
        store=SqlBudgetStore(url),
    )
    await budget.store.open()  # made, even with no hold
    for user in users:
        await budget.reserve(
            user_id=user, model="claude-haiku-4-5", max_tokens=100, input_tokens=1000
        )
    await budget.close()


def _holds(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return loomflow("budget", "--budget-url", url, "holds", *args)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_holds_lists_each_reservation_per_user(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    # No command showed what a dead worker's reservations held, or for whom, until a reclaim
    # settled them: an operator saw only `held tokens` summed in `budget show`.
    url = (
        f"sqlite:///{tmp_path / 'budget.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("pg_dsn")
    )
    asyncio.run(_hold_for(url, ()))
    empty = _holds(url)
    assert (empty.returncode, empty.stdout.strip()) == (0, "no budget reservations held")
    asyncio.run(_hold_for(url, ("bob", "alice", None, "alice")))
    result = _holds(url, "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["user_id"] for r in rows] == [None, "alice", "alice", "bob"]
    assert {r["scope"] for r in rows} == {"user"}
    first = rows[1]
    assert (first["tokens_in"], first["tokens_out"], first["held_tokens"]) == (1000, 100, 1100)
    assert first["held_cost_usd"] == pytest.approx(1000 * 1.25e-6 + 100 * 5e-6, rel=0.01)
    assert first["since"] <= first["lease_expires"]
    assert first["lease_lapsed"] is False
    assert first["on_expiry"] == "charge"
    assert ["global", None, "all"] in first["buckets"]
    assert len({r["reservation_id"] for r in rows}) == 4
    # Each user's held amounts add up to what `budget show` says they hold.
    shown = loomflow("budget", "--budget-url", url, "show", "--user", "alice", "--json")
    [alice] = [json.loads(line) for line in shown.stdout.splitlines()]
    assert alice["held_tokens"] == sum(r["held_tokens"] for r in rows[1:3])

    table = _holds(url, "--user", "alice")
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[:4] == ["scope", "user", "held", "tokens"]
    assert [line.split()[:3] for line in lines] == [["user", "alice", "1100"]] * 2
    nobody = _holds(url, "--user", "zoe")
    assert nobody.stdout.strip() == "no budget reservations held for user zoe"


def test_holds_print_hostile_user_ids_safely(tmp_path: Path) -> None:
    path = tmp_path / "budget.db"
    url = f"sqlite:///{path}"
    users = (None, *HOSTILE_USERS, "\u202eevil", LONG_USER)
    asyncio.run(_hold_for(url, users))
    # A hand-edited row whose user id holds a terminal escape and a newline: no store takes
    # such an id, so it is named on stderr (escaped) and left out, not printed raw.
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE loom_budget_reservations SET buckets = ?, expires_at = 0 "
            "WHERE buckets LIKE '%evil%'",
            (json.dumps([json.dumps(["user", "\x1b[2J\nroot", ""])]),),
        )
    conn.close()
    result = _holds(url)
    assert result.returncode == 0, result.stderr
    for stream in (result.stdout, result.stderr):
        assert "\x1b" not in stream
        assert "\u202e" not in stream
    header, *rows = result.stdout.splitlines()
    start, end = header.index("user"), header.index("held tokens")
    cells = [row[start:end].rstrip() for row in rows]
    assert cells == ["-", "'   '", "' bob'", "\"'bob'\"", "'-'", "'a  b'", LONG_USER], cells
    assert "unreadable" in result.stderr
    assert "U+001B" in result.stderr
    # --json gives every id as it is (escaped as JSON).
    as_json = _holds(url, "--json")
    ids = [json.loads(line)["user_id"] for line in as_json.stdout.splitlines()]
    assert ids == [None, "   ", " bob", "'bob'", "-", "a  b", LONG_USER]
