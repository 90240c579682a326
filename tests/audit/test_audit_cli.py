"""``loomflow audit query|export|verify`` as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from loomflow.audit import AuditRecord, SqliteAuditStore


def loomflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


async def _fill(path: Path) -> None:
    store = SqliteAuditStore(path)
    for i in range(5):
        await store.append(
            [
                AuditRecord(
                    user_id="alice",
                    session_id="s1",
                    run_id="r1",
                    actor="agent:a",
                    action="tool.call" if i % 2 else "model.call",
                    payload={"i": i, "tool": "charge"},
                ),
                AuditRecord(user_id="bob", session_id="s2", actor="agent:a", action="run.start"),
            ]
        )
    await store.close()


async def test_query_export_and_verify(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    await _fill(db)
    url = f"sqlite:///{db}"

    table = loomflow("audit", "--audit-url", url, "query", "--user", "alice", "--limit", "2")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["time", "(UTC)", "user", "seq", "session", "actor", "action",
                                "details"]  # fmt: skip
    assert "model.call" in lines[1]
    assert "tool=charge i=0" in lines[1]  # the tool first: long details are cut
    assert "--cursor" in lines[-1]
    cursor = lines[-1].split("--cursor ")[1]

    second = loomflow(
        "audit", "--audit-url", url, "query", "--user", "alice", "--limit", "2",
        "--cursor", cursor, "--json",
    )  # fmt: skip
    page = json.loads(second.stdout)
    assert [e["seq"] for e in page["entries"]] == [3, 4]
    assert page["next_cursor"] is not None

    # The URL can come from the environment too.
    tools = loomflow(
        "audit", "query", "--action", "tool.*", "--since", "1h", "--json",
        env={"LOOMFLOW_AUDIT_URL": url},
    )  # fmt: skip
    assert {e["action"] for e in json.loads(tools.stdout)["entries"]} == {"tool.call"}
    assert len(json.loads(tools.stdout)["entries"]) == 2
    future = loomflow("audit", "--audit-url", url, "query", "--since", "2999-01-01")
    assert future.stdout.strip() == "no audit entries match"

    out = tmp_path / "alice.jsonl"
    exported = loomflow("audit", "--audit-url", url, "export", "--user", "alice", "-o", str(out))
    assert exported.returncode == 0
    assert "exported 5 audit entries" in exported.stderr
    header, *rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert header == {"filters": {"user_id": "alice"}, "loomflow_audit_export": 1}
    assert [r["seq"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["user_id"] == "alice" for r in rows)
    stdout_export = loomflow("audit", "--audit-url", url, "export", "--session", "s2")
    assert len(stdout_export.stdout.splitlines()) == 1 + 5  # its header, then the entries

    ok = loomflow("audit", "--audit-url", url, "verify")
    assert ok.returncode == 0
    assert ok.stdout.startswith("OK: checked 10 entries of 2 user(s)")

    with sqlite3.connect(db) as conn:
        conn.execute("DROP TRIGGER loom_audit_no_delete")
        conn.execute("DELETE FROM loom_audit WHERE user_id = 'alice' AND seq = 3")
    broken = loomflow("audit", "--audit-url", url, "verify")
    assert broken.returncode == 1
    assert "FAILED: 1 problem(s)" in broken.stdout
    assert "missing" in broken.stdout
    assert "entry 3 is missing before entry 4" in broken.stdout
    as_json = loomflow("audit", "--audit-url", url, "verify", "--json")
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1
    assert report["problems"][0]["kind"] == "missing"
    assert report["problems"][0]["user_id"] == "alice"
    assert report["problems"][0]["seq"] == 3
    assert loomflow("audit", "--audit-url", url, "verify", "--user", "bob").returncode == 0


def test_a_range_that_runs_backwards_is_refused_not_answered_empty(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    asyncio.run(_fill(db))
    url = f"sqlite:///{db}"
    for command in ("query", "export"):
        backwards = loomflow("audit", "--audit-url", url, command, "--since", "1d", "--until", "2d")
        assert backwards.returncode == 2, backwards.stdout
        assert "--since" in backwards.stderr
        assert "is not before --until" in backwards.stderr
        assert backwards.stdout == ""
    forwards = loomflow(
        "audit", "--audit-url", url, "query", "--since", "2d", "--until", "2999-01-01"
    )
    assert forwards.returncode == 0, forwards.stderr
    assert "model.call" in forwards.stdout


def test_usage_and_store_errors_have_distinct_exit_codes(tmp_path: Path) -> None:
    assert loomflow("audit", "query", "--since", "whenever").returncode == 2
    assert loomflow("audit", "frobnicate").returncode == 2
    bad = loomflow("audit", "--audit-url", "mysql://x", "verify")
    assert bad.returncode == 1
    assert "scheme" in bad.stderr
    missing = loomflow("audit", "--audit-url", f"sqlite:///{tmp_path / 'new.db'}", "query")
    assert missing.returncode == 1  # a mistyped path is not an empty audit log
    assert "no audit log at" in missing.stderr
    assert not (tmp_path / "new.db").exists()
    url = f"sqlite:///{tmp_path / 'new.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    empty = loomflow("audit", "--audit-url", url, "query")
    assert empty.returncode == 0
    assert empty.stdout.strip() == "no audit entries match"
    nothing = loomflow("audit", "--audit-url", url, "verify")
    assert nothing.returncode == 0
    assert "no audit entries to verify" in nothing.stderr


def _edit(db: Path, sql: str) -> None:
    with sqlite3.connect(db) as conn:  # as someone with the file would: triggers first
        conn.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        conn.execute(sql)


def _no_constants(text: str) -> object:
    """Parse output as any JSON reader would: a bare NaN or Infinity is an error."""

    def refuse(name: str) -> object:
        raise AssertionError(f"{name} in the output")

    return json.loads(text, parse_constant=refuse)


async def test_verify_reports_a_payload_with_a_key_twice(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    await _fill(db)
    url = f"sqlite:///{db}"
    # Read as its first value by SQLite's json_extract, as its last by Python's json.
    _edit(
        db,
        """UPDATE loom_audit SET payload = replace(payload, '{"i"', '{"tool":"refund","i"')
        WHERE user_id = 'alice' AND seq = 4""",
    )
    with sqlite3.connect(db) as conn:
        first = conn.execute(
            "SELECT json_extract(payload, '$.tool') FROM loom_audit "
            "WHERE user_id = 'alice' AND seq = 4"
        ).fetchone()[0]
    assert first == "refund"
    broken = loomflow("audit", "--audit-url", url, "verify")
    assert broken.returncode == 1, broken.stdout
    assert "FAILED: 1 problem(s)" in broken.stdout
    assert 'entry 4 has an unreadable payload: the key "tool" is given twice' in broken.stdout
    out = tmp_path / "all.jsonl"
    exported = loomflow("audit", "--audit-url", url, "export", "-o", str(out))
    assert exported.returncode == 3, exported.stderr  # written, with the row marked
    offline = loomflow("audit", "verify", "--file", str(out))
    assert offline.returncode == 1, offline.stdout


async def test_verify_file_refuses_a_line_with_a_key_twice(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    await _fill(db)
    url = f"sqlite:///{db}"
    out = tmp_path / "all.jsonl"
    assert loomflow("audit", "--audit-url", url, "export", "-o", str(out)).returncode == 0
    heads = tmp_path / "heads.json"
    heads.write_text(loomflow("audit", "--audit-url", url, "verify", "--json").stdout)
    lines = out.read_text(encoding="utf-8").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith('{"action":"tool.call",'))
    lines[at] = lines[at].replace('{"action":', '{"action":"tool.denied","action":', 1)
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    for extra in ([], ["--heads", str(heads)]):
        checked = loomflow("audit", "verify", "--file", str(out), *extra)
        assert checked.returncode == 1, checked.stdout
        assert "unreadable" in checked.stdout
        assert 'the key "action" is given twice' in checked.stdout


async def test_export_and_query_a_nan_payload_without_a_traceback(tmp_path: Path) -> None:
    db = tmp_path / "audit.db"
    await _fill(db)
    url = f"sqlite:///{db}"
    _edit(db, """UPDATE loom_audit SET payload = '{"a":NaN}' WHERE user_id = 'alice' AND seq = 4""")
    out = tmp_path / "all.jsonl"
    exported = loomflow("--url", url, "audit", "export", "-o", str(out))
    assert exported.returncode == 3, exported.stderr  # written, with the row marked
    assert "Traceback" not in exported.stderr
    assert "exported 10 audit entries" in exported.stderr
    assert "damaged audit row: the trail of user 'alice', entry 4" in exported.stderr
    rows = [_no_constants(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 10
    nan = next(r for r in rows if isinstance(r, dict) and r["seq"] == 4 and r["user_id"] == "alice")
    assert nan["payload"] == {"unreadable_payload": '{"a":NaN}'}
    assert nan["unreadable"] == "entry 4 has an unreadable payload: NaN is not JSON"
    offline = loomflow("audit", "verify", "--file", str(out), "--json")
    assert offline.returncode == 1, offline.stdout
    found = json.loads(offline.stdout)["problems"]
    assert [(p["user_id"], p["kind"], p["seq"]) for p in found] == [("alice", "unreadable", 4)]
    query = loomflow("--url", url, "audit", "query", "--user", "alice", "--json")
    assert query.returncode == 3, query.stderr  # shown, marked, and not passed for intact
    assert "damaged audit row: the trail of user 'alice', entry 4" in query.stderr
    page = _no_constants(query.stdout)
    assert isinstance(page, dict)
    assert page["entries"][3]["payload"] == {"unreadable_payload": '{"a":NaN}'}
    assert "NaN is not JSON" in page["entries"][3]["unreadable"]
    table = loomflow("--url", url, "audit", "query", "--user", "alice")
    assert table.returncode == 3, table.stderr
    verified = loomflow("--url", url, "audit", "verify")
    assert verified.returncode == 1
    assert "entry 4 has an unreadable payload: NaN is not JSON" in verified.stdout


async def test_an_export_goes_on_past_a_malformed_row_and_marks_it(tmp_path: Path) -> None:
    # The row stopped the export (exit 1, no file): a data-subject export waited for a repair.
    db = tmp_path / "audit.db"
    await _fill(db)
    _edit(db, "UPDATE loom_audit SET seq = 'four' WHERE user_id = 'alice' AND seq = 4")
    out = tmp_path / "all.jsonl"
    exported = loomflow("--url", f"sqlite:///{db}", "audit", "export", "-o", str(out))
    assert exported.returncode == 3
    assert "Traceback" not in exported.stderr
    assert "of user 'alice' is malformed: seq is 'four'" in exported.stderr
    markers = [json.loads(line) for line in out.read_text().splitlines() if "hash" not in line]
    assert [(m["user_id"], m["seq"]) for m in markers] == [("alice", None)]
    assert "seq is 'four'" in markers[0]["unreadable"]


async def test_a_query_page_of_damaged_rows_only_still_says_how_to_go_on(tmp_path: Path) -> None:
    # A table page whose rows were all damaged printed nothing but the stderr lines, and no
    # cursor: the query went on past damaged rows in --json only; the table stopped there.
    db = tmp_path / "audit.db"
    await _fill(db)
    _edit(db, "UPDATE loom_audit SET seq = 'one' WHERE user_id = 'alice' AND seq = 1")
    url = f"sqlite:///{db}"
    first = loomflow("--url", url, "audit", "query", "--user", "alice", "--limit", "1")
    assert first.returncode == 3, first.stderr
    assert "seq is 'one'" in first.stderr
    assert "more entries: add --cursor 1" in first.stdout
    going_on = loomflow(
        "--url", url, "audit", "query", "--user", "alice", "--limit", "1", "--cursor", "1"
    )
    assert going_on.returncode == 0, going_on.stderr
    assert "more entries: add --cursor" in going_on.stdout


async def test_verify_reports_a_row_with_a_malformed_seq_and_checks_the_other_trails(
    tmp_path: Path,
) -> None:
    """A seq or time edited into text (SQLite keeps any type) is a failed check in its place,
    not an error that hides every other user's result (the console answered 400)."""
    from loomflow.audit import SqliteAuditStore

    db = tmp_path / "audit.db"
    await _fill(db)
    _edit(db, "UPDATE loom_audit SET seq = 'four' WHERE user_id = 'alice' AND seq = 4")
    store = SqliteAuditStore(db)
    try:
        report = await store.verify()
        assert not report.ok
        kinds = [(p.user_id, p.kind) for p in report.problems]
        assert ("alice", "unreadable") in kinds, report.problems
        assert any("seq is 'four'" in p.detail for p in report.problems)
        assert report.users == 2  # bob's trail was checked too, and holds
        assert not [p for p in report.problems if p.user_id == "bob"]
        assert (await store.verify(user_id="bob")).ok
        assert not (await store.verify(user_id="alice")).ok
    finally:
        await store.close()
    verified = loomflow("--url", f"sqlite:///{db}", "audit", "verify")
    assert verified.returncode == 1
    assert "Traceback" not in verified.stderr
    assert "seq is 'four'" in verified.stdout


async def test_verify_file_reports_a_line_that_is_not_utf8_where_it_is(tmp_path: Path) -> None:
    # One byte that is not UTF-8 stopped the whole check ("a file read is not UTF-8 text (a
    # .env saved as UTF-16?)"): no other line, nor any other user's trail, was checked.
    db = tmp_path / "audit.db"
    await _fill(db)
    url = f"sqlite:///{db}"
    out = tmp_path / "all.jsonl"
    assert loomflow("audit", "--audit-url", url, "export", "-o", str(out)).returncode == 0
    heads = tmp_path / "heads.json"
    heads.write_text(loomflow("audit", "--audit-url", url, "verify", "--json").stdout)
    lines = out.read_bytes().split(b"\n")
    at = next(i for i, line in enumerate(lines) if b'"seq":3' in line and b'"alice"' in line)
    lines[at] = lines[at].replace(b'"agent:a"', b'"agent:\xffa"', 1)
    out.write_bytes(b"\n".join(lines))
    for extra in ([], ["--heads", str(heads)]):
        checked = loomflow("audit", "verify", "--file", str(out), "--json", *extra)
        assert checked.returncode == 1, checked.stderr
        report = json.loads(checked.stdout)
        # The line, and the gap it leaves in alice's trail.
        assert [(p["kind"], p["user_id"], p["seq"]) for p in report["problems"]] == [
            ("unreadable", None, None),
            ("missing", "alice", 3),
        ], report["problems"]
        assert report["problems"][0]["position"] == at + 1
        assert "not UTF-8" in report["problems"][0]["detail"]
        assert "0xff" in report["problems"][0]["detail"]
        # Every other line was read and checked: alice's other four, and all of bob's.
        assert (report["users"], report["entries"]) == (2, 9)


def test_json_output_escapes_what_a_terminal_would_act_on(tmp_path: Path) -> None:
    """A model or a crafted row can put a C1 control (U+009B opens an escape sequence on
    8-bit terminals) or a bidirectional override in a payload: the JSON a person may read on
    a terminal carries them as escapes, and parses back to the same text."""
    db = tmp_path / "audit.db"
    hostile = "paid \x9b31m\u202egnp.exe\x7f done"

    async def fill() -> None:
        store = SqliteAuditStore(db)
        await store.append(
            [
                AuditRecord(
                    user_id="ana", actor="agent:a", action="tool.call", payload={"t": hostile}
                )
            ]
        )
        await store.close()

    asyncio.run(fill())
    result = loomflow("audit", "--audit-url", f"sqlite:///{db}", "query", "--json")
    assert result.returncode == 0, result.stderr
    for raw in ("\x9b", "\u202e", "\x7f"):
        assert raw not in result.stdout
    assert "\\u009b" in result.stdout
    assert json.loads(result.stdout)["entries"][0]["payload"]["t"] == hostile
    exported = loomflow("users", "--url", f"sqlite:///{db}", "export", "ana")
    assert exported.returncode == 0, exported.stderr
    assert "\u202e" not in exported.stdout


async def test_export_of_a_truncated_trail_warns_what_the_file_cannot_show(tmp_path: Path) -> None:
    # Entries cut off the end, head left as it was: only the store's head knows. An export
    # of that trail verifies as intact on its own (no saved heads), so the export says so.
    db = tmp_path / "audit.db"
    await _fill(db)
    url = f"sqlite:///{db}"
    with sqlite3.connect(db) as conn:
        conn.execute("DROP TRIGGER loom_audit_no_delete")
        conn.execute("DELETE FROM loom_audit WHERE user_id = 'alice' AND seq > 3")
    out = tmp_path / "alice.jsonl"
    for scope in (["--user", "alice"], []):
        exported = loomflow("audit", "--audit-url", url, "export", *scope, "-o", str(out))
        assert exported.returncode == 0, exported.stderr
        assert "exported" in exported.stderr
        assert "loomflow: warning: the audit trail of user 'alice' fails verification" in (
            exported.stderr
        )
        assert "truncated" in exported.stderr
        assert "entries 4-5 are missing at the end" in exported.stderr
        # What the warning is for: the file alone passes.
        offline = loomflow("audit", "verify", "--file", str(out), *scope)
        assert offline.returncode == 0, offline.stdout
    intact = loomflow("audit", "--audit-url", url, "export", "--user", "bob", "-o", str(out))
    assert intact.returncode == 0
    assert "warning" not in intact.stderr
