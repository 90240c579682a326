"""SQLite text columns holding bytes that are not UTF-8 read as damaged rows, not as an outage.

SQLite stores whatever bytes a writer hands it as TEXT (``CAST(x'ff' AS TEXT)``, another
program's encoding, a damaged page). Decoded strictly, such a row made every query that read
it fail with "Could not decode to UTF-8", which loomflow reported as StoreUnavailableError: a
whole session, a whole audit trail looked like a database that was down, and a worker would
retry it forever. Read with each stray byte kept as a lone surrogate, the row reaches the
checks that name it: a journal key no step matches, an audit entry that was changed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_hand_edited_rows import Counter, sqlite_exec
from test_hand_edited_rows import _journal_with_open_run as _open_run
from test_text_not_utf8_stores import cli

from loomflow.audit import AuditLog, SqliteAuditStore
from loomflow.audit.offline import verify_lines
from loomflow.runtime import SqliteRuntime

NOT_UTF8 = "CAST(x'ff41' AS TEXT)"  # 0xff starts no UTF-8 sequence
# A UTF-8 terminal's stdout refuses a lone surrogate; a C.UTF-8 locale's surrogateescape would
# hide a crash of the printing.
STRICT_STDOUT = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}


async def test_a_damaged_row_leaves_the_other_sessions_readable(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    runtime = SqliteRuntime(path)
    try:
        for session in ("s", "t"):
            async with runtime.session(session, "u"):
                await runtime.step("charge", Counter())
    finally:
        await runtime.close()
    sqlite_exec(path, f"UPDATE loom_entries SET name = {NOT_UTF8} WHERE scope LIKE '%\"s\"%'")
    runtime = SqliteRuntime(path)
    try:
        entries = await runtime.entries("t", "u")
        assert [e.name for e in entries] == ["charge"]
        damaged = await runtime.entries("s", "u")
        assert [e.name for e in damaged] == ["\udcffA"]  # the stray byte, kept
    finally:
        await runtime.close()


@pytest.mark.parametrize(
    "edit",
    [
        f"UPDATE loom_entries SET name = {NOT_UTF8}",
        f"UPDATE loom_entries SET kind = {NOT_UTF8}",
        f"UPDATE loom_sessions SET status = {NOT_UTF8}",
        f"UPDATE loom_sessions SET owner = {NOT_UTF8}",
        f"UPDATE loom_sessions SET session_id = {NOT_UTF8}",
    ],
)
async def test_cli_listings_show_a_row_that_is_not_utf8(tmp_path: Path, edit: str) -> None:
    path = tmp_path / "journal.db"
    await _open_run(path, Counter())
    await asyncio.to_thread(sqlite_exec, path, edit)
    for command in (["runs", "list"], ["runs", "list", "--json"], ["runs", "show", "s"]):
        done = await asyncio.to_thread(cli, path, *command)
        if command[-1] == "s" and "session_id" in edit:
            # The session's own row no longer names it: not found, said as such.
            assert done.returncode == 1, done.stderr
            assert "no session 's'" in done.stderr
            continue
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr
        assert "unavailable" not in done.stderr
        if command[-1] == "--json":
            for line in done.stdout.splitlines():
                json.loads(line)  # each line still JSON (lone surrogates as escapes)


@pytest.mark.parametrize("column", ["actor", "action", "session_id", "payload"])
async def test_an_audit_entry_that_is_not_utf8_is_reported_not_unavailable(
    tmp_path: Path, column: str
) -> None:
    path = tmp_path / "audit.db"
    log = AuditLog(SqliteAuditStore(path))
    try:
        for i in range(3):
            await log.record(
                "custom.note", user_id="alice", actor="test", session_id="s", payload={"i": i}
            )
        await asyncio.to_thread(
            sqlite_exec,
            path,
            "DROP TRIGGER loom_audit_no_update",
            f"UPDATE loom_audit SET {column} = {NOT_UTF8} WHERE seq = 2",
        )
        report = await log.verify()
        assert not report.ok
        assert {p.seq for p in report.problems} == {2}
        assert {p.kind for p in report.problems} <= {"edited", "unreadable"}
        page = await log.query(user_id="alice")
        assert [e.seq for e in page.entries] == [1, 2, 3]  # the trail stays readable
    finally:
        await log.close()

    # The export holds the entry as stored (the stray byte as a JSON escape), in a file that
    # is UTF-8, and the offline check finds the same change.
    out = tmp_path / "alice.jsonl"
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "loomflow.cli", "audit", "export", "--user", "alice",
         "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**STRICT_STDOUT, "LOOMFLOW_AUDIT_URL": f"sqlite:///{path}"},
        timeout=120,
    )  # fmt: skip
    # 3 when the row is marked unreadable (a payload that is not UTF-8): written, not whole.
    assert done.returncode == (3 if column == "payload" else 0), done.stderr
    lines = out.read_bytes().decode("utf-8").splitlines()
    assert len(lines) == 4  # the header and three entries
    assert "\\udcff" in lines[2]
    offline = verify_lines(lines, user_id="alice")
    assert not offline.ok
    assert {p.seq for p in offline.problems if p.kind in ("edited", "unreadable")} == {2}


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (f"UPDATE loom_entries SET name = {NOT_UTF8}", "text that is not UTF-8 for its name"),
        ("UPDATE loom_entries SET path = CAST(path AS BLOB)", "a bytes for its path"),
        ("UPDATE loom_entries SET path = 'not json'", "a sub-run path that is not a list"),
        ("UPDATE loom_entries SET epoch = 'zero'", "a str ('zero') for its epoch"),
        # A value no resume can read runs again too: it said "replays".
        (
            "UPDATE loom_entries SET value = x'00ff'",
            "an unreadable value: step 'charge': not valid JSON",
        ),
        (
            "UPDATE loom_entries SET format = 'yaml'",
            "an unreadable value: step 'charge': unknown value format 'yaml'",
        ),
        (
            "UPDATE loom_entries SET codec_version = 99",
            "an unreadable value: step 'charge': written by a newer codec (v99)",
        ),
    ],
)
async def test_runs_show_marks_a_row_no_step_can_match(tmp_path: Path, edit: str, why: str) -> None:
    path = tmp_path / "journal.db"
    await _open_run(path, Counter())
    await asyncio.to_thread(sqlite_exec, path, edit)
    if "value" not in why:  # a key the listing itself reads; a value only runs show decodes
        runtime = SqliteRuntime(path)
        try:
            [entry] = await runtime.entries("s", "u")
            assert entry.damage is not None
            assert entry.damage.startswith(why)
        finally:
            await runtime.close()
    outputs = []
    for json_flag in ([], ["--json"]):
        done = await asyncio.to_thread(cli, path, "runs", "show", "s", *json_flag)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    # A newer release's step is no damage: a resume stops there rather than run it again.
    assert ("newer loomflow: resume stops" if "newer codec" in why else "damaged") in outputs[0]
    assert " replays " not in outputs[0]
    [line] = outputs[1].splitlines()
    damage = json.loads(line)["damage"]
    newer = why.removeprefix("an unreadable value: ")
    assert damage.startswith(newer if "newer codec" in why else why)


async def test_runs_show_keeps_a_sound_row_replaying(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    await _open_run(path, Counter())
    runtime = SqliteRuntime(path)
    try:
        [entry] = await runtime.entries("s", "u")
        assert entry.damage is None
    finally:
        await runtime.close()
