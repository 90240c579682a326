"""A recovery worker stopped past its claim's lease resumes nothing on waking.

The worker (``_stale_recoverer.py``, a real process) claims an orphaned run and is stopped
with SIGSTOP right after the claim, past the claim's 1 s lease; meanwhile the application
resumes the run itself and finishes it. Then the worker is continued. It used to resume the
finished run anyway: a resume of a closed run replays without taking the turn, so no fence
stopped it, and the worker audited a whole replay of the run under its recovery
(``run.start`` ... ``run.end``) and ``run.recover`` with ``outcome=finished``, and counted a
recovery that finished: the trail and the dashboard said it recovered a run another owner
had finished.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import _app
import pytest
from _fleet import app_env, start_and_kill, tool_counts
from _process_harness import harness as h  # the crash tests' process helpers

from loomflow.audit import AuditLog

pytestmark = pytest.mark.timeout(120)

WORKER = Path(__file__).with_name("_stale_recoverer.py")


async def test_a_recoverer_stopped_past_its_claim_is_fenced_out_of_the_run_it_lost(
    journal_url: str, ledger: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await start_and_kill(journal_url, ledger, 1, "stale")
    stderr = tmp_path / "stale.stderr"
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            env=app_env(journal_url, ledger, FLEET_LEASE="1"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    stale = h.Child("stale", proc, stderr)
    for key, value in app_env(journal_url, ledger).items():
        if key.startswith("FLEET_"):
            monkeypatch.setenv(key, value)
    agent = _app.agents()["orders"]
    assert agent.runtime is not None
    assert isinstance(agent.audit, AuditLog)
    try:
        await stale.expect("claimed")
        sqlite_file = journal_url.removeprefix("sqlite:///")
        await h.freeze_pid(proc.pid, None if sqlite_file == journal_url else sqlite_file)
        # Waits out the stopped worker's claim (1 s), then finishes the run from its journal.
        result = await agent.resume(_app.PROMPT, session_id="stale-0", user_id="ana")
        assert result.output == "Reserved and shipped."
        before = (await agent.audit.query(user_id="ana")).entries

        stale.signal(signal.SIGCONT)
        await stale.send("go")
        assert await stale.exit_code() == 0, stale.diagnose("failed")
        done = stale.last("done")
        # Not a recovery that finished: the claim was lost, and that is no failure either.
        assert (done["resumed"], done["failures"]) == (1, 0)
        assert done["outcomes"] == ["claim_lost", "resumed"]
        after = (await agent.audit.query(user_id="ana")).entries
        woke = [(e.action, e.actor, e.payload.get("outcome")) for e in after[len(before) :]]
        # Its claim's entry (the worker was about to write it) and how the claim ended;
        # nothing of the run: no replay was audited as the worker's.
        assert woke == [
            ("run.recover", "worker:stale", None),
            ("run.recover", "worker:stale", "claim_lost"),
        ]
        assert (await agent.audit.verify()).ok
        [info] = await agent.runtime.sessions(session_id="stale-0", user_id="ana")
        assert (info.state, info.last_error) == ("finished", None)
        # Every tool ran once: in the killed starter (reserve) and in the application's resume.
        assert tool_counts(ledger, "reserve") == {"stale-0": 1}
        assert tool_counts(ledger, "ship") == {"stale-0": 1}
    finally:
        await h.kill_all([stale])
        await agent.runtime.close()
        await agent.audit.close()
