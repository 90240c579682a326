"""The command line, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def loomflow(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def test_demo_kills_a_worker_resumes_and_proves_no_side_effect_repeated(tmp_path: Path) -> None:
    result = loomflow("demo", "--workdir", str(tmp_path), "--kill-after", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "killed with SIGKILL" in out
    assert "replayed from journal" in out
    assert "ran fresh" in out
    assert "hits=5 misses=5 divergences=0" in out
    assert "chain verified: ok" in out
    assert "tool.replay      charge_card" in out  # the replay is audited as a replay
    assert out.count("tool.call        charge_card") == 1  # and the charge once, as live
    assert "user.tokens_total used" in out
    ledger = [
        json.loads(line) for line in (tmp_path / "side-effects.jsonl").read_text().splitlines()
    ]
    assert len(ledger) == 5
    assert len({r["action"] for r in ledger}) == 5
    assert len({r["pid"] for r in ledger}) == 2  # the killed worker and the resuming process


@pytest.mark.postgres
def test_demo_on_postgres(tmp_path: Path, pg_dsn: str) -> None:
    result = loomflow("demo", "--postgres", pg_dsn, "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "hits=7 misses=3" in result.stdout


def test_migrate_show_and_prune(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    assert loomflow("--url", url, "migrate").stdout.startswith("journal schema at version")
    assert loomflow("demo", "--workdir", str(tmp_path)).returncode == 0
    import sqlite3

    with sqlite3.connect(tmp_path / "journal.db") as conn:
        session = conn.execute("SELECT session_id FROM loom_sessions").fetchone()[0]
    demo_url = f"sqlite:///{tmp_path / 'journal.db'}"
    shown = loomflow(
        "--url", demo_url, "runs", "show", session, "--user", "alice@example.com", "--json"
    )
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    names = [r["name"] for r in rows]
    assert names[:2] == ["model_call_0", names[1]]
    assert names[1].startswith("tool_call_0_0_")
    assert len(names) == 10
    table = loomflow("--url", demo_url, "runs", "show", session, "--user", "alice@example.com")
    assert "model_call_4" in table.stdout
    assert "replays" in table.stdout
    listed = loomflow("--url", demo_url, "runs", "list", "--json")
    (entry,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert entry["session_id"] == session
    assert entry["user_id"] == "alice@example.com"
    assert entry["entries"] == 10
    assert entry["open"] is False
    people = loomflow("--url", demo_url, "runs", "list", "--user", "nobody")
    assert people.stdout.strip() == "no sessions in the journal"
    assert "finished" in loomflow("--url", demo_url, "runs", "list").stdout
    assert "epoch" in table.stdout
    pruned = loomflow("--url", demo_url, "journal", "prune", "--json")
    assert json.loads(pruned.stdout) == {"deleted": 10}


def test_errors_and_usage_have_distinct_exit_codes(tmp_path: Path) -> None:
    bad_url = loomflow("--url", "mysql://x", "migrate")
    assert bad_url.returncode == 1
    assert "scheme" in bad_url.stderr
    assert loomflow("journal", "prune", "--older-than", "soon").returncode == 2
    assert loomflow("no-such-command").returncode == 2
