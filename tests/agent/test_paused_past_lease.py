"""An agent process stopped past its lease writes nothing over its run's new owner on waking.

The worker (``_paused_worker.py``) stops between a journaled tool call and the snapshot of
that turn (``Tuning(checkpoint=True)``); the parent SIGSTOPs it past its 1 s lease, resumes
the run itself to the end, then SIGCONTs the worker. Before, the woken worker saved its
turn-1 snapshot over the finished run's final one: the newest snapshot of the session was a
stale, unanswered one (the next resume restored it and replayed the rest, `from_checkpoint`
and `checkpoints list` showed it as the latest, a retention of one deleted the final one),
and only then did it learn, at its next model call, that it had lost the turn.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import _paused_worker as worker
import pytest
from _process_harness import harness as h  # the crash tests' process helpers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        return h.Journal("sqlite", str(tmp_path / "journal.db"))
    return h.Journal("postgres", request.getfixturevalue("pg_dsn"))


def _url(journal: Any) -> str:
    return f"sqlite:///{journal.target}" if journal.backend == "sqlite" else journal.target


async def test_a_worker_woken_past_its_lease_saves_no_snapshot_over_the_new_owners(
    journal: Any, tmp_path: Path
) -> None:
    url = _url(journal)
    stderr = tmp_path / "paused.stderr"
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(worker.__file__)),
            url,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    paused = h.Child("paused", proc, stderr)
    taker = worker.agent(url)
    try:
        await paused.expect("paused")
        await h.freeze(paused, journal)
        # Waits out the stopped worker's lease, then finishes the run from its journal.
        result = await taker.resume(worker.PROMPT, session_id="s", user_id="u")
        assert result.output == f"done: charged 7 by {paused.pid}"
        before = await taker.list_checkpoints("s", user_id="u")
        assert [(c.turn, c.final) for c in before] == [(2, True), (1, False)]

        paused.signal(signal.SIGCONT)
        await paused.send("go")
        assert await paused.exit_code() == 0, paused.diagnose("failed")
        # The new owner's snapshots stand: the newest is still the run's final answer.
        assert await taker.list_checkpoints("s", user_id="u") == before
        # Refused before the snapshot (the heartbeat or the check may learn of it first).
        assert "step 'checkpoint_1' was not started" in paused.last("lost")["error"]
        again = await taker.resume(worker.PROMPT, session_id="s", user_id="u")
        assert again.output == result.output
        assert again.restored_from == before[0].id
    finally:
        await h.kill_all([paused])
        assert taker.runtime is not None
        await taker.runtime.close()
