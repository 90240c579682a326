"""``loomflow checkpoints ...`` as a real subprocess, on a journal written by an agent."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow.agent import Agent, Tuning
from loomflow.runtime import SqliteRuntime
from loomflow.testing.checkpoint_conformance import Shop


def loomflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def _record(path: Path) -> None:
    runtime = SqliteRuntime(path)
    shop = Shop()
    try:
        agent = Agent(
            "You shop.",
            model=shop.model,
            tools=[shop.tool],
            runtime=runtime,
            tuning=Tuning(checkpoint=True),
        )
        await agent.run("shop", session_id="s", user_id="alice")
        await agent.run("shop", session_id="t", user_id="alice")
        await agent.run("shop", session_id="s", user_id="bob")
    finally:
        await runtime.close()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cli") / "journal.db"
    asyncio.run(_record(path))
    return f"sqlite:///{path}"


def test_list_newest_first_as_json_and_as_a_table(url: str) -> None:
    listed = loomflow("--url", url, "checkpoints", "list", "s", "--user", "alice", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["turn"], r["final"]) for r in rows] == [
        (4, True),
        (3, False),
        (2, False),
        (1, False),
    ]
    assert {r["user_id"] for r in rows} == {"alice"}
    assert rows[0]["messages"] == 9  # system, prompt, 3 x (call, result), answer
    table = loomflow("--url", url, "checkpoints", "list", "s", "--user", "alice", "--limit", "2")
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["checkpoint", "written", "(UTC)", "epoch"]
    assert len(lines) == 3
    assert rows[0]["id"] in lines[1]
    # Two users ran session "s": without --user the command asks which one.
    ambiguous = loomflow("--url", url, "checkpoints", "list", "s")
    assert ambiguous.returncode == 1
    assert "several users ('alice', 'bob')" in ambiguous.stderr
    nobody = loomflow("--url", url, "checkpoints", "list", "s", "--anonymous")
    assert nobody.returncode == 1
    assert "no session 's' without a user" in nobody.stderr


def test_show_prints_the_transcript_and_refuses_other_users(url: str) -> None:
    listed = loomflow("--url", url, "checkpoints", "list", "s", "--user", "alice", "--json")
    newest = json.loads(listed.stdout.splitlines()[0])["id"]
    shown = loomflow("--url", url, "checkpoints", "show", "s", newest, "--user", "alice")
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["messages"][-1]["content"].startswith("bought: ")
    other = loomflow("--url", url, "checkpoints", "show", "s", newest, "--user", "bob")
    assert other.returncode == 1
    assert "no checkpoint" in other.stderr


def test_export_then_forget_one_user(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    asyncio.run(_record(path))
    url = f"sqlite:///{path}"
    out = tmp_path / "alice.json"
    exported = loomflow("--url", url, "checkpoints", "export", "--user", "alice", "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    document = json.loads(out.read_text())
    assert document["user_id"] == "alice"
    assert {c["session_id"] for c in document["checkpoints"]} == {"s", "t"}
    assert len(document["checkpoints"]) == 8
    # Without --yes is bad usage (exit 2), said before any database is looked at: it was
    # exit 1 about the missing audit log, as if --yes would have been enough.
    refused = loomflow("--url", url, "checkpoints", "forget", "--user", "alice")
    assert refused.returncode == 2, refused.stderr
    assert "--yes" in refused.stderr
    # forget checks legal holds: it needs the audit log, here beside the journal.
    assert loomflow("--url", url, "migrate").returncode == 0
    forgot = loomflow("--url", url, "checkpoints", "forget", "--user", "alice", "--yes", "--json")
    assert json.loads(forgot.stdout) == {"user_id": "alice", "deleted": 8}
    left = loomflow("--url", url, "checkpoints", "list", "s", "--user", "bob", "--json")
    assert len(left.stdout.splitlines()) == 4
    gone = loomflow("--url", url, "checkpoints", "list", "s", "--user", "alice", "--json")
    assert gone.stdout == ""


def test_a_bad_url_is_a_loomflow_error() -> None:
    bad = loomflow("--url", "mysql://x", "checkpoints", "list", "s")
    assert bad.returncode == 1
    assert "scheme" in bad.stderr


def test_export_and_forget_the_anonymous_snapshots(tmp_path: Path) -> None:
    # list and show took --anonymous, export and forget only --user: the snapshots of runs
    # without a user could not be exported or erased here (--user '' is an empty id).
    path = tmp_path / "journal.db"

    async def record() -> None:
        runtime = SqliteRuntime(path)
        shop = Shop()
        try:
            agent = Agent(
                "You shop.",
                model=shop.model,
                tools=[shop.tool],
                runtime=runtime,
                tuning=Tuning(checkpoint=True),
            )
            await agent.run("shop", session_id="s")
            await agent.run("shop", session_id="s", user_id="alice")
        finally:
            await runtime.close()

    asyncio.run(record())
    url = f"sqlite:///{path}"
    exported = loomflow("--url", url, "checkpoints", "export", "--anonymous")
    assert exported.returncode == 0, exported.stderr
    document = json.loads(exported.stdout)
    assert document["user_id"] is None
    assert {c["user_id"] for c in document["checkpoints"]} == {None}
    assert len(document["checkpoints"]) == 4
    both = loomflow("--url", url, "checkpoints", "export", "--anonymous", "--user", "alice")
    assert both.returncode == 2
    neither = loomflow("--url", url, "checkpoints", "export")
    assert neither.returncode == 2
    assert loomflow("--url", url, "migrate").returncode == 0  # the audit log, for holds
    forgot = loomflow("--url", url, "checkpoints", "forget", "--anonymous", "--yes", "--json")
    assert json.loads(forgot.stdout) == {"user_id": None, "deleted": 4}
    left = loomflow("--url", url, "checkpoints", "list", "s", "--user", "alice", "--json")
    assert len(left.stdout.splitlines()) == 4
    gone = loomflow("--url", url, "checkpoints", "list", "s", "--anonymous", "--json")
    assert gone.stdout == ""


def test_export_to_an_empty_path_is_bad_usage(url: str) -> None:
    # `-o "$OUT"` with OUT unset: Path("") is the current directory, and the export failed
    # with ".: Is a directory" (exit 1); `users export -o ''` already said what was wrong.
    got = loomflow("--url", url, "checkpoints", "export", "--user", "alice", "-o", "")
    assert got.returncode == 2, got.stderr
    assert "empty path" in got.stderr
