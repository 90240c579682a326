"""A real process is killed after a tool ran; another process resumes the agent run."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert summary["fresh"] == 1
    assert ledger.read_text().splitlines() == ["charge 7"]  # the tool did not run again
