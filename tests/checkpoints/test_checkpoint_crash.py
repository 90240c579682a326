"""Real worker processes killed with SIGKILL; another process resumes from the checkpoint."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("_checkpoint_worker.py")


def _kill_after(url: str, ledger: Path, mode: str, line: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), url, str(ledger), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(60):
                raise AssertionError(f"no {line!r} from the worker within 60s")
        got = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
    assert got == line, stderr


def _resume(url: str, ledger: Path, mode: str = "resume") -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(WORKER), url, str(ledger), mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_dsn"))
    return f"sqlite:///{tmp_path / 'journal.db'}"


@pytest.mark.crash
def test_killed_mid_run_resumes_from_the_snapshot(url: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.txt"
    _kill_after(url, ledger, "mid-run", "PASS-2")
    assert ledger.read_text().splitlines() == ["apples", "bread"]
    summary = _resume(url, ledger)
    assert summary["output"] == "bought everything"
    assert summary["restored"]
    assert summary["live_turns"] == [2, 3]  # the two earlier turns were restored, not re-run
    assert summary["model_calls"] == 2
    assert summary["replayed"] == 0  # no replay walk
    assert summary["turns"] == 4
    assert summary["episodes"] == 1
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]


@pytest.mark.crash
def test_killed_after_the_episode_write_leaves_one_episode(url: str, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.txt"
    _kill_after(url, ledger, "episode", "EPISODE-WRITTEN")
    summary = _resume(url, ledger)
    assert summary["output"] == "bought everything"
    assert summary["restored"]  # the final snapshot: no model call at all
    assert summary["model_calls"] == 0
    assert summary["fresh"] == 1  # only the episode step, whose journal entry was lost
    assert summary["episodes"] == 1  # rewritten in place, not duplicated
    assert summary["episode_messages"] == 8
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]


@pytest.mark.crash
def test_killed_as_a_fork_starts_resumes_the_fork_from_its_fork_point(
    url: str, tmp_path: Path
) -> None:
    """Killed after the fork's run opened (its session claimed) but while its hooks were
    being told: the resume continues the fork after bread, instead of shopping afresh."""
    ledger = tmp_path / "ledger.txt"
    _kill_after(url, ledger, "fork", "FORK-STARTING")
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese"]
    summary = _resume(url, ledger, "resume-fork")
    assert summary["restored"]
    assert summary["output"] == "bought everything"
    assert summary["live_turns"] == [2, 3]  # the fork's own turns: cheese, then the answer
    assert ledger.read_text().splitlines() == ["apples", "bread", "cheese", "cheese"]
