"""Real processes: one stops for approval and is SIGKILLed while it waits; another approves.

The approving process is killed too, inside the approved tool (after its decision was
journaled, before the tool did anything); a third process resumes without passing any
decision: the journaled one is applied and the tool runs exactly once.
"""

from __future__ import annotations

import asyncio
import json
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow.agent import Agent
from loomflow.governance import StandardPermissions
from loomflow.models import ScriptedModel
from loomflow.runtime import runtime_from_url

WORKER = Path(__file__).with_name("_approval_worker.py")


def _read_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"the worker said nothing within {timeout}s")
    return proc.stdout.readline().strip()


def _start(url: str, ledger: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), url, str(ledger), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)  # also closes the pipes
    assert proc.returncode == -signal.SIGKILL, stderr


async def _pending(url: str) -> list[str]:
    runtime = runtime_from_url(url)
    try:
        agent = Agent(
            "records",
            model=ScriptedModel([]),
            runtime=runtime,
            permissions=StandardPermissions(approval="defer"),
            memory=False,
        )
        return [p.request_id for p in await agent.pending_approvals("tidy", user_id="ana")]
    finally:
        await runtime.close()


@pytest.mark.crash
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_killed_while_waiting_then_approved_elsewhere_runs_the_tool_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        request.getfixturevalue("pg_dsn")
        if backend == "postgres"
        else f"sqlite:///{tmp_path / 'journal.db'}"
    )
    ledger = tmp_path / "ledger.txt"

    asking = _start(url, ledger, "ask")
    try:
        stopped = json.loads(_read_line(asking))  # then it waits, holding nothing
    finally:
        _kill(asking)
    assert stopped["interruption_reason"] == "approval"
    (waiting,) = stopped["pending_approvals"]
    assert waiting["tool"] == "delete_record"
    assert waiting["arguments"] == {"name": "alpha"}
    # The read needed nobody and ran before the stop; the delete did not.
    assert ledger.read_text().splitlines() == ["read beta"]
    assert asyncio.run(_pending(url)) == [waiting["request_id"]]

    approving = _start(url, ledger, "approve-and-die", waiting["request_id"])
    try:
        assert _read_line(approving) == "IN_TOOL"
    finally:
        _kill(approving)
    assert ledger.read_text().splitlines() == ["read beta"]
    assert asyncio.run(_pending(url)) == []  # the decision outlived the process that made it

    resumed = subprocess.run(
        [sys.executable, str(WORKER), url, str(ledger), "resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    finished = json.loads(resumed.stdout.splitlines()[-1])
    assert finished["interruption_reason"] is None
    assert finished["output"] == "Done tidying."
    assert ledger.read_text().splitlines() == ["read beta", "deleted alpha"]

    again = subprocess.run(
        [sys.executable, str(WORKER), url, str(ledger), "resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert ledger.read_text().splitlines() == ["read beta", "deleted alpha"]
