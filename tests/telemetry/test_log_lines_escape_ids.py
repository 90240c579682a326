"""A session's ids reach loomflow's log lines escaped, never raw.

Ids refuse control characters, but a line separator (U+2028) or a bidirectional override
(U+202E) is a valid id, and a journal row may be crafted by hand. The runtime's warnings named
the session by its scope key, which keeps such characters as they are: a line separator forged
a line in a log viewer that splits on it, an override reversed what followed it on a terminal.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from loomflow.runtime import SqliteRuntime

pytestmark = pytest.mark.timeout(60)

USER = "mallory\u2028WARNING loomflow.runtime: forged line"
SESSION = "s\u202egpj.exe"


async def _step() -> int:
    return 1


async def test_a_damaged_row_warning_escapes_a_hostile_session_and_user_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        with pytest.raises(RuntimeError, match="crash"):
            async with runtime.session(SESSION, USER):
                await runtime.step("charge", _step)
                raise RuntimeError("crash")
    finally:
        await runtime.close()
    with sqlite3.connect(path) as db:  # a row no step can match: its step runs again
        db.execute("UPDATE loom_entries SET name = CAST('charge' AS BLOB)")
    db.close()

    runtime = SqliteRuntime(path)
    try:
        with caplog.at_level(logging.WARNING, logger="loomflow"):
            async with runtime.session(SESSION, USER, resume=True) as run:
                await runtime.step("charge", _step)
                assert run.stats.corrupt == 1
    finally:
        await runtime.close()
    [record] = [r for r in caplog.records if "its step runs again" in r.getMessage()]
    line = logging.Formatter().format(record)
    assert "\u2028" not in line
    assert "\u202e" not in line
    assert line.isprintable()
    # Still named, as escapes a reader can search for.
    assert "mallory\\u2028WARNING" in line
    assert "s\\u202egpj.exe" in line
