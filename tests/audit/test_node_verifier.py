"""The Node verifier (tools/verify-audit-export.mjs) re-checks real exports without Python.

It runs under the real ``node`` after ``npm ci`` of tools/package.json into a temporary copy;
under ``CI=true`` a missing node or npm fails these tests rather than skipping them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from loomflow.audit import AuditEntry, AuditRecord, SqliteAuditStore
from loomflow.audit._entry import canonical_json

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
            await store.append(
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
    assert f"problem  line {target + 1}: user null: entry 3 was changed" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("FAILED:")


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        ("drop", "entries 2-2 are missing before entry 3"),
        ("relink", "entry 3 was changed"),
        ("truncate", "the export ends before the saved head at seq 4: truncated"),
        ("version", "has an unknown hash_version 4"),
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
        await store.append(
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
