"""Checking an exported trail offline: ``verify_lines`` and ``loomflow audit verify --file``."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loomflow.audit import (
    ANY_USER,
    GENESIS,
    AuditEntry,
    AuditRecord,
    ChainHead,
    SqliteAuditStore,
    heads_from_json,
    verify_lines,
)


async def _export(tmp_path: Path, **filters: object) -> tuple[list[str], list[ChainHead]]:
    """A store with two users' interleaved trails, exported (with filters) as lines."""
    store = SqliteAuditStore(tmp_path / "audit.db")
    for i in range(6):
        await store.append(
            [
                AuditRecord(user_id="alice", actor="agent:a", action="tool.call", payload={"i": i}),
                AuditRecord(user_id="bob", actor="agent:a", action="model.call", payload={"i": i}),
            ]
        )
    out = tmp_path / "export.jsonl"
    await store.export(out, **filters)
    report = await store.verify()
    await store.close()
    return out.read_text().splitlines(), report.heads


async def test_an_untouched_export_verifies_against_its_heads(tmp_path: Path) -> None:
    lines, heads = await _export(tmp_path)
    report = verify_lines(lines, heads=heads)
    assert report.ok, report.problems
    assert (report.users, report.entries) == (2, 12)
    assert report.warnings == []


@pytest.mark.parametrize(
    ("tamper", "kind"),
    [
        ("edit", "edited"),
        ("delete", "missing"),
        ("swap", "reordered"),  # as on a store, not a deletion plus a duplicate
        ("move_to_end", "reordered"),
        ("drop_tail", "truncated"),
        ("garbage", "unreadable"),
    ],
)
async def test_tampering_with_an_export_is_found(tmp_path: Path, tamper: str, kind: str) -> None:
    lines, heads = await _export(tmp_path, user_id="alice")
    if tamper == "edit":
        entry = json.loads(lines[2])
        entry["payload"]["i"] = 99
        lines[2] = json.dumps(entry)
    elif tamper == "delete":
        del lines[3]
    elif tamper == "swap":
        lines[1], lines[2] = lines[2], lines[1]
    elif tamper == "move_to_end":
        lines.append(lines.pop(2))
    elif tamper == "drop_tail":
        lines = lines[:-1]
    else:
        lines.insert(1, "{not json")
    alice = [h for h in heads if h.user_id == "alice"]
    report = verify_lines(lines, heads=alice)
    assert not report.ok
    assert kind in {p.kind for p in report.problems}, report.problems
    if kind == "reordered":  # nothing was deleted or duplicated
        assert {p.kind for p in report.problems} == {"reordered"}, report.problems


async def test_an_export_from_a_date_on_is_checked_from_its_first_entry(tmp_path: Path) -> None:
    lines, heads = await _export(tmp_path, user_id="bob")
    _, *entries = lines
    since = json.loads(entries[2])["time"]
    header = json.dumps({"filters": {"user_id": "bob", "since": since}, "loomflow_audit_export": 1})
    for start in ([header], []):  # its header says since; an export from before headers
        report = verify_lines([*start, *entries[2:]], heads=heads, user_id="bob")
        assert report.ok, report.problems
        [warning] = report.warnings
        assert warning.kind == "unanchored"
        assert warning.seq == 3  # its link to entry 2 cannot be checked from the file alone


@pytest.mark.parametrize("until", [False, True])
async def test_an_export_whose_header_names_no_start_must_begin_at_entry_1(
    tmp_path: Path, until: bool
) -> None:
    # Entries are never deleted, so an export made without --since (or --session, --run,
    # --action) holds each trail from entry 1: one starting later lost its first lines, and
    # without saved heads nothing else would say so.
    lines, _ = await _export(tmp_path, user_id="bob")
    _, *entries = lines
    filters: dict[str, object] = {"user_id": "bob"}
    if until:
        filters["until"] = "2999-01-01T00:00:00.000000Z"
    header = json.dumps({"filters": filters, "loomflow_audit_export": 1})
    report = verify_lines([header, *entries[2:]], user_id="bob")
    assert [(p.kind, p.seq, p.position) for p in report.problems] == [("missing", 1, 2)]
    assert "entries 1-2 are missing before entry 3" in report.problems[0].detail
    assert report.warnings == []


async def test_a_page_that_names_where_it_starts_is_not_missing_its_first_entries(
    tmp_path: Path,
) -> None:
    # The console exports one page of a trail; its header names the entry the page follows,
    # so the page is not read as a whole trail missing its first entries, and a line from
    # before that point is outside the export.
    lines, _ = await _export(tmp_path, user_id="bob")
    _, *entries = lines
    header = json.dumps(
        {"filters": {"user_id": "bob", "after_seq": "2"}, "loomflow_audit_export": 1}
    )
    report = verify_lines([header, *entries[2:]], user_id="bob")
    assert report.problems == []
    assert [w.kind for w in report.warnings] == ["unanchored"]
    report = verify_lines([header, *entries[1:]], user_id="bob")
    assert [p.kind for p in report.problems] == ["outside_export"]
    bad = json.dumps({"filters": {"user_id": "bob", "after_seq": "-1"}, "loomflow_audit_export": 1})
    report = verify_lines([bad, *entries], user_id="bob")
    assert [p.kind for p in report.problems] == ["unreadable"]


def test_heads_come_from_a_verify_report_or_a_list() -> None:
    head = {"user_id": "a", "seq": 3, "hash": "f" * 64}
    assert heads_from_json({"ok": True, "heads": [head]}) == [ChainHead("a", 3, "f" * 64)]
    assert heads_from_json([head]) == [ChainHead("a", 3, "f" * 64)]
    with pytest.raises(ValueError, match="not a chain head"):
        heads_from_json([{"user_id": "a"}])


HASH = "f" * 64


@pytest.mark.parametrize(
    "head", ['"seq":true', '"seq":"3"', '"seq":3.5', '"seq":1e400', '"seq":NaN',
             '"seq":9007199254740993', '"seq":3,"hash":null', '"seq":3,"hash":7',
             '"seq":0', '"seq":-3', '"seq":-9007199254740991']
)  # fmt: skip
def test_a_saved_head_of_the_wrong_type_is_refused_not_taken_for_another(
    head: str, tmp_path: Path
) -> None:
    # True was taken for seq 1, "3" for 3 and a null hash for the text "None"; 1e400 (read
    # as infinity) crashed the CLI with a traceback. A seq below 1, which no entry has, let a
    # heads file edited to seq 0 pass as ok, with warnings of "entries -2-5". The Node
    # verifier refuses them all.
    if '"hash"' not in head:
        head += f',"hash":"{HASH}"'
    text = '{"heads":[{"user_id":"a",' + head + "}]}"
    with pytest.raises(ValueError, match="not a chain head"):
        heads_from_json(json.loads(text))
    (tmp_path / "heads.json").write_text(text)
    (tmp_path / "export.jsonl").write_text("")
    done = _cli(
        "verify", "--file", str(tmp_path / "export.jsonl"), "--heads", str(tmp_path / "heads.json")
    )
    assert done.returncode == 1
    assert done.stderr.startswith("loomflow: error: bad --heads file"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_saved_head_written_as_a_whole_float_is_that_seq() -> None:
    # JSON readers, the Node verifier's among them, read 3.0 as 3.
    head = {"user_id": "a", "seq": 3.0, "hash": HASH}
    assert heads_from_json([head]) == [ChainHead("a", 3, HASH)]


async def test_the_cli_verifies_a_file_without_any_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    await _export(tmp_path)  # creates the store

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "loomflow.cli", "audit", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "LOOMFLOW_AUDIT_URL": "postgresql://nobody@127.0.0.1:1/none"},
        )

    export = tmp_path / "trail.jsonl"
    heads = tmp_path / "heads.json"
    assert cli("--audit-url", url, "export", "-o", str(export)).returncode == 0
    heads.write_text(cli("--audit-url", url, "verify", "--json").stdout)
    # The default store is unreachable: --file must not touch it.
    good = cli("verify", "--file", str(export), "--heads", str(heads))
    assert good.returncode == 0, good.stderr
    assert good.stdout.startswith("OK: checked 12 entries of 2 user(s)")
    export.write_text("".join(export.read_text().splitlines(keepends=True)[:-1]))
    short = cli("verify", "--file", str(export), "--heads", str(heads), "--json")
    assert short.returncode == 1
    assert {p["kind"] for p in json.loads(short.stdout)["problems"]} == {"truncated"}
    missing = cli("verify", "--file", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1
    assert "cannot read" in missing.stderr
    # With --heads and no --file, the store is checked: here the unreachable default.
    assert cli("verify", "--heads", str(heads)).returncode == 1
    # --user: the export is that user's trail alone (bob's last line was cut off above), so
    # the other user's lines in this whole-log export do not belong in it.
    only = cli("verify", "--file", str(export), "--heads", str(heads), "--user", "bob", "--json")
    assert only.returncode == 1
    assert json.loads(only.stdout)["users"] == 1
    assert [(p["user_id"], p["kind"]) for p in json.loads(only.stdout)["problems"]] == [
        ("bob", "truncated"),
        ("alice", "outside_export"),
    ]
    bob = tmp_path / "bob.jsonl"
    assert cli("--audit-url", url, "export", "--user", "bob", "-o", str(bob)).returncode == 0
    assert cli("verify", "--file", str(bob), "--heads", str(heads), "--user", "bob").returncode == 0


# -- saved heads catch rewrites, wherever the trail ends now ---------------------------------


@pytest.mark.parametrize("spelled", ["2026-05-08T09:14:03.5120009Z", "2026-02-30T10:00:00.000000Z"])
async def test_a_time_spelled_otherwise_is_named_with_its_value(
    tmp_path: Path, spelled: str
) -> None:
    """strptime's words alone ("unconverted data remains: 9") named neither the field nor
    the value, where the Node verifier said which time was not spelled as exported."""
    lines, _ = await _export(tmp_path)
    entry = json.loads(lines[2])
    lines[2] = json.dumps(entry | {"time": spelled})
    export = tmp_path / "edited.jsonl"
    export.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    done = _cli("verify", "--json", "--file", str(export))
    assert done.returncode == 1, done.stdout + done.stderr
    (problem, *_) = json.loads(done.stdout)["problems"]
    assert (problem["kind"], problem["position"]) == ("unreadable", 3)
    assert f"time '{spelled}' is not spelled YYYY-MM-DDTHH:MM:SS.ffffffZ" in problem["detail"]


def _rechained(entries: list[AuditEntry], start: int, extra: int) -> list[AuditEntry]:
    """The trail with entries ``start``.. rewritten and re-hashed, plus ``extra`` new ones:
    every hash and link is consistent again, as a forger with write access would leave it."""
    out = entries[: start - 1]
    prev = out[-1].hash if out else GENESIS
    forged = [e.model_copy(update={"payload": {"forged": True}}) for e in entries[start - 1 :]] + [
        entries[-1].model_copy(update={"seq": entries[-1].seq + i, "payload": {"new": i}})
        for i in range(1, extra + 1)
    ]
    for entry in forged:
        entry = entry.model_copy(update={"prev_hash": prev})
        entry = entry.rehashed()
        out.append(entry)
        prev = entry.hash
    return out


async def _trail(tmp_path: Path, count: int = 13) -> tuple[SqliteAuditStore, list[AuditEntry]]:
    store = SqliteAuditStore(tmp_path / "audit.db")
    await store.append(AuditRecord(user_id="bob", actor="t", action="x"))
    trail = await store.append(
        [
            AuditRecord(user_id="alice", actor="t", action="x", payload={"i": i})
            for i in range(count)
        ]
    )
    return store, trail


async def test_a_rewrite_behind_a_saved_head_fails_though_the_export_grew(tmp_path: Path) -> None:
    store, trail = await _trail(tmp_path)
    saved = (await store.verify()).heads  # alice at 13
    await store.close()
    forged = _rechained(trail, start=5, extra=1)  # 5..13 rewritten, 14 appended
    lines = [e.to_line() for e in forged]
    assert verify_lines(lines).ok  # the chain alone is whole again
    alice = [h for h in saved if h.user_id == "alice"]
    report = verify_lines(lines, heads=alice)
    assert [(p.kind, p.seq) for p in report.problems] == [("head_mismatch", 13)]
    # A genuine trail that grew past the saved head passes, with a note on the new tail.
    honest = [*trail, *_rechained(trail, start=len(trail) + 1, extra=2)[len(trail) :]]
    report = verify_lines([e.to_line() for e in honest], heads=alice)
    assert report.ok, report.problems
    assert [(w.kind, w.seq) for w in report.warnings] == [("unanchored", 14)]
    # Several saved heads: each one's entry is compared.
    older = ChainHead("alice", 7, trail[6].hash)
    report = verify_lines(lines, heads=[older, *alice])
    assert {(p.kind, p.seq) for p in report.problems} == {
        ("head_mismatch", 7),
        ("head_mismatch", 13),
    }
    # Shorter than a saved head: truncated, even when the short trail is consistent.
    report = verify_lines([e.to_line() for e in trail[:10]], heads=alice)
    assert [(p.kind, p.seq) for p in report.problems] == [("truncated", 11)]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "audit", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _sql(path: Path, *statements: str) -> None:
    with sqlite3.connect(path) as conn:
        for name in ("loom_audit_no_update", "loom_audit_no_delete", "loom_audit_heads_no_delete"):
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
        conn.execute("DROP TRIGGER IF EXISTS loom_audit_heads_forward")
        for statement in statements:
            conn.execute(statement)


async def test_the_cli_checks_saved_heads_on_the_store_and_on_exports(tmp_path: Path) -> None:
    store, trail = await _trail(tmp_path)
    await store.close()
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    heads = tmp_path / "heads.json"
    heads.write_text(_cli("--audit-url", url, "verify", "--json").stdout)
    assert _cli("--audit-url", url, "verify", "--heads", str(heads)).returncode == 0

    # Rewrite alice's 5..13 in the database, head included, and append entry 14.
    forged = _rechained(trail, start=5, extra=1)
    db = tmp_path / "audit.db"
    _sql(
        db,
        "DELETE FROM loom_audit WHERE user_id = 'alice' AND seq >= 5",
        "DELETE FROM loom_audit_heads WHERE user_id = 'alice'",
    )
    with sqlite3.connect(db) as conn:
        for name in ("loom_audit_chain", "loom_audit_move_head"):
            conn.execute(f"DROP TRIGGER IF EXISTS {name}")
        for e in forged[4:]:
            conn.execute(
                "INSERT INTO loom_audit (user_key, user_id, seq, time_us, session_id, run_id, "
                "actor, action, payload, schema_version, prev_hash, hash, hash_version, "
                "payload_digest, payload_salt) "
                "VALUES (?, ?, ?, ?, NULL, NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    '"alice"',
                    "alice",
                    e.seq,
                    e.time_us,
                    e.actor,
                    e.action,
                    json.dumps(e.payload, sort_keys=True, separators=(",", ":")),
                    e.schema_version,
                    e.prev_hash,
                    e.hash,
                    e.hash_version,
                    e.payload_digest,
                    e.payload_salt,
                ),
            )
        conn.execute(
            "INSERT INTO loom_audit_heads VALUES ('\"alice\"', 'alice', ?, ?)",
            (forged[-1].seq, forged[-1].hash),
        )
    assert _cli("--audit-url", url, "verify").returncode == 0  # the store alone is fooled
    rewritten = _cli("--audit-url", url, "verify", "--heads", str(heads), "--json")
    assert rewritten.returncode == 1
    assert [(p["kind"], p["seq"]) for p in json.loads(rewritten.stdout)["problems"]] == [
        ("head_mismatch", 13)
    ]
    export = tmp_path / "export.jsonl"
    assert _cli("--audit-url", url, "export", "-o", str(export)).returncode == 0
    assert _cli("verify", "--file", str(export)).returncode == 0
    assert _cli("verify", "--file", str(export), "--heads", str(heads)).returncode == 1

    # Delete bob's whole trail and his head: only the saved heads still know him.
    _sql(
        db,
        "DELETE FROM loom_audit WHERE user_id = 'bob'",
        "DELETE FROM loom_audit_heads WHERE user_id = 'bob'",
    )
    gone = _cli("--audit-url", url, "verify", "--user", "bob", "--heads", str(heads), "--json")
    assert gone.returncode == 1
    assert [(p["user_id"], p["kind"]) for p in json.loads(gone.stdout)["problems"]] == [
        ("bob", "truncated")
    ]
    bad = tmp_path / "bad.json"
    bad.write_text('{"heads": [{"seq": "x"}]}')
    failed = _cli("--audit-url", url, "verify", "--heads", str(bad))
    assert failed.returncode == 1
    assert "bad --heads file" in failed.stderr


async def test_the_cli_refuses_an_erasure_no_record_covers(tmp_path: Path) -> None:
    # retain keeps what came after its cut-off; blanking that payload by hand later (the
    # SQLite trigger lets an erasure-shaped update through) is on no record, although a
    # record follows it.
    db = tmp_path / "audit.db"
    url = f"sqlite:///{db}"
    store = SqliteAuditStore(db)
    await store.append([AuditRecord(user_id="bob", actor="a", action="x") for _ in range(2)])
    # The cut-off (the CLI's now less 5 s) falls between the two writes as long as the CLI
    # starts within 5 s: a loaded CI machine once took more than the 0.2 s left before, and
    # under a load of 17 about 2 s of 2.5.
    await asyncio.sleep(10)
    await store.append(AuditRecord(user_id="bob", actor="a", action="note.after"))
    await store.close()
    retained = _cli("--audit-url", url, "retain", "--older-than", "5s", "--yes")
    assert retained.returncode == 0, retained.stderr
    assert "erased 2 payload(s) of 1 user(s)" in retained.stdout
    assert _cli("--audit-url", url, "verify").returncode == 0
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE loom_audit SET payload = 'null', payload_salt = NULL "
            "WHERE action = 'note.after'"
        )
    done = _cli("--audit-url", url, "verify")
    assert done.returncode == 1
    assert "(3 payloads erased, 1 with no erasure record)" in done.stdout
    assert "the payload of entry 3 is gone, but no erasure record covers it" in done.stdout
    export = tmp_path / "bob.jsonl"
    assert _cli("--audit-url", url, "export", "-o", str(export)).returncode == 0
    offline = _cli("verify", "--file", str(export), "--json")
    assert offline.returncode == 1
    assert [
        (p["user_id"], p["kind"], p["seq"]) for p in json.loads(offline.stdout)["problems"]
    ] == [("bob", "erased", 3)]


# -- which users an export covers -------------------------------------------------------------


async def _two_trails(tmp_path: Path) -> tuple[SqliteAuditStore, list[ChainHead]]:
    store = SqliteAuditStore(tmp_path / "audit.db")
    for i in range(3):
        await store.append(
            [
                AuditRecord(user_id=user, actor="agent:a", action="tool.call", payload={"i": i})
                for user in ("alice", "bob", None)
            ]
        )
    return store, (await store.verify()).heads  # every user's head, as `verify --json` saves


async def test_an_export_of_one_user_is_checked_as_the_user_the_caller_names(
    tmp_path: Path,
) -> None:
    store, heads = await _two_trails(tmp_path)
    try:
        alice = [line async for line in _lines(store, user_id="alice")]
        anonymous = [line async for line in _lines(store, user_id=None)]
        everyone = [line async for line in _lines(store)]
    finally:
        await store.close()
    # Its first line says whose it is; --user (user_id=) says whose it is checked as.
    assert json.loads(alice[0]) == {"filters": {"user_id": "alice"}, "loomflow_audit_export": 1}
    report = verify_lines(alice, heads=heads, user_id="alice")
    assert report.ok, report.problems
    assert (report.users, report.entries) == (1, 3)
    assert report.export_filters == {"user_id": "alice"}
    assert [h.user_id for h in report.heads] == ["alice"]
    assert report.warnings == []
    assert verify_lines(anonymous, heads=heads, user_id=None).ok  # the anonymous bucket too
    # Not weakened: alice's trail cut short is still truncated...
    short = verify_lines(alice[:-1], heads=heads, user_id="alice")
    assert [(p.user_id, p.kind, p.seq) for p in short.problems] == [("alice", "truncated", 3)]
    # ...an export of everyone (no header) still misses nobody...
    assert everyone[0].startswith('{"action"')
    assert verify_lines(everyone, heads=heads).ok
    without_bob = [line for line in everyone if json.loads(line)["user_id"] != "bob"]
    assert [(p.user_id, p.kind) for p in verify_lines(without_bob, heads=heads).problems] == [
        ("bob", "truncated")
    ]
    # ...and an export whose header was taken away is still alice's when checked as hers.
    assert verify_lines(alice[1:], heads=heads, user_id="alice").ok


async def test_without_a_user_an_export_is_the_whole_log_whatever_its_header_says(
    tmp_path: Path,
) -> None:
    store, heads = await _two_trails(tmp_path)
    try:
        alice = [line async for line in _lines(store, user_id="alice")]
        anonymous = [line async for line in _lines(store, user_id=None)]
    finally:
        await store.close()
    # A real export of alice alone, checked without --user: everyone else with a saved head is
    # missing from it, and a warning says how to check it as alice's.
    report = verify_lines(alice, heads=heads)
    assert [(p.user_id, p.kind, p.seq, p.position) for p in report.problems] == [
        ("bob", "truncated", 1, None),
        (None, "truncated", 1, None),
    ]
    assert report.problems[0].detail == (
        "the export holds none of this user's entries, though a saved head records seq 3"
    )
    assert [w.to_json() for w in report.warnings] == [
        {
            "user_id": "alice",
            "kind": "unscoped",
            "seq": None,
            "position": 1,
            "detail": 'the export says it holds only the trail of "alice", but without --user it '
            'is checked as the whole log: pass --user "alice" to check it alone',
        }
    ]
    assert report.export_filters == {"user_id": "alice"}
    [hint] = verify_lines(["", *anonymous], heads=heads).warnings  # after a blank line
    assert (hint.user_id, hint.position) == (None, 2)
    assert hint.detail == (
        "the export says it holds only the anonymous bucket's trail, but without --anonymous it "
        "is checked as the whole log: pass --anonymous to check it alone"
    )
    # Without heads nothing is looked for, but the hint stands.
    assert verify_lines(alice).ok
    assert [w.kind for w in verify_lines(alice).warnings] == ["unscoped"]


async def test_a_header_added_to_a_whole_log_export_hides_no_deleted_trail(
    tmp_path: Path,
) -> None:
    # The review's finding: heads saved, the whole log exported, one user's lines deleted,
    # and a header line naming another user added. No hash covers that line.
    store, heads = await _two_trails(tmp_path)
    try:
        everyone = [line async for line in _lines(store)]
    finally:
        await store.close()
    header = '{"filters":{"user_id":"alice"},"loomflow_audit_export":1}'
    without_bob = [line for line in everyone if json.loads(line)["user_id"] != "bob"]
    report = verify_lines([header, *without_bob], heads=heads)
    assert not report.ok
    assert [(p.user_id, p.kind, p.position) for p in report.problems] == [
        ("bob", "truncated", None),
        (None, "outside_export", 3),  # the anonymous bucket's lines are not alice's
    ]
    assert report.problems[1].detail == (
        'entry 1 is outside the export: its header says user_id "alice" (as are 2 more lines of '
        "this user)"
    )
    # The header made consistent with the lines (alice's alone): the others are missing.
    only_alice = [line for line in everyone if json.loads(line)["user_id"] == "alice"]
    assert [
        (p.user_id, p.kind) for p in verify_lines([header, *only_alice], heads=heads).problems
    ] == [
        ("bob", "truncated"),
        (None, "truncated"),
    ]
    # With --user alice the operator says the export is alice's: then it is checked as hers.
    assert verify_lines([header, *only_alice], heads=heads, user_id="alice").ok


async def test_with_a_user_other_users_lines_are_outside_the_export(tmp_path: Path) -> None:
    store, heads = await _two_trails(tmp_path)
    try:
        everyone = [line async for line in _lines(store)]
    finally:
        await store.close()
    report = verify_lines(everyone, heads=heads, user_id="bob")
    assert (report.users, report.entries) == (1, 3)  # only bob's lines are checked
    assert [(p.user_id, p.kind, p.seq, p.position) for p in report.problems] == [
        ("alice", "outside_export", 1, 1),
        (None, "outside_export", 1, 3),
    ]
    assert report.problems[0].detail == (
        'entry 1 is outside the export: it is checked as the trail of "bob" alone (--user "bob") '
        "(as are 2 more lines of this user)"
    )
    [bob] = [line for line in everyone if json.loads(line)["user_id"] == "bob"][:1]
    anonymous = verify_lines([bob], user_id=None)
    assert [(p.user_id, p.kind) for p in anonymous.problems] == [("bob", "outside_export")]
    assert anonymous.problems[0].detail == (
        "entry 1 is outside the export: it is checked as the anonymous bucket's trail alone "
        "(--anonymous)"
    )


async def test_lines_that_contradict_the_header_are_outside_the_export(tmp_path: Path) -> None:
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        for i in range(4):
            await store.append(
                AuditRecord(
                    user_id="alice",
                    session_id=f"s-{i % 2}",
                    run_id="r-1",
                    actor="agent:a",
                    action="tool.call" if i % 2 else "model.call",
                    payload={"i": i},
                )
            )
            # SQLite's clock ticks in milliseconds: keep each entry's time its own so
            # that since/until cut between them.
            await asyncio.sleep(0.003)
        heads = (await store.verify()).heads
        lines = [line async for line in _lines(store, user_id="alice")]
    finally:
        await store.close()
    header, *entries = lines
    times = [json.loads(line)["time"] for line in entries]
    assert len(set(times)) == len(times), times

    def said(**filters: str) -> str:
        return json.dumps({"filters": {"user_id": "alice", **filters}, "loomflow_audit_export": 1})

    def outside(header: str) -> list[tuple[int | None, int | None, str]]:
        report = verify_lines([header, *entries], heads=heads, user_id="alice")
        assert {p.kind for p in report.problems} <= {"outside_export"}, report.problems
        return [(p.seq, p.position, p.detail) for p in report.problems]

    assert outside(header) == []
    assert outside(said(since=times[2])) == [
        (
            1,
            2,
            f'entry 1 is outside the export: its header says since "{times[2]}" (as is 1 '
            "more line of this user)",
        )
    ]
    assert outside(said(until=times[1])) == [
        (
            2,
            3,
            f'entry 2 is outside the export: its header says until "{times[1]}" (as are 2 '
            "more lines of this user)",
        )
    ]
    assert outside(said(session_id="s-1")) == [
        (
            1,
            2,
            'entry 1 is outside the export: its header says session_id "s-1" (as is 1 more '
            "line of this user)",
        )
    ]
    assert outside(said(action="tool.*")) == [
        (
            1,
            2,
            'entry 1 is outside the export: its header says action "tool.*" (as is 1 more '
            "line of this user)",
        )
    ]
    assert outside(said(run_id="r-2", action="model.call")) == [
        (
            1,
            2,
            'entry 1 is outside the export: its header says run_id "r-2" (as are 3 more '
            "lines of this user)",
        )
    ]
    # Several reasons for one line are all given, the operator's first.
    bobs = json.dumps(
        {"filters": {"action": "tool.*", "user_id": "bob"}, "loomflow_audit_export": 1}
    )
    report = verify_lines([bobs, *entries], heads=heads, user_id="carol")
    assert [(p.user_id, p.kind, p.position, p.detail) for p in report.problems] == [
        (
            "alice",
            "outside_export",
            2,
            'entry 1 is outside the export: it is checked as the trail of "carol" alone (--user '
            '"carol"); its header says action "tool.*"; its header says user_id "bob" (as are 3 '
            "more lines of this user)",
        )
    ]


@pytest.mark.parametrize(
    "filters",
    [
        {"user_id": "alice"},
        {"user_id": "alice", "since": dt.datetime(2000, 1, 1)},
        {"user_id": "alice", "since": dt.datetime(2000, 1, 1), "until": dt.datetime(2100, 1, 1)},
        {"action": "tool.*"},
        {"session_id": "s-1", "run_id": "r-1"},
        {"user_id": None, "action": "tool.call"},
    ],
)
async def test_a_real_export_never_contradicts_its_own_header(
    tmp_path: Path, filters: dict[str, object]
) -> None:
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        for i in range(3):
            await store.append(
                [
                    AuditRecord(
                        user_id=user,
                        session_id=f"s-{i}",
                        run_id=f"r-{i}",
                        actor="agent:a",
                        action=("tool.call", "tool.result", "model.call")[i],
                    )
                    for user in ("alice", None)
                ]
            )
        lines = [line async for line in _lines(store, **filters)]
    finally:
        await store.close()
    assert json.loads(lines[0])["filters"].keys() == filters.keys()
    report = verify_lines(lines, user_id=filters.get("user_id", ANY_USER))
    assert "outside_export" not in {p.kind for p in report.problems}, report.problems


@pytest.mark.parametrize(
    "header",
    [
        '{"filters":{"user_id":"alice"},"loomflow_audit_export":2}',
        '{"filters":{"user_id":"alice"},"loomflow_audit_export":1.0}',
        '{"filters":{"tenant":"t1","user_id":"alice"},"loomflow_audit_export":1}',
        '{"filters":{"user_id":7},"loomflow_audit_export":1}',
        '{"filters":{"user_id":"alice"},"loomflow_audit_export":1,"signed":true}',
        '{"filters":["alice"],"loomflow_audit_export":1}',
        # Values no export is made with: ids --user refuses, times not spelled as exported.
        '{"filters":{"user_id":""},"loomflow_audit_export":1}',
        '{"filters":{"user_id":"al\\u0000ice"},"loomflow_audit_export":1}',
        '{"filters":{"user_id":"\\ud800"},"loomflow_audit_export":1}',
        '{"filters":{"session_id":"' + "s" * 257 + '"},"loomflow_audit_export":1}',
        '{"filters":{"action":""},"loomflow_audit_export":1}',
        '{"filters":{"since":"2026-05-01"},"loomflow_audit_export":1}',
        '{"filters":{"until":"2026-05-01T00:00:00.5Z"},"loomflow_audit_export":1}',
    ],
)
async def test_a_header_this_loomflow_cannot_read_is_unreadable(
    tmp_path: Path, header: str
) -> None:
    store, heads = await _two_trails(tmp_path)
    try:
        alice = [line async for line in _lines(store, user_id="alice")]
    finally:
        await store.close()
    report = verify_lines([header, *alice[1:]], heads=heads)
    assert [(p.user_id, p.kind, p.position) for p in report.problems] == [
        (None, "unreadable", 1),
        ("bob", "truncated", None),
        (None, "truncated", None),
    ]
    assert "not an export header this loomflow reads" in report.problems[0].detail
    assert report.export_filters is None


async def test_a_header_anywhere_but_first_is_not_an_entry(tmp_path: Path) -> None:
    store, heads = await _two_trails(tmp_path)
    try:
        alice = [line async for line in _lines(store, user_id="alice")]
    finally:
        await store.close()
    report = verify_lines([alice[1], alice[0], *alice[2:]], heads=heads)
    assert (None, "unreadable", 2) in [(p.user_id, p.kind, p.position) for p in report.problems]
    assert ("bob", "truncated") in [(p.user_id, p.kind) for p in report.problems]


async def _lines(store: SqliteAuditStore, **filters: object) -> AsyncIterator[str]:
    out = io.StringIO()
    await store.export(out, **filters)
    for line in out.getvalue().splitlines():
        yield line


async def test_the_documented_workflow_passes_with_several_users(tmp_path: Path) -> None:
    # README and docs/audit.md: heads of every user saved, one user's trail exported later
    # and checked as that user's (--user), or the anonymous bucket's (--anonymous).
    store, _ = await _two_trails(tmp_path)
    await store.close()
    url = f"sqlite:///{tmp_path / 'audit.db'}"
    heads = tmp_path / "heads.json"
    saved = _cli("--audit-url", url, "verify", "--json")
    assert saved.returncode == 0
    heads.write_text(saved.stdout)
    assert len(json.loads(saved.stdout)["heads"]) == 3
    alice = tmp_path / "alice.jsonl"
    assert _cli("--audit-url", url, "export", "--user", "alice", "-o", str(alice)).returncode == 0
    done = _cli("verify", "--file", str(alice), "--heads", str(heads), "--user", "alice")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "OK: checked 3 entries of 1 user(s)",
        "the export says it was made with user_id='alice'",
    ]
    anonymous = tmp_path / "anonymous.jsonl"
    assert _cli("--audit-url", url, "export", "--anonymous", "-o", str(anonymous)).returncode == 0
    done = _cli("verify", "--file", str(anonymous), "--heads", str(heads), "--anonymous")
    assert done.returncode == 0, done.stdout + done.stderr
    # Without --user the export is checked as the whole log, and the output says what to pass.
    done = _cli("verify", "--file", str(alice), "--heads", str(heads))
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[:2] == [
        "FAILED: 2 problem(s): checked 3 entries of 1 user(s)",
        "the export says it was made with user_id='alice'",
    ]
    [hint] = [line for line in lines if line.startswith("warning")]
    assert hint.split()[1:4] == ["alice", "unscoped", "-"]
    assert hint.endswith('pass --user "alice" to check it alone')
    # --user and --anonymous are one choice; --anonymous works on the store too.
    assert _cli("verify", "--file", str(alice), "--user", "a", "--anonymous").returncode == 2
    on_store = _cli("--audit-url", url, "verify", "--anonymous", "--json")
    assert on_store.returncode == 0, on_store.stderr
    assert [h["user_id"] for h in json.loads(on_store.stdout)["heads"]] == [None]


async def test_a_user_whom_no_saved_head_covers_is_warned_of(tmp_path: Path) -> None:
    # Heads saved from another log (or with a user's head cut out of the file) named none of
    # the export's users, and the export passed without a word that no head had vouched for it.
    lines, heads = await _export(tmp_path, user_id="alice")
    other = [ChainHead("carol", 3, "c" * 64)]
    for saved, user in ((other, "alice"), (other, ANY_USER), ([heads[1]], "alice")):
        report = verify_lines(lines, heads=saved, user_id=user)
        if user is ANY_USER:  # the whole log: carol's trail is gone
            assert [(p.user_id, p.kind) for p in report.problems] == [("carol", "truncated")]
        else:
            assert report.ok, report.problems  # nothing found wrong: warned of, as past a head
        [warning] = [w for w in report.warnings if w.kind == "unanchored"]
        assert (warning.user_id, warning.seq, warning.position) == ("alice", 1, None)
        assert warning.detail == "entries 1-6: no saved head covers this user's trail"
    # Without heads, nothing is said of them.
    assert verify_lines(lines, user_id="alice").warnings == []
