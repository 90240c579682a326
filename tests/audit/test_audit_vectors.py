"""The test vectors in docs/audit.md are what the code computes.

The section between the ``audit-vectors`` markers is generated here; after a deliberate change
to hashing, rewrite it with ``python tests/audit/test_audit_vectors.py`` and review the diff.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import rfc8785

from loomflow.audit import GENESIS, AuditEntry, AuditRecord, verify_lines

DOCS = Path(__file__).resolve().parents[2] / "docs" / "audit.md"
START, END = "<!-- audit-vectors:start -->", "<!-- audit-vectors:end -->"
T0 = 1_778_230_443_512_000  # 2026-05-08T08:54:03.512000Z

_RECORDS: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "run.start",
        "agent:refunds",
        {"agent": "refunds", "input": "Refund order 1042"},
        "the user's first entry: `prev_hash` is 64 zeros",
    ),
    (
        "tool.call",
        "agent:refunds",
        {"amount": 5.0, "big": 1e20, "huge": 1e21, "negzero": -0.0, "order": 2**64, "rate": 15e-8},
        "numbers: `5.0` is `5`, `1e+20` is written out, `-0.0` is `0`, `1.5e-07` is `1.5e-7`; "
        "2**64 was stored as a string, being beyond 2**53 - 1",
    ),
    (
        "model.call",
        "agent:refunds",
        {"\uff5a": "U+FF5A", "\U0001f600": "U+1F600", "note": "line\u2028sep", "tab": "a\tb"},
        "text: the key 😀 (U+1F600) sorts before U+FF5A by UTF-16 units (D83D < FF5A), "
        "though after it by code points; U+2028 is escaped in the exported line and raw in "
        "the canonical form, where it may show as a break",
    ),
]


def vectors() -> list[AuditEntry]:
    """A chain of three version 2 entries of user ``ana``."""
    out: list[AuditEntry] = []
    for seq, (action, actor, payload, _) in enumerate(_RECORDS, start=1):
        record = AuditRecord(
            user_id="ana", session_id="ticket-77", actor=actor, action=action, payload=payload
        ).checked()
        prev = out[-1].hash if out else GENESIS
        out.append(
            AuditEntry.seal(
                record, seq=seq, time_us=T0 + seq * 1000, prev_hash=prev, hash_version=2
            )
        )
    return out


START3, END3 = "<!-- audit-vectors-v3:start -->", "<!-- audit-vectors-v3:end -->"
_SALTS = ("9c1f0e5a2b7d4c3e8f6a1b2c3d4e5f60", "0f1e2d3c4b5a69788796a5b4c3d2e1f0")


def vectors_v3() -> list[AuditEntry]:
    """User ``ben``: a version 3 entry, one whose payload was erased, and the erasure record."""
    records = [
        AuditRecord(
            user_id="ben", actor="agent:refunds", action="tool.call", payload={"email": "ben@x.io"}
        ),
        AuditRecord(user_id="ben", actor="agent:refunds", action="tool.result", payload={"ok": 1}),
    ]
    out: list[AuditEntry] = []
    for seq, (record, salt) in enumerate(zip(records, _SALTS, strict=True), start=1):
        prev = out[-1].hash if out else GENESIS
        out.append(
            AuditEntry.seal(record.checked(), seq=seq, time_us=T0 + seq, prev_hash=prev, salt=salt)
        )
    erasure = AuditRecord(
        user_id="ben",
        actor="cli:users-forget",
        action="audit.erasure",
        payload={"before": None, "entries": 1, "pre_v3": {}, "reason": "forget"},
    ).checked()
    out.append(
        AuditEntry.seal(erasure, seq=3, time_us=T0 + 3, prev_hash=out[-1].hash, salt="a" * 32)
    )
    out[1] = out[1].tombstoned()
    return out


def section_v3() -> str:
    """The generated version 3 vectors."""
    kept, erased, record = vectors_v3()
    assert kept.payload_salt is not None
    digest_input = {"payload": kept.payload, "salt": kept.payload_salt}
    digest_form = rfc8785.dumps(digest_input).decode("utf-8")
    return (
        f"**Entry 1** keeps its payload. First the payload digest, over the payload and its "
        f"salt:\n\n```json\n{kept.to_line()}\n```\n\n"
        f"```text\n{digest_form}\n{kept.payload_digest}\n```\n\n"
        f"Then the hash, over the line without `hash`, `payload` and `payload_salt`:\n\n"
        f"```text\n{kept.canonical_bytes().decode('utf-8')}\n{kept.hash}\n```\n\n"
        f"**Entry 2** had its payload erased: `payload` and `payload_salt` are `null`, and its "
        f"hash is checked as before, over what is left.\n\n```json\n{erased.to_line()}\n```\n\n"
        f"**Entry 3** is the erasure record that covers it: a forget's, whose `before` is "
        f"`null`, so it takes every version 3 payload before it.\n\n"
        f"```json\n{record.to_line()}\n```\n"
    )


def section() -> str:
    """The generated part of the docs section."""
    parts = []
    for entry, (_, _, _, about) in zip(vectors(), _RECORDS, strict=True):
        canonical = entry.canonical_bytes()
        parts.append(
            f"**Entry {entry.seq}**: {about}.\n\n"
            f"```json\n{entry.to_line()}\n```\n\n"
            f"Its canonical form ({len(canonical)} bytes of UTF-8) and SHA-256:\n\n"
            f"```text\n{canonical.decode('utf-8')}\n{entry.hash}\n```\n"
        )
    return "\n".join(parts)


def _documented(start: str = START, end: str = END) -> str:
    text = DOCS.read_text(encoding="utf-8")
    assert text.count(start) == 1, "the vectors' start marker is missing"
    assert text.count(end) == 1, "the vectors' end marker is missing"
    return text.split(start)[1].split(end)[0]


def test_the_documented_version_3_vectors_are_what_the_code_computes() -> None:
    assert _documented(START3, END3) == "\n" + section_v3() + "\n", (
        "docs/audit.md's test vectors are stale: run python tests/audit/test_audit_vectors.py"
    )


def test_each_version_3_line_checks_out_with_rfc8785_and_sha256_alone() -> None:
    doc = _documented(START3, END3)
    lines = [json.loads(x) for x in re.findall(r"^\{.*\"hash\":.*\}$", doc, flags=re.MULTILINE)]
    assert [x["hash_version"] for x in lines] == [3, 3, 3]
    prev = GENESIS
    for data in lines:
        body = {k: v for k, v in data.items() if k not in ("hash", "payload", "payload_salt")}
        assert hashlib.sha256(rfc8785.dumps(body)).hexdigest() == data["hash"]
        if data["payload"] is not None:
            salted = {"payload": data["payload"], "salt": data["payload_salt"]}
            assert hashlib.sha256(rfc8785.dumps(salted)).hexdigest() == data["payload_digest"]
        assert data["prev_hash"] == prev
        prev = data["hash"]
    assert lines[1]["payload"] is None
    assert lines[1]["payload_salt"] is None
    raw = re.findall(r"^\{.*\"hash\":.*\}$", doc, flags=re.MULTILINE)
    report = verify_lines(raw)
    assert report.ok
    assert report.erased == 1
    assert not verify_lines(raw[:2]).ok  # without the erasure record, the erasure is unauthorised


def test_the_documented_vectors_are_what_the_code_computes() -> None:
    assert _documented() == "\n" + section() + "\n", (
        "docs/audit.md's test vectors are stale: run python tests/audit/test_audit_vectors.py"
    )


def test_each_documented_line_checks_out_with_rfc8785_and_sha256_alone() -> None:
    """What an implementer in another language does, step by step, from the docs alone."""
    doc = _documented()
    lines = re.findall(r"^\{.*\"hash\":.*\}$", doc, flags=re.MULTILINE)
    canonical = re.findall(r"```text\n(.*)\n([0-9a-f]{64})\n```", doc)
    assert len(lines) == len(canonical) == 3
    prev = GENESIS
    for line, (form, digest) in zip(lines, canonical, strict=True):
        data = json.loads(line)
        body = {k: v for k, v in data.items() if k != "hash"}
        assert data["hash_version"] == 2
        assert rfc8785.dumps(body) == form.encode("utf-8")
        assert hashlib.sha256(form.encode("utf-8")).hexdigest() == digest == data["hash"]
        assert data["prev_hash"] == prev
        prev = digest
    assert verify_lines(lines).ok


def test_the_vectors_cover_what_python_spells_differently() -> None:
    forms = [e.canonical_bytes().decode() for e in vectors()]
    lines = [e.to_line() for e in vectors()]
    for canonical, python in [
        ('"rate":1.5e-7', '"rate":1.5e-07'),
        ('"amount":5,', '"amount":5.0'),
        ('"big":100000000000000000000', '"big":1e+20'),
        ('"negzero":0,', '"negzero":-0.0'),
        ('"order":"18446744073709551616"', '"order":"18446744073709551616"'),
    ]:
        assert canonical in forms[1]
        assert python in lines[1]
    assert forms[2].index("\U0001f600") < forms[2].index("\uff5a")
    assert lines[2].index("\uff5a") < lines[2].index("\U0001f600")
    assert "line\u2028sep" in forms[2]
    assert "line\\u2028sep" in lines[2]


if __name__ == "__main__":
    text = DOCS.read_text(encoding="utf-8")
    head, rest = text.split(START)
    text = head + START + "\n" + section() + "\n" + END + rest.split(END)[1]
    head, rest = text.split(START3)
    text = head + START3 + "\n" + section_v3() + "\n" + END3 + rest.split(END3)[1]
    DOCS.write_text(text, encoding="utf-8")
    print(f"rewrote the test vectors in {DOCS}", file=sys.stderr)
