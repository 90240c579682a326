"""A process frozen in the middle of a model call, whose run another owner finished meanwhile.

The frozen process (``_fenced_app.py``) wakes up, gets its model's answer (a billed call)
and is refused the journal write: the run is no longer its own. Its budget reservation must
then be charged what the call spent, as the audit trail records it, not the whole
reservation (the most the call could have spent: the budget said 500 output tokens had gone
where 20 had).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import _fenced_app as app
import pytest
from _process_harness import harness as h  # the crash tests' process helpers

from loomflow.audit import AuditLog
from loomflow.governance.budget import Bucket, SqlBudgetStore

pytestmark = [pytest.mark.crash, pytest.mark.timeout(120)]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'journal.db'}"
    return str(request.getfixturevalue("pg_dsn"))


async def test_a_fenced_out_model_call_is_charged_what_it_spent(url: str, tmp_path: Path) -> None:
    ledger, gate = tmp_path / "ledger.txt", tmp_path / "gate"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(app.__file__)), url, str(ledger), str(gate),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30):
            while "blocked" not in (ledger.read_text() if ledger.exists() else ""):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        sqlite_file = url.removeprefix("sqlite:///")
        await h.freeze_pid(proc.pid, None if sqlite_file == url else sqlite_file)
        await asyncio.sleep(1.5)  # past its 1 s lease
        owner = app.agent(url, str(ledger), gate=None)
        try:
            result = await owner.resume(app.PROMPT, session_id="s-0", user_id="ana")
            assert result.output == "Paid."
        finally:
            await app.close(owner)
        gate.touch()
        proc.send_signal(signal.SIGCONT)
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            await proc.wait()
    assert json.loads(out) == {"error": "OwnershipLostError"}, err.decode()[-3000:]
    # Three billed calls: the first, the frozen process's second, the new owner's second.
    assert ledger.read_text().splitlines().count("model") == 3

    audit = AuditLog(url)
    try:
        calls = (await audit.query(user_id="ana", action="model.call")).entries
        assert (await audit.verify()).ok
    finally:
        await audit.close()
    assert len(calls) == 3
    store = SqlBudgetStore(url)
    try:
        bucket = Bucket("user", "ana")
        totals = (await store.totals([bucket.key]))[bucket.key]
        left = await store.reservations()
    finally:
        await store.close()
    assert left == []  # nothing held for good
    assert (totals.reserved_in, totals.reserved_out) == (0, 0)
    # Charged what the trail says was spent, not the 500 output tokens reserved.
    assert (totals.tokens_in, totals.tokens_out) == (
        sum(e.payload["input_tokens"] for e in calls),
        sum(e.payload["output_tokens"] for e in calls),
    )
    assert (totals.tokens_in, totals.tokens_out) == (300, 60)
