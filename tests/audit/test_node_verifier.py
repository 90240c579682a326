"""The Node verifier (tools/verify-audit-export.mjs) re-checks real exports without Python.

It runs under the real ``node`` after ``npm ci`` of tools/package.json into a temporary copy;
under ``CI=true`` a missing node or npm fails these tests rather than skipping them.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rfc8785

from loomflow.audit import (
    ANY_USER,
    AuditEntry,
    AuditRecord,
    SqliteAuditStore,
    heads_from_json,
    verify_lines,
)
from loomflow.audit._entry import canonical_json, user_key

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"

PAYLOAD: dict[str, Any] = {
    "\uffff": "last by code point",
    "\U0001f600": "first by UTF-16 unit",
    "big": 1e20,
    "huge": 1e21,
    "negzero": -0.0,
    "tiny": 1.5e-07,
    "denormal": 5e-324,
    "max": 1.7976931348623157e308,
    "whole": 5.0,
    "sep": "a\u2028b\u2029c",
    "ctl": "\x00\x1f\x7f",
    "past_2_53": 2**64,  # stored as "18446744073709551616"
    "nested": [{"z": None, "a": [True, False, 0.1, -1e-7]}],
}


def _need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        message = f"{tool} is not installed (.ci/run installs nodejs and npm with apt)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def verifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tools/ copied to a temporary folder with its pinned dependencies installed."""
    _need("node")
    npm = _need("npm")
    here = tmp_path_factory.mktemp("tools")
    for name in ("package.json", "package-lock.json", "verify-audit-export.mjs"):
        shutil.copy(TOOLS / name, here / name)
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=here,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return here / "verify-audit-export.mjs"


def _node(script: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_need("node"), str(script), *map(str, args)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
    )


async def _export(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A real SQLite trail of three users, exported, with its heads saved beside it."""
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        for i in range(4):
            await store._write(
                [
                    AuditRecord(
                        user_id=user,
                        session_id="s-1",
                        actor="agent:refunds",
                        action="tool.call",
                        payload=PAYLOAD | {"i": i},
                    )
                    for user in ("alice@example.com", None, "\U0001f600-user")
                ]
            )
        export = tmp_path / "export.jsonl"
        assert await store.export(export) == 12
        heads = tmp_path / "heads.json"
        report = await store.verify()
        assert report.ok
        heads.write_text(json.dumps(report.to_json()), encoding="utf-8")
    finally:
        await store.close()
    return export, heads, export.read_text(encoding="utf-8").splitlines()


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


async def test_node_accepts_a_real_export_and_its_heads(verifier: Path, tmp_path: Path) -> None:
    export, heads, lines = await _export(tmp_path)
    assert all(json.loads(line)["hash_version"] == 3 for line in lines)
    done = _node(verifier, export, heads)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == (
        "ok: 12 entries of 3 users, 12 re-hashed (RFC 8785), 3 users' saved heads, 0 problems"
    )


async def test_node_accepts_an_entry_holding_a_long_text(verifier: Path, tmp_path: Path) -> None:
    # A payload text of some megabytes (a document a tool read) overflowed the stack of the
    # regular expression that found where a string ends: the intact entry was "unreadable:
    # Maximum call stack size exceeded", though verify --file passes it.
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        await store._write(
            [
                AuditRecord(user_id="alice", actor="a", action="tool.result", payload={"i": 0}),
                AuditRecord(
                    user_id="alice",
                    actor="a",
                    action="tool.result",
                    payload={"text": "x" * 10_000_000 + '"\\ \n', "quoted": '\\"' * 9},
                ),
            ]
        )
        export = tmp_path / "export.jsonl"
        await store.export(export)
        heads = tmp_path / "heads.json"
        heads.write_text(json.dumps((await store.verify()).to_json()))
    finally:
        await store.close()
    with export.open(encoding="utf-8") as fh:
        assert verify_lines(fh).ok
    done = await asyncio.to_thread(_node, verifier, export, heads)
    assert done.returncode == 0, done.stdout[-500:] + done.stderr[-500:]
    assert done.stdout.splitlines()[-1] == (
        "ok: 2 entries of 1 users, 2 re-hashed (RFC 8785), 1 users' saved heads, 0 problems"
    )


async def test_node_finds_an_edited_entry(verifier: Path, tmp_path: Path) -> None:
    _, heads, lines = await _export(tmp_path)
    target = next(
        i for i, line in enumerate(lines) if '"seq":3,' in line and '"user_id":null' in line
    )
    data = json.loads(lines[target])
    data["payload"]["tiny"] = 1.5e-06  # one digit of one number
    lines[target] = canonical_json(data)
    done = _node(verifier, _write(tmp_path / "edited.jsonl", lines), heads)
    assert done.returncode == 1
    assert f"problem  line {target + 1}: user null: edited: entry 3 was changed" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("FAILED:")


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        ("drop", "missing: entry 2 is missing before entry 3: deleted"),
        ("relink", "edited: entry 3 was changed"),
        ("truncate", "truncated: entry 4 is missing at the end: a saved head records seq 4"),
        ("version", "edited: entry 1 was changed: its content cannot be hashed (unknown audit"),
    ],
)
async def test_node_finds_deletions_relinks_truncation_and_unknown_versions(
    verifier: Path, tmp_path: Path, tamper: str, expected: str
) -> None:
    _, heads, lines = await _export(tmp_path)
    alice = [i for i, line in enumerate(lines) if '"user_id":"alice@example.com"' in line]
    if tamper == "drop":
        del lines[alice[1]]
    elif tamper == "relink":
        data = json.loads(lines[alice[2]]) | {"prev_hash": "0" * 64}
        lines[alice[2]] = canonical_json(data)
    elif tamper == "truncate":
        del lines[alice[3]]
    else:
        lines[alice[0]] = canonical_json(json.loads(lines[alice[0]]) | {"hash_version": 4})
    done = _node(verifier, _write(tmp_path / "tampered.jsonl", lines), heads)
    assert done.returncode == 1, done.stdout
    assert expected in done.stdout


async def test_node_reads_numbers_as_written_and_each_users_lines_in_seq_order(
    verifier: Path, tmp_path: Path
) -> None:
    # As `verify --file` does: "seq": 4.0 is not the entry its writer hashed, and two lines
    # swapped are out of order, not a deleted entry plus a duplicate.
    _, heads, lines = await _export(tmp_path)
    alice = [i for i, line in enumerate(lines) if '"user_id":"alice@example.com"' in line]
    spelled = list(lines)
    spelled[alice[3]] = spelled[alice[3]].replace('"seq":4,', '"seq":4.0,')
    done = _node(verifier, _write(tmp_path / "spelled.jsonl", spelled))
    assert done.returncode == 1, done.stdout
    assert f"problem  line {alice[3] + 1}: user ?: unreadable: not an audit entry: seq" in (
        done.stdout
    )
    swapped = list(lines)
    swapped[alice[1]], swapped[alice[2]] = swapped[alice[2]], swapped[alice[1]]
    done = _node(verifier, _write(tmp_path / "swapped.jsonl", swapped), heads)
    assert done.returncode == 1, done.stdout
    problems = [line for line in done.stdout.splitlines() if line.startswith("problem")]
    assert problems == [
        f'problem  line {alice[1] + 1}: user "alice@example.com": reordered: entry 3 is stored '
        f"at {alice[1] + 1}, before entry 2 (at {alice[2] + 1}): the trail was reordered"
    ]


async def test_node_checks_an_export_of_one_user_against_every_users_heads(
    verifier: Path, tmp_path: Path
) -> None:
    # README: `verify --json > heads.json` (every user), then one user's export, checked as
    # that user's with --user.
    _, heads, _ = await _export(tmp_path)
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        alice = tmp_path / "alice.jsonl"
        assert await store.export(alice, user_id="alice@example.com") == 4
    finally:
        await store.close()
    done = _node(verifier, "--user", "alice@example.com", alice, heads)
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines() == [
        'note     the export says it was made with user_id="alice@example.com"',
        "ok: 4 entries of 1 users, 4 re-hashed (RFC 8785), 1 users' saved heads, 0 problems",
    ]
    # Without --user it is the whole log, whatever its header says, and a warning says so.
    done = _node(verifier, alice, heads)
    assert done.returncode == 1
    assert "user null: truncated: the export holds none of this user's entries" in done.stdout
    assert (
        'warning  line 1: user "alice@example.com": unscoped: the export says it holds only the '
        'trail of "alice@example.com", but without --user it is checked as the whole log: pass '
        '--user "alice@example.com" to check it alone'
    ) in done.stdout.splitlines()
    header, *entries = alice.read_text(encoding="utf-8").splitlines()
    # Still truncated when alice's own trail is cut short...
    short = _write(tmp_path / "short.jsonl", [header, *entries[:-1]])
    done = _node(verifier, "--user", "alice@example.com", short, heads)
    assert done.returncode == 1
    assert 'user "alice@example.com": truncated: entry 4 is missing at the end' in done.stdout
    # ...and an export made before headers is checked as alice's the same way.
    bare = _write(tmp_path / "bare.jsonl", entries)
    assert _node(verifier, "--user", "alice@example.com", bare, heads).returncode == 0
    done = _node(verifier, "--user", "a", "--anonymous", bare)
    assert done.returncode == 2
    assert "one of --user and --anonymous" in done.stderr


def test_node_links_version_1_entries_but_cannot_rehash_them(
    verifier: Path, tmp_path: Path
) -> None:
    entries: list[AuditEntry] = []
    for seq in (1, 2):
        draft = AuditEntry(
            user_id="old",
            seq=seq,
            time_us=1_700_000_000_000_000,
            actor="a",
            action="x",
            payload={"tiny": 1.5e-07},
            prev_hash=entries[-1].hash if entries else "0" * 64,
            hash="",
        )
        entries.append(draft.model_copy(update={"hash": draft.computed_hash()}))
    record = AuditRecord(user_id="old", actor="a", action="x", payload=PAYLOAD).checked()
    entries.append(AuditEntry.seal(record, seq=3, time_us=1, prev_hash=entries[-1].hash))
    export = _write(tmp_path / "mixed.jsonl", [e.to_line() for e in entries])
    done = _node(verifier, export)
    assert done.returncode == 0, done.stdout
    assert "1 re-hashed (RFC 8785); 2 hash version 1 entries linked but not re-hashed" in (
        done.stdout
    )
    assert _node(verifier, "--require-v2", export).returncode == 1


async def test_node_fails_an_entry_relabelled_as_version_1_after_newer_ones(
    verifier: Path, tmp_path: Path
) -> None:
    """A version 3 entry relabelled as version 1, its payload edited, its hash kept: the Node
    verifier cannot re-hash version 1, so it followed the links and said ok."""
    _export_path, _heads, lines = await _export(tmp_path)
    i = _at(lines, "alice@example.com", 3)
    forged = json.loads(lines[i])
    for field in ("hash_version", "payload_digest", "payload_salt"):
        del forged[field]
    forged["payload"] = {"refund": "approved by nobody"}
    lines[i] = canonical_json(forged)
    export = _write(tmp_path / "relabelled.jsonl", lines)
    python = verify_lines(lines).to_json()
    assert [(p["kind"], p["seq"]) for p in python["problems"]] == [("edited", 3)]
    done = _node(verifier, "--json", export)
    assert done.returncode == 1, done.stdout + done.stderr
    found = json.loads(done.stdout)["problems"]
    assert [(p["user_id"], p["kind"], p["seq"], p["position"]) for p in found] == [
        ("alice@example.com", "version_1", 3, i + 1)
    ]
    assert "after entry 2 of hash version 3" in found[0]["detail"]


def test_heads_saved_from_an_empty_log_anchor_nobody_and_say_so(
    verifier: Path, tmp_path: Path
) -> None:
    """`verify --json` run on an empty log (a wrong URL on the cron host) saves no head: an
    export checked against that file passed with no word that nothing anchored it."""
    export, _heads, _lines = asyncio.run(_export(tmp_path))
    empty = tmp_path / "heads-empty.json"
    empty.write_text('{"ok": true, "heads": []}', encoding="utf-8")
    command = ["audit", "verify", "--json", "--file", str(export), "--heads", str(empty)]
    cli = subprocess.run(
        [sys.executable, "-m", "loomflow", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr  # a warning, not a failure
    python = json.loads(cli.stdout)
    unanchored = [(w["user_id"], w["kind"], w["seq"]) for w in python["warnings"]]
    assert sorted(unanchored, key=str) == sorted(
        [(u, "unanchored", 1) for u in ("alice@example.com", None, "\U0001f600-user")], key=str
    )
    done = _node(verifier, "--json", export, empty)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _findings(json.loads(done.stdout)) == _findings(python)


def test_node_agrees_with_the_documented_test_vectors(verifier: Path, tmp_path: Path) -> None:
    section = (ROOT / "docs" / "audit.md").read_text(encoding="utf-8")
    section = section.split("<!-- audit-vectors:start -->")[1]
    section = section.split("<!-- audit-vectors:end -->")[0]
    lines = re.findall(r"^\{.*\"hash\":.*\}$", section, flags=re.MULTILINE)
    assert len(lines) >= 3
    done = _node(verifier, _write(tmp_path / "vectors.jsonl", lines))
    assert done.returncode == 0, done.stdout
    assert f"{len(lines)} re-hashed (RFC 8785)" in done.stdout


def test_node_reports_an_unreadable_export_with_status_2(verifier: Path, tmp_path: Path) -> None:
    done = _node(verifier, tmp_path / "absent.jsonl")
    assert done.returncode == 2
    assert "cannot read" in done.stderr


def test_node_agrees_with_the_version_3_vectors(verifier: Path, tmp_path: Path) -> None:
    section = (ROOT / "docs" / "audit.md").read_text(encoding="utf-8")
    section = section.split("<!-- audit-vectors-v3:start -->")[1]
    section = section.split("<!-- audit-vectors-v3:end -->")[0]
    lines = re.findall(r"^\{.*\"hash\":.*\}$", section, flags=re.MULTILINE)
    assert len(lines) == 3
    done = _node(verifier, _write(tmp_path / "v3.jsonl", lines))
    assert done.returncode == 0, done.stdout
    assert "3 re-hashed (RFC 8785), 1 payloads erased" in done.stdout
    # The erased entry without the record after it: an unauthorised erasure.
    done = _node(verifier, _write(tmp_path / "cut.jsonl", lines[:2]))
    assert done.returncode == 1
    assert "the payload of entry 2 is gone, but no erasure record follows it" in done.stdout


async def _erased_export(tmp_path: Path) -> tuple[Path, list[str]]:
    """A SQLite trail whose first two entries are hash version 2, then a forget of the user."""
    store = SqliteAuditStore(tmp_path / "erased.db")
    try:
        await store.open()
        old = []
        for seq in (1, 2):
            record = AuditRecord(
                user_id="ana", actor="a", action="tool.call", payload={"email": f"a{seq}@x.io"}
            ).checked()
            prev = old[-1].hash if old else "0" * 64
            old.append(
                AuditEntry.seal(record, seq=seq, time_us=seq, prev_hash=prev, hash_version=2)
            )
        for e in old:
            await store.db.fetch(
                "INSERT INTO loom_audit (user_key, user_id, seq, time_us, session_id, run_id, "
                "actor, action, payload, schema_version, prev_hash, hash, hash_version) "
                "VALUES ($1, $2, $3, $4, NULL, NULL, $5, $6, $7, 1, $8, $9, 2)",
                '"ana"',
                e.user_id,
                e.seq,
                e.time_us,
                e.actor,
                e.action,
                canonical_json(e.payload),
                e.prev_hash,
                e.hash,
            )
        await store._write(
            AuditRecord(user_id="ana", actor="a", action="tool.result", payload=PAYLOAD)
        )
        await store.erase("ana", reason="forget")
        assert (await store.verify()).ok
        export = tmp_path / "erased.jsonl"
        await store.export(export)
    finally:
        await store.close()
    return export, export.read_text(encoding="utf-8").splitlines()


async def test_node_accepts_erased_payloads_of_every_version(
    verifier: Path, tmp_path: Path
) -> None:
    export, _ = await _erased_export(tmp_path)
    assert "a1@x.io" not in export.read_text(encoding="utf-8")
    done = _node(verifier, export)
    assert done.returncode == 0, done.stdout
    assert "3 payloads erased" in done.stdout


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        ("relabel", "entry 1 was changed after its payload was erased"),
        ("unrecorded", "no erasure record follows it"),
        ("payload", "entry 4 was changed: its payload no longer matches its digest"),
    ],
)
async def test_node_finds_tampering_around_erasure(
    verifier: Path, tmp_path: Path, tamper: str, expected: str
) -> None:
    _, lines = await _erased_export(tmp_path)
    if tamper == "relabel":  # an erased version 2 entry's action rewritten
        lines[0] = canonical_json(json.loads(lines[0]) | {"action": "tool.replay"})
    elif tamper == "unrecorded":  # the erasure record dropped from the end
        lines = lines[:-1]
    else:
        data = json.loads(lines[3])
        data["payload"]["reason"] = "retention"
        lines[3] = canonical_json(data)
    done = _node(verifier, _write(tmp_path / "t.jsonl", lines))
    assert done.returncode == 1, done.stdout
    assert expected in done.stdout


# -- the Node verifier reports what `verify --file` reports ------------------------------------

Lines = list[str]


@pytest.fixture(scope="module")
def trail(tmp_path_factory: pytest.TempPathFactory) -> tuple[Lines, Path]:
    """A real SQLite trail exported whole: alice (hash version 3), the anonymous bucket, and
    ana, whose two hash version 2 entries and one version 3 entry were then forgotten; with
    the heads saved after it."""
    here = tmp_path_factory.mktemp("differential")

    async def build() -> Lines:
        export, _ = await _erased_export(here)  # ana: 2 x v2, 1 x v3, then the record
        store = SqliteAuditStore(here / "erased.db")
        try:
            for i in range(5):
                await store._write(
                    [
                        AuditRecord(
                            user_id=u, actor="agent:a", action="tool.call", payload={"i": i}
                        )
                        for u in ("alice@example.com", None)
                    ]
                )
                await _tick()
            # bob: a retention whose cut-off takes entries 1-2, not 3.
            bob = []
            for _ in range(3):
                bob += await store._write(AuditRecord(user_id="bob", actor="a", action="x"))
                await _tick()
            await store.erase("bob", reason="retention", before=bob[2].time)
            # dee: a note of a deletion, which an erasure keeps, then a retention.
            note = {"store": "journal", "deleted": 3}
            await store._write(
                AuditRecord(user_id="dee", actor="a", action="audit.deletion", payload=note)
            )
            dee = (await store._write(AuditRecord(user_id="dee", actor="a", action="x")))[0]
            await _tick()  # the cut-off falls after both
            await store.erase("dee", reason="retention", before=dee.time + dt.timedelta(0, 0, 1))
            # console:ops: a forget's erasure of two looks, by seq.
            await store._write(
                [AuditRecord(user_id="console:ops", actor="a", action="x") for _ in range(4)]
            )
            await store.erase_entries("console:ops", [2, 3], reason="forget")
            # cy: a record written after a hold was placed, which erased nothing.
            await store._write(AuditRecord(user_id="cy", actor="a", action="x"))
            await store.place_hold("cy", reason="subpoena")
            payload = {"reason": "forget", "before": None, "entries": 1, "pre_v3": {}}
            await store._write(
                AuditRecord(user_id="cy", actor="a", action="audit.erasure", payload=payload)
            )
            await store.export(export)
            (here / "heads.json").write_text(json.dumps((await store.verify()).to_json()))
        finally:
            await store.close()
        return export.read_text(encoding="utf-8").splitlines()

    return asyncio.run(build()), here / "heads.json"


async def _tick() -> None:
    """SQLite's clock ticks in milliseconds: this gives the next entry a time of its own,
    so that a since, an until or a retention's cut-off can fall between the two."""
    await asyncio.sleep(0.003)


def _at(lines: Lines, user: str | None, seq: int) -> int:
    return next(
        i
        for i, line in enumerate(lines)
        if json.loads(line)["user_id"] == user and json.loads(line)["seq"] == seq
    )


def _set(lines: Lines, user: str | None, seq: int, /, **fields: Any) -> Lines:
    i = _at(lines, user, seq)
    return [*lines[:i], canonical_json(json.loads(lines[i]) | fields), *lines[i + 1 :]]


def _rehashed(lines: Lines, user: str | None, seq: int, /, **fields: Any) -> Lines:
    """Set fields and re-hash the line, as someone rewriting the storage would."""
    i = _at(lines, user, seq)
    entry = AuditEntry.from_line(canonical_json(json.loads(lines[i]) | fields))
    return [*lines[:i], entry.model_copy(update={"hash": entry.computed_hash()}).to_line(),
            *lines[i + 1 :]]  # fmt: skip


def _raw(lines: Lines, user: str | None, seq: int, old: str, new: str) -> Lines:
    """Edit a line's text as it is spelled (numbers as written, NaN)."""
    i = _at(lines, user, seq)
    assert old in lines[i]
    return [*lines[:i], lines[i].replace(old, new, 1), *lines[i + 1 :]]


def _blanked(lines: Lines, user: str | None, seq: int) -> Lines:
    return _set(lines, user, seq, payload=None, payload_salt=None)


def _rounded(lines: Lines, user: str | None, seq: int) -> Lines:
    """A payload integer past 2**53 - 1 (written exactly), with the digest and hash that a
    JavaScript reader computes, over the double JSON.parse rounds it to."""
    i = _at(lines, user, seq)
    data = json.loads(lines[i])
    big = 2**53 + 1
    salted = {"payload": {"i": float(big)}, "salt": data["payload_salt"]}
    data |= {"payload": {"i": big}, "payload_digest": _sha256(rfc8785.dumps(salted))}
    body = {k: v for k, v in data.items() if k not in ("hash", "payload", "payload_salt")}
    data["hash"] = _sha256(rfc8785.dumps(body))
    return [*lines[:i], canonical_json(data), *lines[i + 1 :]]


def _nested(depth: int) -> str:
    """Lists ``depth`` deep (inside the line's object and its payload's)."""
    return "[" * depth + "]" * depth


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _header(user: str | None) -> str:
    """The first line of ``loomflow audit export --user USER``."""
    return canonical_json({"filters": {"user_id": user}, "loomflow_audit_export": 1})


def _only(lines: Lines, user: str | None, *, header: bool) -> Lines:
    mine = [line for line in lines if json.loads(line)["user_id"] == user]
    return [_header(user), *mine] if header else mine


def _said(lines: Lines, user: str | None, /, **filters: str) -> Lines:
    """A user's lines under a header naming ``filters`` besides the user."""
    header = {"filters": {"user_id": user, **filters}, "loomflow_audit_export": 1}
    return [canonical_json(header), *_only(lines, user, header=False)]


def _time(lines: Lines, user: str | None, seq: int) -> str:
    return str(json.loads(lines[_at(lines, user, seq)])["time"])


def _swap(lines: Lines, a: int, b: int) -> Lines:
    out = list(lines)
    out[a], out[b] = out[b], out[a]
    return out


A = "alice@example.com"
TAMPERS: dict[str, Any] = {
    "untouched": lambda ls: ls,
    "payload edited": lambda ls: _set(ls, A, 2, payload={"i": 99}),
    "line deleted": lambda ls: [x for i, x in enumerate(ls) if i != _at(ls, A, 3)],
    "lines swapped": lambda ls: _swap(ls, _at(ls, A, 2), _at(ls, A, 3)),
    "line moved to the end": lambda ls: [
        *(x for x in ls if x != ls[_at(ls, A, 2)]),
        ls[_at(ls, A, 2)],
    ],
    "tail dropped": lambda ls: [x for i, x in enumerate(ls) if i != _at(ls, A, 5)],
    "line repeated": lambda ls: [*ls, ls[_at(ls, None, 2)]],
    "garbage and blank lines": lambda ls: ["{not json", "", "   ", *ls, "[1, 2]", "null", '"x"'],
    "seq 4.0": lambda ls: _raw(ls, A, 4, '"seq":4,', '"seq":4.0,'),
    "seq 4e0": lambda ls: _raw(ls, A, 4, '"seq":4,', '"seq":4e0,'),
    "seq as text": lambda ls: _set(ls, A, 4, seq="4"),
    "seq 0": lambda ls: _set(ls, A, 1, seq=0),
    "seq past 2**53": lambda ls: _set(ls, A, 5, seq=2**53),
    "schema_version 1.0": lambda ls: _raw(ls, A, 2, '"schema_version":1,', '"schema_version":1.0,'),
    "hash_version 3.0": lambda ls: _raw(ls, A, 2, '"hash_version":3,', '"hash_version":3.0,'),
    "hash_version 4": lambda ls: _set(ls, A, 2, hash_version=4),
    "schema_version 2, re-hashed": lambda ls: _rehashed(ls, A, 5, schema_version=2),
    "an export of alice without its first lines": lambda ls: [
        x for x in _only(ls, A, header=True) if '"seq":1,' not in x and '"seq":2,' not in x
    ],
    "a page of alice after entry 2": lambda ls: [
        x for x in _said(ls, A, after_seq="2") if '"seq":1,' not in x and '"seq":2,' not in x
    ],
    "a page of alice after entry 2 holding entry 2": lambda ls: [
        x for x in _said(ls, A, after_seq="2") if '"seq":1,' not in x
    ],
    "a page after a seq that is no number": lambda ls: _said(ls, A, after_seq="2x"),
    "hash_version true": lambda ls: _set(ls, A, 2, hash_version=True),
    "a field no entry has": lambda ls: _set(ls, A, 2, note="x"),
    "payload a list": lambda ls: _set(ls, A, 2, payload=[1]),
    "no actor": lambda ls: [
        *(canonical_json({k: v for k, v in json.loads(x).items() if k != "actor"}) for x in ls[:1]),
        *ls[1:],
    ],
    "session_id left out": lambda ls: [
        canonical_json({k: v for k, v in json.loads(x).items() if k != "session_id"}) for x in ls
    ],
    "time spelled short": lambda ls: _set(
        ls, A, 2, time=json.loads(ls[_at(ls, A, 2)])["time"][:-5] + "Z"
    ),
    "time on 30 February": lambda ls: _set(ls, A, 2, time="2026-02-30T10:00:00.000000Z"),
    "time null": lambda ls: _set(ls, A, 2, time=None),
    "NaN in a payload": lambda ls: _raw(ls, A, 2, '"i":1', '"i":NaN'),
    # A key twice: JSON.parse and Python's json keep the last value (the one hashed here),
    # SQLite's json_extract and others the first, so the line is two entries at once.
    "a key twice in a line": lambda ls: _raw(
        ls, A, 2, '{"action":', '{"action":"tool.denied","action":'
    ),
    "a key twice in a payload": lambda ls: _raw(ls, A, 2, '"payload":{', '"payload":{"i":7,'),
    "a key twice deep in a payload": lambda ls: _raw(
        ls, "dee", 1, '"payload":{', '"payload":{"x":[{"k":1,"k":1}],'
    ),
    # JSON.parse rounds an integer past 2**53 - 1 (9007199254740993 reads as ...992), where
    # loomflow keeps it exact and cannot hash it: the Node verifier took the rounded value.
    "a payload integer past 2**53": lambda ls: _raw(
        ls, A, 2, '"i":1}', '"i":100000000000000000001}'
    ),
    "a payload integer past 2**53, hashed as rounded": lambda ls: _rounded(ls, A, 2),
    "schema_version past 2**53": lambda ls: _raw(
        ls, A, 2, '"schema_version":1,', '"schema_version":18446744073709551617,'
    ),
    "hash_version past 2**53": lambda ls: _raw(
        ls, A, 2, '"hash_version":3,', '"hash_version":18446744073709551617,'
    ),
    "an integer of more digits than Python reads": lambda ls: _raw(
        ls, A, 2, '"i":1}', '"i":' + "1" * 4301 + "}"
    ),
    # Text that is no Unicode: both name it in the same words, whichever codec met it.
    # Python's parser recurses (about 900 levels here), JavaScript's does not: both refuse
    # text nested more than MAX_JSON_DEPTH (256) deep, where Python alone found it unreadable.
    "a line nested 256 deep": lambda ls: _raw(ls, A, 2, '"i":1', '"i":' + _nested(254)),
    "a line nested 257 deep": lambda ls: _raw(ls, A, 2, '"i":1', '"i":' + _nested(255)),
    "a payload nested 990 deep": lambda ls: _raw(ls, A, 2, '"i":1', '"i":' + _nested(988)),
    "a payload nested 100000 deep": lambda ls: _raw(ls, A, 2, '"i":1', '"i":' + _nested(10**5)),
    "a lone surrogate in the actor": lambda ls: _raw(ls, A, 2, '"agent:a"', '"agent:\\ud800a"'),
    "a lone surrogate in a payload": lambda ls: _raw(ls, A, 2, '"i":1}', '"i":"\\udc00"}'),
    "a lone surrogate as a payload key": lambda ls: _raw(ls, A, 2, '"i":1}', '"\\udc00":1}'),
    "a number beyond a double in a payload": lambda ls: _raw(
        ls, A, 2, '"payload":{', '"payload":{"x":1e400,'
    ),
    "a header with a key twice": lambda ls: [
        _header(A).replace('{"user_id"', '{"user_id":"mallory","user_id"'),
        *_only(ls, A, header=False),
    ],
    "relinked": lambda ls: _set(ls, A, 3, prev_hash="0" * 64),
    "moved to another user": lambda ls: _set(ls, A, 3, user_id="mallory"),
    "payload blanked without a record": lambda ls: _blanked(ls, None, 2),
    "payload blanked past a retention cut-off": lambda ls: _blanked(ls, "bob", 3),
    "looks blanked outside the record's seqs": lambda ls: _blanked(
        _blanked(ls, "console:ops", 1), "console:ops", 4
    ),
    "payload blanked before a record made under a hold": lambda ls: _blanked(ls, "cy", 1),
    "a hold's reason blanked": lambda ls: _blanked(ls, "cy", 2),
    "a deletion note blanked": lambda ls: _blanked(ls, "dee", 1),
    "a record's payload blanked": lambda ls: _blanked(ls, "console:ops", 5),
    "erased v2 entry relabelled": lambda ls: _set(ls, "ana", 1, action="tool.replay"),
    "erasure record dropped": lambda ls: [x for i, x in enumerate(ls) if i != _at(ls, "ana", 4)],
    "digest of a v2 entry dropped from the record": lambda ls: _set(
        ls, "ana", 4, payload=json.loads(ls[_at(ls, "ana", 4)])["payload"] | {"pre_v3": {}}
    ),
    "v2 entry given a digest": lambda ls: _set(ls, "ana", 1, payload_digest="0" * 64),
    "v3 entry without its digest": lambda ls: _set(ls, A, 1, payload_digest=None),
    "v3 payload without its salt": lambda ls: _set(ls, A, 1, payload_salt=None),
    "an export of alice only": lambda ls: _only(ls, A, header=True),
    "an export of the anonymous bucket only": lambda ls: _only(ls, None, header=True),
    "alice's lines without their header": lambda ls: _only(ls, A, header=False),
    "an export of alice cut short": lambda ls: _only(ls, A, header=True)[:-1],
    "a header naming alice over everyone's lines": lambda ls: [_header(A), *ls],
    "a header of another format": lambda ls: [
        _header(A).replace('"loomflow_audit_export":1', '"loomflow_audit_export":2'),
        *_only(ls, A, header=False),
    ],
    "a header with format 1.0": lambda ls: [
        _header(A).replace('"loomflow_audit_export":1', '"loomflow_audit_export":1.0'),
        *_only(ls, A, header=False),
    ],
    "a header with an unknown filter": lambda ls: [
        _header(A).replace('{"user_id"', '{"tenant":"t","user_id"'),
        *_only(ls, A, header=False),
    ],
    "a header holding NaN": lambda ls: [
        _header(A).replace('"user_id":"alice@example.com"', '"user_id":NaN'),
        *_only(ls, A, header=False),
    ],
    "a header on the second line": lambda ls: [ls[0], _header(A), *ls[1:]],
    # A header is covered by no hash: added to a whole-log export from which a user's lines
    # were deleted, it must not hide them (the review's finding), nor narrow any check.
    "a header naming alice over a log missing a user": lambda ls: [
        _header(A),
        *(x for x in ls if json.loads(x)["user_id"] != "bob"),
    ],
    "a header naming alice over the anonymous bucket's lines": lambda ls: [
        _header(A),
        *_only(ls, None, header=False),
    ],
    "a header naming the anonymous bucket over alice's lines": lambda ls: [
        _header(None),
        *_only(ls, A, header=False),
    ],
    # Lines that contradict the header's filters.
    "a header whose since leaves out entries": lambda ls: _said(ls, A, since=_time(ls, A, 3)),
    "a header whose until leaves out entries": lambda ls: _said(ls, A, until=_time(ls, A, 4)),
    "a header naming another session": lambda ls: _said(ls, A, session_id="s-9"),
    "a header naming another run": lambda ls: _said(ls, A, run_id="r-9"),
    "a header naming another action family": lambda ls: _said(ls, A, action="model.*"),
    "a header naming the lines' action family": lambda ls: _said(ls, A, action="tool.*"),
    "a header naming the lines' own time range": lambda ls: _said(
        ls, A, since=_time(ls, A, 1), until="9999-12-31T23:59:59.999999Z"
    ),
    # Values no export is made with: the header is unreadable.
    "a header naming an empty user": lambda ls: [_header(""), *_only(ls, A, header=False)],
    "a header naming a user with a NUL": lambda ls: [
        _header(A).replace("alice@", "alice\\u0000@"),
        *_only(ls, A, header=False),
    ],
    "a header naming a lone surrogate": lambda ls: [
        _header(A).replace("alice@", "alice\\ud800@"),
        *_only(ls, A, header=False),
    ],
    "a header naming a session too long": lambda ls: _said(ls, A, session_id="é" * 129),
    "a header with a since not spelled as exported": lambda ls: _said(ls, A, since="2026-01-01"),
    # Times before the year 1000 are written with their zeros, and both verifiers read them:
    # the first is what `audit export --since 0001-01-01` writes.
    "a header whose since is in the year 1": lambda ls: _said(
        ls, A, since="0001-01-01T00:00:00.000000Z"
    ),
    "an entry of the year 999, re-hashed": lambda ls: _rehashed(
        ls, A, 3, time="0999-12-31T23:59:59.999999Z"
    ),
    "an entry of the year 0": lambda ls: _set(ls, A, 2, time="0000-12-31T23:59:59.999999Z"),
    "starts mid-trail": lambda ls: [
        x for x in ls if json.loads(x)["user_id"] != A or json.loads(x)["seq"] > 2
    ],
    "a user left out": lambda ls: [x for x in ls if json.loads(x)["user_id"] is not None],
    "rewritten past a saved head": lambda ls: _set(ls, A, 5, hash="f" * 64),
}


HARMLESS = ("untouched", "session_id left out")  # a missing session_id is null, as hashed


@pytest.mark.parametrize("user", [A, "bob", "nobody", None])
@pytest.mark.parametrize(
    "tamper",
    [
        "untouched",
        "an export of alice only",
        "alice's lines without their header",
        "an export of alice cut short",
        "an export of alice without its first lines",
        "a header naming alice over a log missing a user",
        "a header naming the anonymous bucket over alice's lines",
        "a header whose since leaves out entries",
    ],
)
def test_node_checks_one_named_user_as_python_does(
    verifier: Path, trail: tuple[Lines, Path], tmp_path: Path, tamper: str, user: str | None
) -> None:
    lines, heads_path = trail
    tampered = TAMPERS[tamper](list(lines))
    export = _write(tmp_path / "export.jsonl", tampered)
    heads = heads_from_json(json.loads(heads_path.read_text()))
    with export.open(encoding="utf-8") as fh:
        python = verify_lines(fh, heads=heads, user_id=user).to_json()
    option = ["--anonymous"] if user is None else ["--user", user]
    done = _node(verifier, "--json", *option, export, heads_path)
    assert done.returncode == (0 if python["ok"] else 1), done.stdout + done.stderr
    assert _findings(json.loads(done.stdout)) == _findings(python)
    # Only the named user's lines are checked; every other user's is outside the export.
    mine = [x for x in tampered if "seq" in json.loads(x) and json.loads(x)["user_id"] == user]
    others = {json.loads(x)["user_id"] for x in tampered if "seq" in json.loads(x)} - {user}
    assert (python["users"], python["entries"]) == (1 if mine else 0, len(mine))
    outside = {p["user_id"] for p in python["problems"] if p["kind"] == "outside_export"}
    assert others <= outside
    assert "unscoped" not in {w["kind"] for w in python["warnings"]}


def _findings(report: dict[str, Any]) -> dict[str, Any]:
    def rows(items: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        # Why a line is unreadable is worded by each parser; everything else is compared.
        return [
            (
                p["user_id"],
                p["kind"],
                p["seq"],
                p["position"],
                p["kind"] != "unreadable" and p["detail"],
            )
            for p in items
        ]

    return {
        "ok": report["ok"],
        "users": report["users"],
        "entries": report["entries"],
        "erased": report["erased"],
        "problems": rows(report["problems"]),
        "warnings": rows(report["warnings"]),
        "heads": report["heads"],
        "export_filters": report.get("export_filters"),
    }


@pytest.mark.parametrize("with_heads", [False, True], ids=["alone", "heads"])
@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_node_reports_what_python_reports(
    verifier: Path, trail: tuple[Lines, Path], tmp_path: Path, tamper: str, with_heads: bool
) -> None:
    lines, heads_path = trail
    tampered = TAMPERS[tamper](list(lines))
    export = _write(tmp_path / "export.jsonl", tampered)
    heads = heads_from_json(json.loads(heads_path.read_text())) if with_heads else None
    with export.open(encoding="utf-8") as fh:
        python = verify_lines(fh, heads=heads).to_json()
    done = _node(verifier, "--json", export, *([heads_path] if with_heads else []))
    assert done.returncode == (0 if python["ok"] else 1), done.stdout + done.stderr
    node = json.loads(done.stdout)
    assert _findings(node) == _findings(python)
    if with_heads:
        # Whatever a header says (no hash covers it), every user with a saved head and no
        # entry in the file is missing from it.
        present = set()
        for line in tampered:
            try:
                present.add(user_key(AuditEntry.from_line(line).user_id))
            except (ValueError, TypeError, KeyError, RecursionError):  # unreadable, the header
                continue
        absent = {user_key(h.user_id) for h in heads} - present
        truncated = {user_key(p["user_id"]) for p in python["problems"] if p["kind"] == "truncated"}
        assert absent <= truncated
    # Each tamper is seen, but for the two that change nothing loomflow hashes.
    untouched = verify_lines(lines, heads=heads).to_json()
    assert (_findings(python) == _findings(untouched)) == (tamper in HARMLESS)


def test_the_node_verifier_keeps_the_payloads_loomflow_keeps() -> None:
    """The Node verifier spells loomflow's list of actions whose payloads erasure leaves in
    place (a new kept action that it lacked would verify a blanked one as fine)."""
    from loomflow.audit.actions import KEPT_BY_ERASURE

    source = (TOOLS / "verify-audit-export.mjs").read_text(encoding="utf-8")
    for action in KEPT_BY_ERASURE:
        assert f"'{action}'" in source, action


async def test_node_reports_a_line_that_is_not_utf8_as_python_does(
    verifier: Path, tmp_path: Path
) -> None:
    # Node's 'utf8' stream read the byte as U+FFFD and called the line an edited entry;
    # loomflow (verify --file) stopped at it. Both now report it unreadable, where it is.
    export, heads, lines = await _export(tmp_path)
    raw = [line.encode("utf-8") for line in lines]
    at = _at(lines, A, 2)
    raw[at] = raw[at].replace(b'"agent:refunds"', b'"agent:\xc0\xafrefunds"', 1)
    raw.insert(0, b"\xef\xbb\xbf")  # a lone byte order mark is text: a line that is no entry
    export.write_bytes(b"".join(line + b"\n" for line in raw))
    with export.open(encoding="utf-8", errors="surrogateescape") as fh:
        python = verify_lines(fh, heads=heads_from_json(json.loads(heads.read_text()))).to_json()
    assert [(p["kind"], p["position"]) for p in python["problems"]] == [
        ("unreadable", 1),
        ("unreadable", at + 2),
        ("missing", at + 5),  # alice's entry 3, the line after her 2 (three users a round)
    ], python["problems"]
    done = _node(verifier, "--json", export, heads)
    assert done.returncode == 1, done.stdout + done.stderr
    assert _findings(json.loads(done.stdout)) == _findings(python)


@pytest.mark.parametrize("user", [None, A])
async def test_node_warns_of_a_user_no_saved_head_covers_as_python_does(
    verifier: Path, tmp_path: Path, user: str | None
) -> None:
    # Heads with alice's cut out (or from another log) vouched for none of her entries, and
    # neither verifier said so.
    export, heads, lines = await _export(tmp_path)
    saved = json.loads(heads.read_text())
    saved["heads"] = [h for h in saved["heads"] if h["user_id"] != A]
    assert saved["heads"]
    heads.write_text(json.dumps(saved))
    options = [] if user is None else ["--user", user]
    python = verify_lines(
        lines, heads=heads_from_json(saved), user_id=ANY_USER if user is None else user
    )
    assert python.ok is (user is None)  # with --user, the other users are outside_export
    assert [(w.user_id, w.kind, w.detail) for w in python.warnings] == [
        (A, "unanchored", "entries 1-4: no saved head covers this user's trail")
    ]
    done = await asyncio.to_thread(_node, verifier, *options, "--json", export, heads)
    assert done.returncode == (0 if python.ok else 1), done.stdout + done.stderr
    node = json.loads(done.stdout)
    assert node["warnings"] == python.to_json()["warnings"]
    assert _findings(node) == _findings(python.to_json())


@pytest.mark.parametrize("bad", ["", "a\x01b", "x" * 300])
def test_node_refuses_a_user_that_is_no_id_as_loomflow_does(
    verifier: Path, trail: tuple[Lines, Path], tmp_path: Path, bad: str
) -> None:
    # It checked the export as the trail of "" (every line outside it) where verify --file
    # refuses the option.
    lines, heads = trail
    export = _write(tmp_path / "export.jsonl", lines)
    with pytest.raises(ValueError, match="user_id"):
        verify_lines(lines, user_id=bad)
    done = _node(verifier, "--user", bad, export, heads)
    assert done.returncode == 2, done.stdout
    assert done.stderr.startswith("--user "), done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("seq", [0, -3])
def test_node_refuses_a_saved_head_below_seq_1_as_loomflow_does(
    verifier: Path, trail: tuple[Lines, Path], tmp_path: Path, seq: int
) -> None:
    # A heads file edited to seq 0 checked nothing of that user's trail and passed as ok.
    lines, heads = trail
    export = _write(tmp_path / "export.jsonl", lines)
    saved = json.loads(heads.read_text())
    saved["heads"][0]["seq"] = seq
    edited = tmp_path / "heads.json"
    edited.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="not a chain head"):
        heads_from_json(saved)
    done = _node(verifier, export, edited)
    assert done.returncode == 2, done.stdout
    assert done.stderr.startswith(f"cannot read the heads {edited}: not a chain head"), done.stderr
    assert done.stdout == ""


# Rows damaged in the database, each as someone with the file would leave it (the trigger
# dropped first), and the row it damages (user, seq).
DAMAGED_ROWS: dict[str, tuple[str | None, int, str, tuple[Any, ...]]] = {
    "payload with NaN": (A, 2, "payload = ?", ('{"a":NaN}',)),
    "payload of bytes that are not UTF-8": (A, 3, "payload = ?", (b"\xff\xfe{",)),
    "payload with a key twice": (None, 1, "payload = ?", ('{"i":1,"i":2}',)),
    "hash version relabelled": ("\U0001f600-user", 2, "hash_version = 2", ()),
    "digest dropped": ("\U0001f600-user", 3, "payload_digest = NULL", ()),
}


@pytest.mark.parametrize("damage", list(DAMAGED_ROWS))
async def test_an_exported_unreadable_row_is_unreadable_to_both_verifiers(
    verifier: Path, tmp_path: Path, damage: str
) -> None:
    # Exported, such a row's line held {"unreadable_payload": ...} (or the relabelled fields)
    # and both verifiers called it edited, where verify on the store says unreadable. The
    # line now says its row was unreadable, and both report that, in its place, alone.
    _, heads, _ = await _export(tmp_path)
    user, seq, change, args = DAMAGED_ROWS[damage]
    with sqlite3.connect(tmp_path / "audit.db") as db:
        db.execute("DROP TRIGGER loom_audit_no_update")
        db.execute(
            f"UPDATE loom_audit SET {change} WHERE user_key = ? AND seq = ?",
            (*args, user_key(user), seq),
        )
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        stored = await store.verify()
        export = tmp_path / "damaged.jsonl"
        assert await store.export(export) == 12
    finally:
        await store.close()
    assert [(p.user_id, p.kind, p.seq) for p in stored.problems] == [(user, "unreadable", seq)]
    with export.open(encoding="utf-8", errors="surrogateescape") as fh:
        python = verify_lines(fh, heads=heads_from_json(json.loads(heads.read_text()))).to_json()
    at = _at(export.read_text(encoding="utf-8").splitlines(), user, seq) + 1
    assert [(p["user_id"], p["kind"], p["seq"], p["position"]) for p in python["problems"]] == [
        (user, "unreadable", seq, at)
    ], python["problems"]
    assert python["entries"] == stored.entries == 11
    done = _node(verifier, "--json", export, heads)
    assert done.returncode == 1, done.stdout + done.stderr
    node = json.loads(done.stdout)
    assert _findings(node) == _findings(python)
    assert [p["detail"] for p in node["problems"]] == [p["detail"] for p in python["problems"]]


# Rows edited into no entry at all (SQLite keeps any type in any column): they stopped the
# export outright; now each is exported in its place as a marker with no hash.
NO_ENTRY_ROWS: dict[str, tuple[str | None, int, str]] = {
    "seq of text": (A, 2, "seq = 'two'"),
    "time of text": (None, 3, "time_us = 'noon'"),
    "actor of bytes": ("\U0001f600-user", 2, "actor = X'ff00'"),
}


@pytest.mark.parametrize("damage", list(NO_ENTRY_ROWS))
async def test_an_exported_row_that_is_no_entry_fails_both_verifiers_alike(
    verifier: Path, tmp_path: Path, damage: str
) -> None:
    _, heads, _ = await _export(tmp_path)
    user, seq, change = NO_ENTRY_ROWS[damage]
    with sqlite3.connect(tmp_path / "audit.db") as db:
        db.execute("DROP TRIGGER loom_audit_no_update")
        db.execute(
            f"UPDATE loom_audit SET {change} WHERE user_key = ? AND seq = ?", (user_key(user), seq)
        )
    store = SqliteAuditStore(tmp_path / "audit.db")
    try:
        export = tmp_path / "damaged.jsonl"
        assert await store.export(export) == 11  # every other entry is there
    finally:
        await store.close()
    markers = [json.loads(line) for line in export.read_text().splitlines() if '"hash"' not in line]
    assert [(m["user_id"], "unreadable" in m) for m in markers] == [(user, True)]
    with export.open(encoding="utf-8", errors="surrogateescape") as fh:
        python = verify_lines(fh, heads=heads_from_json(json.loads(heads.read_text()))).to_json()
    assert not python["ok"]
    assert "unreadable" in [p["kind"] for p in python["problems"]]
    done = _node(verifier, "--json", export, heads)
    assert done.returncode == 1, done.stdout + done.stderr
    node = json.loads(done.stdout)
    assert _findings(node) == _findings(python)
    for report in (python, node):  # the marker's why, not "no time"
        assert any("a row the exporter could not read" in p["detail"] for p in report["problems"])
