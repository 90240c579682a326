"""Checking an exported trail offline: ``verify_lines`` and ``loomflow audit verify --file``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow.audit import (
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
        ("swap", "missing"),
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
    elif tamper == "drop_tail":
        lines = lines[:-1]
    else:
        lines.insert(1, "{not json")
    alice = [h for h in heads if h.user_id == "alice"]
    report = verify_lines(lines, heads=alice)
    assert not report.ok
    assert kind in {p.kind for p in report.problems}, report.problems


async def test_an_export_from_a_date_on_is_checked_from_its_first_entry(tmp_path: Path) -> None:
    lines, heads = await _export(tmp_path, user_id="bob")
    report = verify_lines(lines[2:], heads=[h for h in heads if h.user_id == "bob"])
    assert report.ok, report.problems
    [warning] = report.warnings
    assert warning.kind == "unanchored"
    assert warning.seq == 3  # its link to entry 2 cannot be checked from the file alone


def test_heads_come_from_a_verify_report_or_a_list() -> None:
    head = {"user_id": "a", "seq": 3, "hash": "f" * 64}
    assert heads_from_json({"ok": True, "heads": [head]}) == [ChainHead("a", 3, "f" * 64)]
    assert heads_from_json([head]) == [ChainHead("a", 3, "f" * 64)]
    with pytest.raises(ValueError, match="not a chain head"):
        heads_from_json([{"user_id": "a"}])


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
    assert cli("verify", "--heads", str(heads)).returncode == 2
    assert cli("verify", "--file", str(export), "--user", "bob").returncode == 2
