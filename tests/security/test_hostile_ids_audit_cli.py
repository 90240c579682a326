"""Hostile ids given to the audit API and to the CLI: a typed error or one clean error line.

Before, audit queries, exports and verify took any id: a lone surrogate was a driver's
UnicodeEncodeError, and every CLI command given bytes that are not UTF-8 (which Python keeps
as lone surrogates) printed a traceback.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.audit import (
    AuditLog,
    InMemoryAuditStore,
    JsonlAuditStore,
    PostgresAuditStore,
    SqliteAuditStore,
)
from loomflow.errors import InvalidIdError

HOSTILE = {
    "empty": "",
    "long": "a" * 3000,
    "nul": "a\x00b",
    "newline": "a\nb",
    "lone surrogate": "a\ud800b",
}


@pytest.fixture(
    params=["memory", "jsonl", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
async def log(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditLog]:
    if request.param == "memory":
        store = InMemoryAuditStore()
    elif request.param == "jsonl":
        store = JsonlAuditStore(tmp_path / "audit.jsonl")
    elif request.param == "sqlite":
        store = SqliteAuditStore(tmp_path / "audit.db")
    else:
        store = PostgresAuditStore(request.getfixturevalue("pg_dsn"))
    audit = AuditLog(store)
    await audit.record("custom.note", user_id="alice", actor="test", payload={})
    yield audit
    await audit.close()


@pytest.mark.parametrize("bad", list(HOSTILE.values()), ids=list(HOSTILE))
async def test_audit_reads_refuse_a_hostile_id_with_invalid_id_error(
    log: AuditLog, bad: str
) -> None:
    for field, call in [
        ("user_id", lambda: log.query(user_id=bad)),
        ("session_id", lambda: log.query(session_id=bad)),
        ("run_id", lambda: log.query(run_id=bad)),
        ("user_id", lambda: log.count(user_id=bad)),
        ("session_id", lambda: log.export(io.StringIO(), session_id=bad)),
        ("user_id", lambda: log.verify(user_id=bad)),
        ("user_id", lambda: log.store.head(bad)),
    ]:
        with pytest.raises(InvalidIdError) as caught:
            await call()
        assert caught.value.field == field
    assert (await log.query(user_id="alice")).entries  # good ids still work


def _cli(tmp_path: Path, *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, LOOMFLOW_RUNTIME_URL=f"sqlite:///{tmp_path}/journal.db")
    env["LOOMFLOW_AUDIT_URL"] = f"sqlite:///{tmp_path}/audit.db"
    env["LOOMFLOW_BUDGET_URL"] = f"sqlite:///{tmp_path}/budget.db"
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )


NOT_UTF8 = b"a\xed\xa0\x80b"  # an encoded surrogate: Python's argv holds it as lone surrogates


@pytest.mark.parametrize(
    "command",
    [
        ["runs", "show"],
        ["runs", "list", "--user"],
        ["users", "export"],
        ["audit", "query", "--user"],
        ["audit", "verify", "--user"],
        ["budget", "show", "--user"],
    ],
    ids=lambda c: " ".join(c),
)
def test_a_cli_argument_that_is_not_utf8_is_one_error_line(
    tmp_path: Path, command: list[str]
) -> None:
    assert _cli(tmp_path, "migrate").returncode == 0
    done = _cli(tmp_path, *command, NOT_UTF8)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 1, err
    assert "Traceback" not in err
    assert err.startswith("loomflow: error:"), err
    assert "not valid UTF-8" in err, err


async def test_an_export_with_a_bad_id_creates_no_file(log: AuditLog, tmp_path: Path) -> None:
    target = tmp_path / "export.jsonl"
    with pytest.raises(InvalidIdError):
        await log.export(target, session_id="")
    assert not target.exists()


def test_a_heads_file_nested_too_deep_is_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "heads.json").write_text("[" * 100_000)
    (tmp_path / "export.jsonl").write_text("")
    done = _cli(tmp_path, "audit", "verify", "--file", "export.jsonl", "--heads", "heads.json")
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 1, err
    assert "Traceback" not in err
    assert err.startswith("loomflow: error: bad --heads file"), err


@pytest.mark.parametrize("last", ["\U0010ffff", "\ud7ff"], ids=["U+10FFFF", "U+D7FF"])
async def test_a_family_whose_prefix_ends_in_the_last_character_of_a_range(
    log: AuditLog, last: str
) -> None:
    # The family's text range ended at the next character: none after U+10FFFF (a
    # ValueError), a surrogate after U+D7FF (an encoding error from the driver).
    actions = [f"x{last}", f"x{last}a", f"x{last}\U0010ffff", "x\ue000", "y", "x"]
    for action in actions:
        await log.record(action, user_id="ana", actor="test", payload={})
    page = await log.query(action=f"x{last}*", limit=100)
    assert [e.action for e in page.entries] == actions[:3]
    assert await log.count(action=f"x{last}\U0010ffff*") == 1
