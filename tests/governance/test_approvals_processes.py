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
from typing import Any

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


def _url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "postgres":
        return str(request.getfixturevalue("pg_dsn"))
    return f"sqlite:///{tmp_path / 'journal.db'}"


def _stop_for_approval(url: str, ledger: Path) -> dict[str, Any]:
    """A run stops to wait for approval; its process is killed while it waits."""
    asking = _start(url, ledger, "ask")
    try:
        stopped: dict[str, Any] = json.loads(_read_line(asking))  # then it waits
    finally:
        _kill(asking)
    return stopped


def _approve_and_die(url: str, ledger: Path, request_id: str) -> None:
    """Another process approves and is killed inside the approved tool."""
    approving = _start(url, ledger, "approve-and-die", request_id)
    try:
        assert _read_line(approving) == "IN_TOOL"
    finally:
        _kill(approving)


def _last_json(url: str, ledger: Path, mode: str) -> dict[str, Any]:
    """Run the worker in ``mode`` to its end; the JSON of its last line."""
    done = subprocess.run(
        [sys.executable, str(WORKER), url, str(ledger), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    last: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return last


@pytest.mark.crash
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_killed_while_waiting_then_approved_elsewhere_runs_the_tool_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = _url(backend, tmp_path, request)
    ledger = tmp_path / "ledger.txt"

    stopped = _stop_for_approval(url, ledger)
    assert stopped["interruption_reason"] == "approval"
    (waiting,) = stopped["pending_approvals"]
    assert waiting["tool"] == "delete_record"
    assert waiting["arguments"] == {"name": "alpha"}
    # The read needed nobody and ran before the stop; the delete did not.
    assert ledger.read_text().splitlines() == ["read beta"]
    assert asyncio.run(_pending(url)) == [waiting["request_id"]]

    _approve_and_die(url, ledger, waiting["request_id"])
    assert ledger.read_text().splitlines() == ["read beta"]
    assert asyncio.run(_pending(url)) == []  # the decision outlived the process that made it

    finished = _last_json(url, ledger, "resume")
    assert finished["interruption_reason"] is None
    assert finished["output"] == "Done tidying."
    assert ledger.read_text().splitlines() == ["read beta", "deleted alpha"]

    _last_json(url, ledger, "resume")
    assert ledger.read_text().splitlines() == ["read beta", "deleted alpha"]


@pytest.mark.crash
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_resume_killed_inside_the_approved_tool_is_an_orphan_a_worker_finishes(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The approving process dies inside the tool it approved. The run it was resuming had
    # stopped (interrupted); it used to list as interrupted again, with nothing pending, and
    # no recovery worker would take it up. Now the resume opens the run again while it goes
    # on, so its death leaves an orphan that a worker resumes from the journal.
    url = _url(backend, tmp_path, request)
    ledger = tmp_path / "ledger.txt"
    (waiting,) = _stop_for_approval(url, ledger)["pending_approvals"]
    _approve_and_die(url, ledger, waiting["request_id"])
    assert ledger.read_text().splitlines() == ["read beta"]

    assert _last_json(url, ledger, "recover") == {
        "resumed": 1,
        "state": "finished",
        "outcomes": ["finished", "resumed"],
    }
    # The journaled approval was applied once, by the worker; the read was replayed.
    assert ledger.read_text().splitlines() == ["read beta", "deleted alpha"]

    assert _last_json(url, ledger, "resume")["output"] == "Done tidying."
    assert ledger.read_text().splitlines() == ["read beta", "deleted alpha"]


@pytest.mark.crash
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_recovered_run_that_stops_again_for_approval_is_counted_as_interrupted(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker finishes the approved delete, then the model asks for another one: the run
    # stops again to wait. The recovery counted (and audited) that as "finished".
    monkeypatch.setenv("APPROVAL_SCRIPT", "twice")
    url = _url(backend, tmp_path, request)
    ledger = tmp_path / "ledger.txt"
    (waiting,) = _stop_for_approval(url, ledger)["pending_approvals"]
    _approve_and_die(url, ledger, waiting["request_id"])

    assert _last_json(url, ledger, "recover") == {
        "resumed": 1,
        "state": "interrupted",
        "outcomes": ["interrupted", "resumed"],
    }
    assert ledger.read_text().splitlines() == ["read beta", "deleted alpha"]
    stopped = _last_json(url, ledger, "resume")
    assert stopped["interruption_reason"] == "approval"
    assert [p["arguments"] for p in stopped["pending_approvals"]] == [{"name": "gamma"}]
