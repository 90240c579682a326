"""Budget, memory and checkpoint rows edited by hand, read back by the budget and the CLI.

A bucket key that is no key, a negative or infinite total, a damaged memory episode and an
infinite checkpoint cost each gave a traceback, a failed export, headroom under a cap or a
bare ``Infinity`` in JSON output. Now a damaged row is shown as damaged (``unreadable``, with
why) in listings and exports, every JSON output stays JSON, and a model call whose budget
row is damaged is refused (the budget fails closed).
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_hand_edited_rows import sqlite_exec

from loomflow.agent import Agent, Tuning
from loomflow.config import Settings
from loomflow.errors import BudgetUnavailableError, StorageError
from loomflow.governance.budget import Cap, SqlBudgetStore, StandardBudget
from loomflow.memory import SqliteMemory
from loomflow.testing.checkpoint_conformance import Shop

USER = "dana"


def _refuse(constant: str) -> Any:
    raise AssertionError(f"bare {constant} in JSON output: not JSON")


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses the ``Infinity``/``NaN`` Python's json writes but JSON
    does not have."""
    return json.loads(text, parse_constant=_refuse)


def cli(path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", *command],
        capture_output=True, text=True, cwd=path.parent, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _agent(path: Path, shop: Shop) -> Agent:
    return Agent.from_settings(
        "You shop.",
        model=shop.model,
        tools=[shop.tool],
        caps=[Cap("tokens_total", 1_000_000, window="day")],
        tuning=Tuning(checkpoint=True, max_tokens=64),
        settings=Settings(runtime_url=f"sqlite:///{path}"),
    )


async def _world(tmp_path: Path, *edits: str) -> Path:
    """One finished run of USER with a budget, checkpoints and memory (an episode, a fact
    and a block) in one SQLite file, then edited by hand."""
    path = tmp_path / "loomflow.db"
    async with _agent(path, Shop()) as agent:
        result = await agent.run("shop", session_id="s", user_id=USER)
        assert result.output.startswith("bought:")
    memory = SqliteMemory(path)
    try:
        await memory.remember("user", "likes", "cheese", user_id=USER)
        await memory.set_block("notes", "buys in bulk", user_id=USER)
    finally:
        await memory.close()
    await asyncio.to_thread(sqlite_exec, path, *edits)
    return path


def _export(path: Path) -> dict[str, Any]:
    done = cli(path, "users", "export", USER)
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = strict_json(done.stdout)
    return document


def _budget_lines(path: Path) -> list[dict[str, Any]]:
    done = cli(path, "budget", "show", "--json")
    assert done.returncode == 0, done.stderr
    return [strict_json(line) for line in done.stdout.splitlines()]


# -- a bucket key that is no bucket key ----------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "[[[",  # not JSON
        "[1,2,3]",  # JSON, not a bucket
        '["user","dana"]',
        '["user","mallory","day:2026-01-01"]',  # a key naming someone else than its columns
    ],
)
async def test_a_bucket_key_that_is_no_key_is_shown_as_unreadable(tmp_path: Path, key: str) -> None:
    path = await _world(
        tmp_path, f"UPDATE loom_budget_buckets SET bucket = '{key}' WHERE period LIKE 'day:%'"
    )
    store = SqlBudgetStore(f"sqlite:///{path}")
    try:
        with pytest.raises(StorageError, match="budget bucket row is damaged"):
            await store.usage()  # was a JSONDecodeError (or a bucket read from the key)
    finally:
        await store.close()

    done = cli(path, "budget", "show")
    assert done.returncode == 0, done.stderr
    (damaged,) = [line for line in done.stdout.splitlines() if "unreadable" in line]
    assert damaged.split()[:3] == ["user", USER, damaged.split()[2]]
    assert damaged.split()[2].startswith("day:")
    assert done.stderr.startswith("loomflow: a budget bucket row is damaged"), done.stderr

    lines = _budget_lines(path)
    (row,) = [r for r in lines if "unreadable" in r]
    assert row["bucket"] == key
    assert row["user_id"] == USER
    assert "tokens_in" not in row  # no figure is read from a damaged row
    assert len(lines) == 2  # the user's all-time bucket still shows

    document = _export(path)
    (bucket,) = [b for b in document["budget"] if "unreadable" in b]
    assert bucket["period"].startswith("day:")
    assert any(b["period"] == "all" and b["calls"] >= 4 for b in document["budget"])


# -- totals no sum of calls makes ---------------------------------------------------------------

IMPOSSIBLE_TOTALS = [
    "tokens_in = -10000000",
    "tokens_out = -1",
    "cost_nanousd = -1000000000",
    "calls = -1",
    "wall_s = -5.0",
    "wall_s = 1e999",  # SQLite keeps an infinity
    "reserved_in = -10000000",
    "reserved_out = -1",  # the reservation's upsert stops a hold at zero: seen before it
]


@pytest.mark.parametrize("edit", IMPOSSIBLE_TOTALS)
async def test_an_impossible_total_refuses_the_model_call(tmp_path: Path, edit: str) -> None:
    path = await _world(tmp_path, f"UPDATE loom_budget_buckets SET {edit}")
    store = SqlBudgetStore(f"sqlite:///{path}")
    budget = StandardBudget([Cap("tokens_total", 1_000_000, window="day")], store=store)
    try:
        # Read as figures, -10M tokens gave 10M tokens of headroom under the cap.
        with pytest.raises(BudgetUnavailableError, match="budget bucket row is damaged"):
            await budget.reserve(user_id=USER, model="scripted", max_tokens=10)
        with pytest.raises(StorageError, match="budget bucket row is damaged"):
            await store.usage(USER)
    finally:
        await budget.close()

    lines = _budget_lines(path)  # strict JSON: an infinite wall_s printed bare Infinity
    mine = [r for r in lines if r["user_id"] == USER]
    assert mine
    assert all("unreadable" in r for r in mine)
    assert all("model_seconds" not in r for r in mine)
    done = cli(path, "budget", "show")
    assert done.returncode == 0, done.stderr
    assert "unreadable" in done.stdout
    assert "-10000000" not in done.stdout
    document = _export(path)
    assert document["budget"]
    assert all("unreadable" in b for b in document["budget"])


async def test_an_agent_whose_budget_row_is_negative_makes_no_model_call(tmp_path: Path) -> None:
    path = await _world(
        tmp_path, "UPDATE loom_budget_buckets SET tokens_in = -10000000 WHERE scope = 'user'"
    )
    shop = Shop()
    async with _agent(path, shop) as agent:
        with pytest.raises(BudgetUnavailableError, match="negative total"):
            await agent.run("shop again", session_id="s2", user_id=USER)
    assert shop.bought == []


# -- memory episodes (and facts, blocks) in a user's export --------------------------------------


@pytest.mark.parametrize(
    ("kind", "edit"),
    [
        ("episodes", "UPDATE loom_memory_episodes SET messages = X'7b'"),
        ("episodes", "UPDATE loom_memory_episodes SET epoch = 'x'"),
        ("episodes", "UPDATE loom_memory_episodes SET created_at = 'x'"),
        ("episodes", "UPDATE loom_memory_episodes SET created_at = 1e999"),
        ("episodes", "UPDATE loom_memory_episodes SET output = X'ff'"),
        ("facts", "UPDATE loom_memory_facts SET valid_from = 'x'"),
        ("facts", "UPDATE loom_memory_facts SET valid_to = 1e999"),
        ("blocks", "UPDATE loom_memory_blocks SET updated_at = 'x'"),
        ("blocks", "UPDATE loom_memory_blocks SET content = X'ff'"),
    ],
)
async def test_a_damaged_memory_row_is_exported_as_unreadable(
    tmp_path: Path, kind: str, edit: str
) -> None:
    path = await _world(tmp_path, edit)
    document = _export(path)  # was exit 1 with a CorruptEntryError (or a traceback)
    (row,) = document["memory"][kind]
    assert "malformed column" in row["unreadable"] or "cannot be decoded" in row["unreadable"]
    assert row["user_id"] == USER
    assert document["counts"]["episodes"] == 1
    # The rest of the export is all there.
    assert document["counts"]["sessions"] == 1
    assert document["checkpoints"]["checkpoints"]
    others = {"episodes", "facts", "blocks"} - {kind}
    assert all(
        len(document["memory"][k]) == 1 and "unreadable" not in document["memory"][k][0]
        for k in others
    )


async def test_an_export_reads_the_episode_of_a_damaged_one_as_far_as_it_can(
    tmp_path: Path,
) -> None:
    path = await _world(tmp_path, "UPDATE loom_memory_episodes SET messages = X'7b'")
    (episode,) = _export(path)["memory"]["episodes"]
    assert episode["session_id"] == "s"
    assert episode["run_id"]
    assert "cannot be decoded" in episode["unreadable"]


# -- non-finite numbers in checkpoints and JSON outputs ------------------------------------------


async def test_an_infinite_checkpoint_cost_is_damage_in_every_json_output(tmp_path: Path) -> None:
    path = await _world(
        tmp_path,
        "UPDATE loom_checkpoints SET cost_usd = 1e999",
        "UPDATE loom_budget_buckets SET wall_s = 1e999",
    )
    done = cli(path, "checkpoints", "list", "s", "--json")
    assert done.returncode == 0, done.stderr
    listed = [strict_json(line) for line in done.stdout.splitlines()]
    assert listed
    assert all("cost_usd holds inf" in c["unreadable"] for c in listed)

    done = cli(path, "checkpoints", "export", "--user", USER)
    assert done.returncode == 0, done.stderr
    exported = strict_json(done.stdout)["checkpoints"]
    assert exported
    assert all("unreadable" in c for c in exported)

    document = _export(path)
    assert all("unreadable" in c for c in document["checkpoints"]["checkpoints"])
    assert all("unreadable" in b for b in document["budget"])
    assert all("unreadable" in r for r in _budget_lines(path))


async def test_a_restored_run_never_reports_an_infinite_cost(tmp_path: Path) -> None:
    path = tmp_path / "loomflow.db"
    shop = Shop(fail_at=2)
    settings = Settings(runtime_url=f"sqlite:///{path}")

    def agent() -> Agent:
        return Agent.from_settings(
            "You shop.",
            model=shop.model,
            tools=[shop.tool],
            tuning=Tuning(checkpoint=True),
            settings=settings,
        )

    async with agent() as first:
        with pytest.raises(ConnectionError):
            await first.run("shop", session_id="s", user_id=USER)
    await asyncio.to_thread(sqlite_exec, path, "UPDATE loom_checkpoints SET cost_usd = 1e999")
    async with agent() as second:
        result = await second.resume("shop", session_id="s", user_id=USER)
    assert result.restored_from is None  # the damaged snapshot is skipped: replayed instead
    assert math.isfinite(result.cost_usd)
    assert shop.bought == ["apples", "bread", "cheese"]
