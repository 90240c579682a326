"""A real process is killed after a tool ran; another process resumes the agent run."""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow.memory import Episode, memory_for
from loomflow.runtime import SqliteRuntime

WORKER = Path(__file__).with_name("_agent_worker.py")


def _wait_for_line(proc: subprocess.Popen[str], expected: str, timeout: float) -> None:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no {expected!r} from the worker within {timeout}s")
    line = proc.stdout.readline().strip()
    assert line == expected, line


@pytest.mark.crash
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_killed_after_a_tool_ran_resumes_without_rerunning_it(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        request.getfixturevalue("pg_dsn")
        if backend == "postgres"
        else f"sqlite:///{tmp_path / 'journal.db'}"
    )
    ledger = tmp_path / "ledger.txt"
    first = subprocess.Popen(
        [sys.executable, str(WORKER), url, str(ledger), "first"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_line(first, "TOOL-DONE", timeout=60)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    assert ledger.read_text().splitlines() == ["charge 7"]

    resumed = subprocess.run(
        [sys.executable, str(WORKER), url, str(ledger), "resume"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["output"] == "done: charged $7"
    assert summary["model_calls"] == 1  # only the second model call; the first replayed
    assert summary["replayed"] == 2  # model_call_0 and the charge
    assert summary["fresh"] == 2  # the second model call and the run's episode
    assert ledger.read_text().splitlines() == ["charge 7"]  # the tool did not run again


SCRIPTED_WORKER = Path(__file__).with_name("_scripted_worker.py")


@pytest.mark.crash
def test_a_scripted_model_resumed_in_a_new_process_runs_each_tool_once(tmp_path: Path) -> None:
    journal, ledger = tmp_path / "journal.db", tmp_path / "ledger.txt"
    first = subprocess.Popen(
        [sys.executable, str(SCRIPTED_WORKER), str(journal), str(ledger), "first"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_line(first, "SHIPPING", timeout=60)
    finally:
        first.send_signal(signal.SIGKILL)
        _, stderr = first.communicate(timeout=30)
    assert first.returncode == -signal.SIGKILL, stderr
    # charge and email share a turn and run concurrently: their order is not fixed.
    assert sorted(ledger.read_text().splitlines()) == [
        "charge 59",
        "email alice@example.com",
        "reserve LOOM-7",
    ]

    resumed = subprocess.run(
        [sys.executable, str(SCRIPTED_WORKER), str(journal), str(ledger), "resume"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    # Each tool ran exactly once over both processes: the killed ship call in the new one.
    assert sorted(ledger.read_text().splitlines()) == [
        "charge 59",
        "email alice@example.com",
        "reserve LOOM-7",
        "ship 7",
    ]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    # Turns 0-2 replayed; the new process's ScriptedModel was asked only for turn 3, and gave
    # the final answer instead of starting the script over.
    assert summary["model_calls"] == 1
    assert summary["turns"] == 4
    assert summary["output"] == "Order 7 is reserved, charged, confirmed and shipped."
    # The agent's default memory, beside the journal, holds the run once.
    episodes = asyncio.run(_episodes(journal, "order-7", "alice"))
    assert [e.run_id for e in episodes] == [summary["run_id"]]


async def _episodes(journal: Path, session_id: str, user_id: str) -> list[Episode]:
    runtime = SqliteRuntime(journal)
    try:
        return await memory_for(runtime).episodes(session_id, user_id=user_id)
    finally:
        await runtime.close()
