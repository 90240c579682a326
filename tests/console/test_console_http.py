"""The console over real HTTP (uvicorn on a free port, httpx): access, roles, hostile ids,
paging and filters, redaction, verification, export, and the audit of every query."""

from __future__ import annotations

import asyncio
import base64
import html
import json
import os
import re
import sqlite3
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any
from urllib.parse import quote

import asyncpg
import httpx
import pytest
from console_helpers import (
    ADMIN,
    BOB,
    BOB_EXTRA,
    HOSTILE,
    READER,
    RESUMED,
    Deployment,
    Server,
    free_port,
    run_agent,
    tables,
)
from pydantic import SecretStr

import loomflow
from loomflow.agent import Agent
from loomflow.audit import AuditLog, AuditRecord, SqliteAuditStore, verify_lines
from loomflow.config import Settings
from loomflow.console import ConsoleOptions, SignInFailures, build_console, token_sha256
from loomflow.console._access import SignIns
from loomflow.console._app import user_url
from loomflow.errors import AuditIntegrityError, ConfigurationError
from loomflow.models import ScriptedModel
from loomflow.redaction import Redactor
from loomflow.runtime import SqliteRuntime
from loomflow.stores import Stores

# Every time in loomflow's JSON: ISO 8601, UTC, microseconds, Z (docs/operations/cli.md).
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")

ROUTES = [
    "/users",
    "/users/bob",
    "/trail?user=bob",
    "/entry?user=bob&seq=1",
    "/run?user=bob&run=x",
    "/runs",
    "/verify",
    "/export?user=bob",
    "/export/heads?user=bob",
]


def _audit(deployment: Deployment, **filters: object) -> list[dict[str, object]]:
    async def read() -> list[dict[str, object]]:
        async with Stores(deployment.settings, journal=False) as stores:
            return [e.to_json() async for e in stores.audit.entries(**filters)]

    return asyncio.run(read())


def test_nothing_but_healthz_without_signing_in(console: Server) -> None:
    with console.client() as http:
        assert http.get("/healthz").json() == {"ok": True}
        for route in ROUTES:
            api = http.get("/api" + route)
            assert api.status_code == 401, route
            assert api.headers["www-authenticate"] == "Bearer"
            page = http.get(route, follow_redirects=False)
            assert page.status_code == 303, route
            assert page.headers["location"].startswith("/signin?next=")
        # A wrong token, or a right one spelled another way, is no better than none.
        for bad in ("nope", ADMIN + "x", ADMIN[:-1], "x", ADMIN.upper()):
            assert (
                http.get("/api/users", headers={"Authorization": f"Bearer {bad}"}).status_code
                == 401
            )
        # The proxy header means nothing unless the console was told to trust it.
        assert http.get("/api/users", headers={"X-Forwarded-User": "ada"}).status_code == 401


def test_a_reader_is_refused_admin_work_and_the_refusal_is_audited(
    console: Server, deployment: Deployment
) -> None:
    with console.client(READER) as http:
        assert http.get("/api/users").status_code == 200
        assert http.get(f"/api{user_url(BOB)}").status_code == 200
        for route in ("/runs", "/verify", "/export?user=bob", "/export/heads?user=bob"):
            assert http.get("/api" + route).status_code == 403, route
            page = http.get(route)
            assert page.status_code == 403
            assert "Not allowed" in page.text
    refused = _audit(deployment, user_id="console:rob", action="console.refused")
    assert {e["payload"]["query"] for e in refused} >= {"/runs", "/api/export"}  # type: ignore[index]


def test_a_refusal_names_the_user_the_request_was_about(
    console: Server, deployment: Deployment
) -> None:
    before = len(_audit(deployment, user_id="console:rob", action="console.refused"))
    with console.client(READER) as http:
        asked = [
            ("/api/export", {"user": HOSTILE, "action": "tool.*"}),
            ("/export/heads", {"user": BOB}),
            ("/api/export", {"anonymous": "1"}),
            ("/api/runs", {"user": BOB}),  # not a route about a user: it names no one
        ]
        for route, params in asked:
            assert http.get(route, params=params).status_code == 403, route
    refused = _audit(deployment, user_id="console:rob", action="console.refused")[before:]
    payloads: list[Any] = [e["payload"] for e in refused]
    assert [(p["query"], p.get("viewed_user", "-")) for p in payloads] == [
        ("/api/export", HOSTILE),
        ("/export/heads", BOB),
        ("/api/export", None),
        ("/api/runs", "-"),
    ]
    assert {json.dumps(p["details"]) for p in payloads} == {'{"needs": "admin"}'}


def test_failed_sign_ins_are_recorded_coalesced_and_without_the_token(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    folder.mkdir()
    path = folder / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        await store.append(AuditRecord(user_id="bob", actor="t", action="x"))
        await store.close()

    async def failures() -> list[Any]:
        store = SqliteAuditStore(path)
        try:
            return [e async for e in store.entries(user_id="console:(unknown)")]
        finally:
            await store.close()

    asyncio.run(make())
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    options = ConsoleOptions(proxy_header="X-Forwarded-User")
    bad = "wrong-token-0123456789-not-anyones"
    flood = 40
    with Server(settings, options) as server, server.client() as http:
        assert http.post("/signin", data={"token": bad}).status_code == 401
        first = asyncio.run(failures())
        # The first failure is on record at once.
        assert [(e.action, e.actor) for e in first] == [
            ("console.signin_failed", "console:(unknown)")
        ]
        assert first[0].payload["failures"] == 1
        assert first[0].payload["via"] == {"form": 1}
        assert first[0].payload["clients"] == ["127.0.0.1"]
        # A flood within the minute is counted, not written entry by entry.
        for n in range(flood):
            auth = {"Authorization": f"Bearer {bad}-{n}"}
            assert http.get("/api/users/bob", headers=auth).status_code == 401
        assert http.get("/users", headers={"X-Forwarded-User": "<b>"}).status_code == 303
        assert http.get("/api/users", headers={"X-Forwarded-User": "<b>"}).status_code == 401
        assert http.get("/api/users").status_code == 401  # no credentials: no attempt
        assert http.get("/api/users", headers={"Authorization": f"Bearer {ADMIN}"}).is_success
        assert len(asyncio.run(failures())) == 1
    # What was counted is written when the console stops.
    written = asyncio.run(failures())
    assert len(written) == 2
    assert written[1].payload["failures"] == flood + 2  # the page and the API proxy value
    assert written[1].payload["via"] == {"bearer": flood, "proxy": 2}
    assert written[1].payload["clients"] == ["127.0.0.1"]
    # Neither a token, nor the header's value, nor the path asked for is recorded.
    raw = _raw(folder)
    assert bad.encode() not in raw
    assert b"wrong-token" not in raw
    assert b"/api/users/bob" not in raw

    async def verify() -> Any:
        store = SqliteAuditStore(path)
        try:
            return await store.verify()
        finally:
            await store.close()

    assert asyncio.run(verify()).ok


def test_failed_sign_ins_coalesce_by_the_minute() -> None:
    now = [0.0]
    failures = SignInFailures(60, clock=lambda: now[0], wall=lambda: 1_800_000_000 + now[0])
    first = failures.note("form", "10.0.0.1")
    assert first is not None
    assert first.payload() == {
        "failures": 1,
        "via": {"form": 1},
        "first": "2027-01-15T08:00:00.000000Z",
        "last": "2027-01-15T08:00:00.000000Z",
        "clients": ["10.0.0.1"],
        "more_clients": False,
    }
    for n in range(20):
        now[0] = 1 + n
        assert failures.note("bearer", f"10.0.1.{n}") is None
    now[0] = 61
    due = failures.note("proxy", None)
    assert due is not None
    shown = due.payload()
    assert shown["failures"] == 21
    assert shown["via"] == {"bearer": 20, "proxy": 1}
    assert len(shown["clients"]) == 8  # at most 8 addresses, and a mark that there were more
    assert shown["more_clients"] is True
    assert shown["first"] == "2027-01-15T08:00:01.000000Z"
    assert shown["last"] == "2027-01-15T08:01:01.000000Z"
    assert failures.take() is None
    now[0] = 62
    assert failures.note("form", None) is None
    failures.put_back(due)  # a write that failed is counted again with the next
    again = failures.take()
    assert again is not None
    assert again.payload()["failures"] == 22
    assert failures.take() is None


def test_hostile_user_ids_are_escaped_and_reach_their_own_trail(
    console: Server, deployment: Deployment
) -> None:
    with console.client(ADMIN) as http:
        users = http.get("/api/users").json()["users"]
        ids = {u["user_id"] for u in users}
        assert {HOSTILE, BOB, ".."} <= ids
        hostile = next(u for u in users if u["user_id"] == HOSTILE)
        assert hostile["url"] == "/users/" + quote(HOSTILE, safe="")
        assert "/" not in hostile["url"].removeprefix("/users/")  # one path segment
        page = http.get("/users", params={"q": "script"})
        assert "<script>" not in page.text
        assert "&lt;script&gt;alert(" in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
        for user in (HOSTILE, ".."):
            trail = http.get("/api" + user_url(user)).json()
            assert trail["entries"], user
            assert {e["user_id"] for e in trail["entries"]} == {user}
            assert http.get(user_url(user)).status_code == 200
        assert user_url("..") == "/trail?user=.."  # a browser would fold /users/.. away
        # Ids that look like paths or are too long are ids, not paths: an empty trail or a
        # clear refusal, never another user's data or a file.
        for probe in ("../../etc/passwd", "bob/../bob", "a" * 300, "x\x00y"):
            got = http.get("/api/trail", params={"user": probe})
            if got.status_code == 200:
                assert got.json()["entries"] == []
            else:
                assert got.status_code == 400
                assert "user_id" in got.json()["error"]
        html = http.get("/trail", params={"user": "<b>x</b>"}).text
        assert "<b>x</b>" not in html
        assert "&lt;b&gt;x&lt;/b&gt;" in html


def test_bidirectional_overrides_and_line_separators_are_shown_escaped(tmp_path: Path) -> None:
    # Valid ids (only control characters are refused), but shown raw an override makes
    # "bob\u202eexe.gpj" read as "bobjpg.exe", and a separator breaks a row in two.
    spoof, actor, session = "bob\u202eexe.gpj", "agent:x\u2028y", "s\u2066z"
    path = tmp_path / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        record = AuditRecord(
            user_id=spoof,
            session_id=session,
            run_id="r\u200fr",
            actor=actor,
            action="custom.\u202ename",
            payload={"note": "a\u202eb\u0085c", "tool": "t\u2029u"},
        )
        await store.append([record])
        await store.close()

    asyncio.run(make())
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        # The API hands back the ids as stored; only what a person reads is escaped.
        assert {u["user_id"] for u in http.get("/api/users").json()["users"]} >= {spoof}
        pages = {
            "users": http.get("/users").text,
            "trail": http.get(user_url(spoof)).text,
            "entry": http.get("/entry", params={"user": spoof, "seq": 1}).text,
        }
        for name, page in pages.items():
            shown = page.replace('value="' + spoof + '"', "")  # the filter form's round trip
            for raw in ("\u202e", "\u2028", "\u2029", "\u2066", "\u200f", "\x85"):
                assert raw not in shown, (name, hex(ord(raw)))
        assert "bob\\u202eexe.gpj" in pages["users"]
        assert "agent:x\\u2028y" in pages["trail"]
        assert "s\\u2066z" in pages["trail"]
        assert "custom.\\u202ename" in pages["entry"]
        assert "a\\u202eb\\u0085c" in pages["entry"]  # the payload, as JSON escapes


def _seen(html_text: str) -> str:
    """Text as a browser shows it: entities read, white space collapsed and trimmed."""
    return " ".join(html.unescape(html_text).split())


def test_ids_that_a_page_would_show_alike_are_quoted(tmp_path: Path) -> None:
    # A page folds white space: "bob", " bob", "bob " and "b  ob" read the same, so an
    # officer picking a user or reading whose session an entry is could not tell them apart.
    users = ["bob", " bob", "bob ", "b  ob", "b ob", "'bob'", "-"]
    path = tmp_path / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        for user in users:
            await store.append([AuditRecord(user_id=user, session_id=user, actor="a", action="x")])
        await store.append([AuditRecord(user_id=None, actor="a", action="x")])
        await store.close()

    asyncio.run(make())
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        page = http.get("/users").text
        names = [_seen(n) for n in re.findall(r'<td class="id"><a href="[^"]*">(.*?)</a>', page)]
        assert len(set(names)) == len(names), names  # the console's own chain is one too
        assert {"bob", "' bob'", "'bob '", "'b ob'", "b ob", "\"'bob'\"", "'-'"} <= set(names)
        headings = []
        for user in users:
            trail = http.get(user_url(user)).text
            headings.append(_seen(re.findall(r'<span id="user">(.*?)</span>', trail)[0]))
            session = re.findall(r'<td class="id">(.*?)</td>', trail)[0]
            assert _seen(session) == headings[-1]  # the session column, shown alike
        assert len(set(headings)) == len(users), headings


def test_a_trail_pages_and_filters(console: Server) -> None:
    with console.client(ADMIN) as http:
        seen: list[int] = []
        url: str | None = "/api/users/bob?limit=25"
        pages = 0
        while url is not None:
            body = http.get(url).json()
            seen += [e["seq"] for e in body["entries"]]
            pages += 1
            url = None
            if body["next_cursor"] is not None:
                url = f"/api/users/bob?limit=25&cursor={body['next_cursor']}"
        assert pages >= 3
        assert seen == sorted(set(seen))
        assert seen[0] == 1
        assert len(seen) == seen[-1]
        notes = http.get("/api/users/bob", params={"action": "note.*", "limit": 100}).json()
        assert len(notes["entries"]) == BOB_EXTRA
        session = http.get("/api/users/bob", params={"session": "s-bob", "limit": 100}).json()
        assert session["entries"]
        assert {e["session_id"] for e in session["entries"]} == {"s-bob"}
        past = http.get("/api/users/bob", params={"until": "2001-01-01"}).json()
        assert past["entries"] == []
        future = http.get("/api/users/bob", params={"since": "2999-01-01T00:00Z"}).json()
        assert future["entries"] == []
        bad = http.get("/api/users/bob", params={"since": "yesterday-ish"})
        assert bad.status_code == 400
        assert "since" in bad.json()["error"]
        assert http.get("/api/users/bob", params={"limit": "7"}).status_code == 400
        assert http.get("/api/users/bob", params={"cursor": "x"}).status_code == 400


def test_a_page_holds_10_to_500_entries(console: Server, deployment: Deployment) -> None:
    total = len(_audit(deployment, user_id=BOB))
    assert 37 < total < 500
    with console.client(ADMIN) as http:
        for size in (10, 20, 37, 500):
            body = http.get("/api/users/bob", params={"limit": size}).json()
            assert len(body["entries"]) == min(size, total), size
        page = http.get("/users/bob", params={"limit": 20}).text
        assert "<option selected>20</option>" in page  # the menu keeps the size asked for
        one = http.get("/api/export", params={"user": BOB, "limit": 20}).text
        assert len(one.splitlines()) == 1 + 20  # the header, then the page
        for bad in ("9", "501", "0", "-10", "20.0", "1_0", " 20", "\u0662\u0660", "9" * 5000, ""):
            for route in ("/api/users/bob", "/api/export"):
                got = http.get(route, params={"user": BOB, "limit": bad})
                assert got.status_code == 400, (route, bad)
                assert got.json()["error"] == "limit must be a whole number from 10 to 500"


def test_an_entry_is_shown_redacted(console: Server) -> None:
    with console.client(ADMIN) as http:
        notes = http.get("/api/users/bob", params={"action": "note.added", "limit": 10}).json()
        seq = notes["entries"][0]["seq"]
        assert "s3cr3t-value-xyz" not in json.dumps(notes)  # the API's trail is redacted too
        assert "[REDACTED]" in notes["entries"][0]["payload"]["note"]
        shown = http.get("/api/entry", params={"user": BOB, "seq": seq}).json()
        assert "s3cr3t-value-xyz" not in json.dumps(shown)
        assert "bob@example.com" not in json.dumps(shown)
        assert "[REDACTED]" in shown["payload"]["note"]
        page = http.get("/entry", params={"user": BOB, "seq": seq}).text
        assert "s3cr3t-value-xyz" not in page
        assert "[REDACTED]" in page
        assert http.get("/api/entry", params={"user": BOB, "seq": 99999}).status_code == 404


def test_no_page_or_route_shows_an_unredacted_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writer that did not redact (or wrote before the secret was configured).
    path = tmp_path / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        log = AuditLog(store, redactor=Redactor(pii=False, secrets=[], env=[]))
        payload = {"conn": "password is db-pass-1", "mail": "dave@example.com"}
        for extra in ({}, {"reason": "retry with db-pass-1 for dave@example.com"}):
            await log.record(
                "note.secret", user_id="dave", actor="app", payload=payload | extra,
                run_id="01RUNDAVE",
            )  # fmt: skip
        await store.close()

    asyncio.run(make())
    (tmp_path / "tokens").write_text(f"reader {READER} rob\nadmin {ADMIN} ada\n", "utf-8")
    monkeypatch.setenv("LOOMFLOW_REDACT_SECRETS", '["db-pass-1"]')
    settings = Settings(runtime_url=f"sqlite:///{path}")
    hidden = ("db-pass-1", "dave@example.com")
    shows = [
        "/users/dave",
        "/trail?user=dave",
        "/trail?user=dave&verify=1",
        "/run?user=dave&run=01RUNDAVE",
        "/entry?user=dave&seq=1",
        "/entry?user=dave&seq=2",
        "/users?q=dave",
    ]
    with Server(settings, ConsoleOptions(tokens_file=tmp_path / "tokens")) as server:
        for token in (READER, ADMIN):
            with server.client(token) as http:
                for route in shows:
                    for shown in (http.get("/api" + route), http.get(route)):
                        assert shown.status_code == 200, (route, shown.text[:300])
                        for value in hidden:
                            assert value not in shown.text, (token[:5], shown.url, value)
                trail = http.get("/api/users/dave").json()["entries"]
                assert trail[0]["payload"] == {
                    "conn": "password is [REDACTED]",
                    "mail": "[REDACTED:email]",
                }
                # Changed by the redaction: shown without the salt, which would let a reader
                # test guesses of the hidden values against the digest.
                assert {e["payload_salt"] for e in trail} == {None}
                assert all(e["payload_digest"] for e in trail)
                story = http.get("/api/run", params={"user": "dave", "run": "01RUNDAVE"}).json()
                assert [e["seq"] for e in story["entries"]] == [1, 2]
                page = http.get("/run", params={"user": "dave", "run": "01RUNDAVE"}).text
                assert "reason=retry with [REDACTED] for [REDACTED:email]" in page
        with server.client(ADMIN) as http:
            # Only the admin export hands the payloads out as stored, salts and all: what the
            # hashes cover, so that it verifies.
            for params in ({"user": "dave"}, {"user": "dave", "limit": 10}):
                export = http.get("/api/export", params=params).text
                assert all(value in export for value in hidden)
                lines = [json.loads(line) for line in export.splitlines()[1:]]  # the header first
                assert all(e["payload_salt"] for e in lines)
        with server.client(READER) as http:
            assert http.get("/api/export", params={"user": "dave"}).status_code == 403


def test_every_time_in_the_json_is_iso_8601_utc_with_microseconds(
    console: Server, deployment: Deployment
) -> None:
    with console.client(ADMIN) as http:
        runs = http.get("/api/runs").json()["runs"]
        assert runs
        assert all(ISO_UTC.fullmatch(r["updated_at"]) for r in runs), runs[0]
        trail = http.get(
            "/api/users/bob", params={"since": "2001-02-03T04:05:06+02:00", "until": "7d"}
        ).json()
        assert trail["filters"]["since"] == "2001-02-03T02:05:06.000000Z"
        assert ISO_UTC.fullmatch(trail["filters"]["until"])
        assert all(ISO_UTC.fullmatch(e["time"]) for e in trail["entries"])
        story = http.get("/api/run", params={"user": BOB, "run": deployment.runs[BOB]}).json()
        assert story["journal"]
        assert all(ISO_UTC.fullmatch(j["created_at"]) for j in story["journal"])
        assert all(ISO_UTC.fullmatch(e["time"]) for e in story["entries"])
    # The filters recorded in the asker's chain are written the same way.
    looks = _audit(deployment, user_id="console:ada", action="console.query")
    recorded = [e["payload"]["details"] for e in looks if e["payload"]["query"] == "trail"]  # type: ignore[index]
    assert recorded[-1]["since"] == "2001-02-03T02:05:06.000000Z"


def test_a_runs_story(console: Server, deployment: Deployment) -> None:
    run_id = deployment.runs[BOB]
    with console.client(ADMIN) as http:
        story = http.get("/api/run", params={"user": BOB, "run": run_id}).json()
        assert story["session_id"] == "s-bob"
        assert story["state"] == "finished"
        assert story["executed"] >= 2  # a model call and a tool call ran live
        assert story["replayed"] == 0
        assert [d["action"] for d in story["decisions"]] == [
            "permission.decision",
            "budget.warning",
        ]
        assert story["journal"]  # the session's journaled steps
        page = http.get("/run", params={"user": BOB, "run": run_id}).text
        assert "over the limit" in page
        assert 'id="journal"' in page
        assert "finished" in page
        # A run of another user is not shown under this one.
        other = deployment.runs[HOSTILE]
        assert http.get("/api/run", params={"user": BOB, "run": other}).status_code == 404


def test_a_resumed_runs_story_shows_replayed_steps(console: Server, deployment: Deployment) -> None:
    with console.client(ADMIN) as http:
        story = http.get(
            "/api/run", params={"user": RESUMED, "run": deployment.runs[RESUMED]}
        ).json()
    assert story["replayed"] >= 1  # the model call answered from the journal
    assert story["executed"] >= 1  # the tool call the crash cut short ran again
    assert story["state"] == "finished"
    assert "model.replay" in [e["action"] for e in story["entries"]]


def test_verification_and_export_check_out_with_the_cli(
    console: Server, deployment: Deployment, tmp_path: Path
) -> None:
    with console.client(ADMIN) as http:
        shown = http.get("/api/users/bob", params={"verify": 1}).json()["verify"]
        assert shown["ok"]
        assert shown["entries"] == len(_audit(deployment, user_id=BOB))
        page = http.get("/users/bob", params={"verify": 1}).text
        assert "Chain verified" in page
        export = http.get("/export", params={"user": BOB, "action": "note.*"})
        assert export.headers["content-type"].startswith("application/x-ndjson")
        header, *lines = export.text.splitlines()
        # Its first line says what it holds, as `loomflow audit export` writes it.
        assert json.loads(header) == {
            "filters": {"action": "note.*", "user_id": BOB},
            "loomflow_audit_export": 1,
        }
        assert len(lines) == BOB_EXTRA
        # "This page": exactly the entries the trail page shows.
        first = http.get("/api/users/bob", params={"limit": 25}).json()
        second = http.get(
            "/api/users/bob", params={"limit": 25, "cursor": first["next_cursor"]}
        ).json()
        page = http.get(
            "/export", params={"user": BOB, "limit": 25, "cursor": first["next_cursor"]}
        ).text
        exported = [json.loads(line) for line in page.splitlines()[1:]]  # after the header
        # The header names where the page starts: a verifier took it for bob's whole trail
        # missing entries 1-25.
        assert json.loads(page.splitlines()[0])["filters"] == {"user_id": BOB, "after_seq": "25"}
        assert [(e["seq"], e["hash"]) for e in exported] == [
            (e["seq"], e["hash"]) for e in second["entries"]
        ]
        # The export carries the payloads as stored (what the hashes cover); the trail shows
        # them redacted.
        assert "s3cr3t-value-xyz" in page
        assert "s3cr3t-value-xyz" not in json.dumps(second)
        assert http.get("/api/export", params={"user": BOB, "limit": 7}).status_code == 400
        # A cursor without a page size was dropped: the whole trail came back, from entry 1,
        # to a script that asked to go on from a cursor (so it held its first pages twice).
        alone = http.get("/api/export", params={"user": BOB, "cursor": first["next_cursor"]})
        assert alone.status_code == 400
        assert "limit" in alone.json()["error"]
        full = http.get("/export", params={"user": BOB}).text
        heads = http.get("/export/heads", params={"user": BOB}).text
    (tmp_path / "bob.jsonl").write_text(full, encoding="utf-8")
    (tmp_path / "heads.json").write_text(heads, encoding="utf-8")
    cli = [sys.executable, "-m", "loomflow.cli"]
    checked = subprocess.run(
        [
            *cli,
            "audit",
            "verify",
            "--file",
            str(tmp_path / "bob.jsonl"),
            "--heads",
            str(tmp_path / "heads.json"),
            "--user",
            BOB,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (tmp_path / "page.jsonl").write_text(page, encoding="utf-8")
    mid = subprocess.run(
        [*cli, "audit", "verify", "--file", str(tmp_path / "page.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert mid.returncode == 0, mid.stdout + mid.stderr  # a page from mid-chain checks too
    same = subprocess.run(
        [*cli, "--url", deployment.url, "audit", "export", "--user", BOB],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert same.returncode == 0, same.stderr
    assert same.stdout == full  # the same format as `loomflow audit export`


def test_every_query_is_audited_in_the_askers_chain(
    console: Server, deployment: Deployment
) -> None:
    before = len(_audit(deployment, user_id=HOSTILE))
    with console.client(ADMIN) as http:
        assert http.get("/api" + user_url(HOSTILE), params={"action": "tool.*"}).status_code == 200
    looks = _audit(deployment, user_id="console:ada", action="console.query")
    last = looks[-1]["payload"]
    assert last["viewed_user"] == HOSTILE  # type: ignore[index]
    assert last["query"] == "trail"
    assert last["details"]["action"] == "tool.*"  # type: ignore[index]
    assert len(_audit(deployment, user_id=HOSTILE)) == before  # looking leaves the trail alone


def test_runs_by_state(console: Server) -> None:
    with console.client(ADMIN) as http:
        runs = http.get("/api/runs").json()["runs"]
        assert {r["user_id"] for r in runs} >= {BOB, HOSTILE}
        for r in runs:  # the time format of the CLI's --json
            assert ISO_UTC.fullmatch(r["updated_at"]), r["updated_at"]
        assert {r["state"] for r in runs} == {"finished"}
        assert http.get("/api/runs", params={"state": "open"}).json()["runs"] == []
        assert "<script>alert" not in http.get("/runs").text


def test_the_sign_in_cookie(console: Server, deployment: Deployment) -> None:
    with console.client() as http:
        form = http.get("/signin")
        assert form.status_code == 200
        assert 'name="token"' in form.text
        # Sent to the form from a trail, and back to that very trail after signing in.
        asked = http.get(user_url("a?b/c"), params={"since": "7d"}, follow_redirects=False)
        back = urllib.parse.parse_qs(urllib.parse.urlsplit(asked.headers["location"]).query)
        assert back["next"] == ["/users/a%3Fb%2Fc?since=7d"]
        wrong = http.post("/signin", data={"token": "not-a-token-at-all"})
        assert wrong.status_code == 401
        assert "not known" in wrong.text
        for elsewhere in ("//evil.example/x", "/\\evil.example", "https://evil.example", "/a\nb"):
            moved = http.post(
                "/signin",
                params={"next": elsewhere},
                data={"token": READER},
                follow_redirects=False,
            )
            assert moved.headers["location"] == "/users", elsewhere  # never off the console
        done = http.post("/signin?next=/users/bob", data={"token": READER}, follow_redirects=False)
        assert done.status_code == 303
        assert done.headers["location"] == "/users/bob"
        cookie = done.headers["set-cookie"].lower()
        assert "httponly" in cookie
        assert "samesite=strict" in cookie
        # Neither the token nor its plain hash is in the (readable, signed) cookie.
        raw = base64.b64decode(done.cookies["loomflow_console"].split(".")[0] + "==")
        assert READER.encode() not in raw
        assert token_sha256(READER).encode() not in raw
        assert http.get("/users").status_code == 200
        assert http.get("/runs").status_code == 403  # the cookie carries the reader's role
        http.post("/signout")
        assert http.get("/users", follow_redirects=False).status_code == 303
    assert _audit(deployment, user_id="console:rob", action="console.signin")


def test_signing_out_ends_the_sign_in_for_every_copy_of_the_cookie(
    console: Server, deployment: Deployment
) -> None:
    def sign_in(http: httpx.Client) -> str:
        done = http.post("/signin", data={"token": READER}, follow_redirects=False)
        assert done.status_code == 303
        return done.cookies["loomflow_console"]

    def sign_outs() -> int:
        return len(_audit(deployment, user_id="console:rob", action="console.signout"))

    before = sign_outs()
    with console.client() as http, console.client() as other:
        saved = sign_in(http)
        elsewhere = sign_in(other)  # the same token, another browser
        assert http.get("/api/users").status_code == 200
        assert http.post("/signout", follow_redirects=False).status_code == 303
    assert sign_outs() == before + 1  # recorded, as the sign-in is
    with console.client(cookies={"loomflow_console": saved}) as replay:
        # Signing out a sign-in that already ended is nothing to record.
        assert replay.post("/signout", follow_redirects=False).status_code == 303
        assert sign_outs() == before + 1
        assert replay.get("/api/users").status_code == 401
        page = replay.get("/users/bob", follow_redirects=False)
        assert page.status_code == 303
        assert page.headers["location"].startswith("/signin?")
        # ... and the browser is told to drop the dead cookie.
        assert "loomflow_console=null" in page.headers["set-cookie"]
    with console.client(cookies={"loomflow_console": elsewhere}) as still:
        assert still.get("/api/users").status_code == 200  # only that sign-in ended


def test_a_restart_signs_everyone_out(deployment: Deployment) -> None:
    settings = deployment.settings.model_copy(
        update={"console_session_secret": SecretStr("k" * 40)}  # the same key both times
    )
    options = ConsoleOptions(tokens_file=deployment.tokens)
    with Server(settings, options) as first, first.client() as http:
        http.post("/signin", data={"token": READER}, follow_redirects=False)
        saved = http.cookies["loomflow_console"]
        assert http.get("/api/users").status_code == 200
    with Server(settings, options) as second, second.client() as http:
        http.cookies.set("loomflow_console", saved)
        assert http.get("/api/users").status_code == 401


def test_sign_ins_expire_and_are_bounded() -> None:
    now = [1000.0]
    live = SignIns(60, limit=3, clock=lambda: now[0])
    first, second = live.start(), live.start()
    assert first != second
    assert live.live(first)
    assert live.live(second)
    assert not live.live("made-up")
    assert not live.live(None)
    live.end(first)
    assert not live.live(first)
    live.end(first)  # twice is fine
    now[0] += 61
    assert not live.live(second)  # expired
    ids = [live.start() for _ in range(5)]
    assert len(live) == 3  # the two oldest were signed out to make room
    assert [live.live(i) for i in ids] == [False, False, True, True, True]
    now[0] += 61
    live.start()
    assert len(live) == 1  # expired sign-ins are dropped as new ones come


def test_a_trusted_proxy_header(deployment: Deployment) -> None:
    options = ConsoleOptions(proxy_header="X-Forwarded-User", proxy_admins=("ada",))
    with Server(deployment.settings, options) as server, server.client() as http:
        assert http.get("/api/users").status_code == 401
        carol = {"X-Forwarded-User": "carol"}
        assert http.get("/api/users", headers=carol).status_code == 200
        assert http.get("/api/runs", headers=carol).status_code == 403
        assert http.get("/api/runs", headers={"X-Forwarded-User": "ada"}).status_code == 200
        assert http.get("/api/users", headers={"X-Forwarded-User": "<b>"}).status_code == 401
        # A proxy that adds its header after the client's rather than replacing it: the
        # first value would be the client's own choice of name. Neither is taken.
        for twice in ([("X-Forwarded-User", "ada"), ("X-Forwarded-User", "carol")],
                      [("X-Forwarded-User", "carol"), ("X-Forwarded-User", "carol")]):  # fmt: skip
            assert http.get("/api/runs", headers=twice).status_code == 401
            assert http.get("/runs", headers=twice).status_code == 303  # to the sign-in form
    assert _audit(deployment, user_id="console:carol", action="console.query")


def test_another_sites_page_cannot_load_the_console_in_the_background(
    deployment: Deployment,
) -> None:
    # Behind a signing-in proxy every request the browser sends carries the user's name, so
    # an image on any page the officer visited ran an export (or "verify all") in their name
    # and recorded looks they never took; the sign-in cookie goes along from a sibling
    # subdomain (SameSite counts it the same site). A link followed from elsewhere is served.
    image = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"}
    frame = {
        "Sec-Fetch-Site": "same-site",
        "Sec-Fetch-Mode": "navigate",
        "Sec-Fetch-Dest": "iframe",
    }
    fetch = {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"}
    link = {
        "Sec-Fetch-Site": "cross-site",
        "Sec-Fetch-Mode": "navigate",
        "Sec-Fetch-Dest": "document",
    }
    victim = "background-load-victim"
    options = ConsoleOptions(
        proxy_header="X-Forwarded-User", proxy_admins=("ada",), tokens_file=deployment.tokens
    )
    with Server(deployment.settings, options) as server, server.client() as http:
        ada = {"X-Forwarded-User": "ada"}
        for forged in (image, frame, fetch):
            for route in ("/export", "/api/export", "/export/heads"):
                got = http.get(route, params={"user": victim}, headers=ada | forged)
                assert got.status_code == 403, (route, forged)
                assert "another site" in got.text
        assert http.get("/verify", headers=ada | image).status_code == 403
        assert http.get("/users/bob", headers=ada | link).status_code == 200
        assert http.get("/users/bob", headers=ada | {"Sec-Fetch-Site": "none"}).status_code == 200
        # A bearer token is sent by a script that holds it, never by a browser on its own.
        bearer = {"Authorization": f"Bearer {ADMIN}"} | image
        assert http.get("/api/export/heads", params={"user": "bob"}, headers=bearer).is_success
        # The sign-in cookie, sent along by a sibling subdomain's page.
        signed = http.post("/signin", data={"token": ADMIN}, follow_redirects=False)
        assert signed.status_code == 303
        got = http.get("/export", params={"user": victim}, headers=fetch)
        assert got.status_code == 403
        assert http.get("/users/bob", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200
    looks = [
        e
        for e in _audit(deployment, action="console.query")
        if (e["payload"] or {}).get("viewed_user") == victim
    ]
    assert looks == []  # nothing was recorded in anyone's name


def test_tokens_files_and_settings_are_checked(deployment: Deployment, tmp_path: Path) -> None:
    cases = {
        "root " + "t" * 20 + " x": "role must be reader or admin",
        "admin short x": "16 characters or more",
        "admin sha256:abc x": "64 lowercase hex",
        f"admin {'t' * 20} a\nreader {'u' * 20} a": "given twice",
        f"admin {'t' * 20}": "expected `role token name`",
        f"admin {'t' * 20} <b>": "a name is",
        # One token, two names (and roles): whoever holds it was signed in as the last one.
        f"reader {'t' * 20} rob\nadmin {'t' * 20} ada": "the same token as line 1",
        f"reader {'t' * 20} rob\nadmin sha256:{token_sha256('t' * 20)} ada": "same token as line 1",
    }
    for text, message in cases.items():
        path = tmp_path / "tokens"
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ConfigurationError, match=message) as caught:
            build_console(deployment.settings, ConsoleOptions(tokens_file=path))
        assert "t" * 20 not in str(caught.value)  # a token never lands in a message
    with pytest.raises(ConfigurationError, match="needs a way in"):
        build_console(deployment.settings, ConsoleOptions())
    path.write_text(f"reader {'t' * 20} rob\n", encoding="utf-8")
    same = deployment.settings.model_copy(update={"console_token": SecretStr("t" * 20)})
    with pytest.raises(
        ConfigurationError, match="LOOMFLOW_CONSOLE_TOKEN is the token of"
    ) as caught:
        build_console(same, ConsoleOptions(tokens_file=path))
    assert "t" * 20 not in str(caught.value)
    # Two tokens recorded under one name: one chain for two people's looks.
    path.write_text(f"reader {'u' * 20} console-token\n", encoding="utf-8")
    with pytest.raises(ConfigurationError, match="the name LOOMFLOW_CONSOLE_TOKEN"):
        build_console(same, ConsoleOptions(tokens_file=path))
    with pytest.raises(ConfigurationError, match="cannot read tokens file"):
        build_console(deployment.settings, ConsoleOptions(tokens_file=tmp_path / "none"))
    # An admin through the proxy who could never be one was taken without a word.
    with pytest.raises(ConfigurationError, match="needs --trust-proxy-header"):
        build_console(
            deployment.settings,
            ConsoleOptions(tokens_file=deployment.tokens, proxy_admins=("ada",)),
        )
    for name in ("bad!name", "ada ", "", "(unknown)"):
        with pytest.raises(ConfigurationError, match="--proxy-admin"):
            build_console(
                deployment.settings,
                ConsoleOptions(proxy_header="X-Forwarded-User", proxy_admins=(name,)),
            )


def test_a_hashed_token_and_the_setting_token(deployment: Deployment, tmp_path: Path) -> None:
    digest = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "console", "--hash-token"],
        input="hashed-token-0123456789\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert digest.startswith("sha256:")
    assert len(digest) == 71
    short = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "console", "--hash-token"],
        input="short\n", capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert short.returncode == 2  # a short plain token is refused; so is hashing one
    assert short.stdout == ""
    assert "16 or more" in short.stderr
    (tmp_path / "tokens").write_text(f"reader {digest} hana\n", encoding="utf-8")
    settings = Settings(runtime_url=deployment.url, console_token="setting-token-0123456789")
    with Server(settings, ConsoleOptions(tokens_file=tmp_path / "tokens")) as server:
        with server.client("hashed-token-0123456789") as http:
            assert http.get("/api/users").status_code == 200
            assert http.get("/api/runs").status_code == 403
        with server.client(digest) as http:  # the hash is not itself a token
            assert http.get("/api/users").status_code == 401
        with server.client("setting-token-0123456789") as http:
            assert http.get("/api/runs").status_code == 200  # LOOMFLOW_CONSOLE_TOKEN: admin
    # The newline a secrets file ends with is no part of the token (it made every bearer a
    # 401), nor is a space pasted into the form around it.
    settings = Settings(runtime_url=deployment.url, console_token="setting-token-0123456789\n")
    with Server(settings, ConsoleOptions()) as server:
        with server.client("setting-token-0123456789") as http:
            assert http.get("/api/runs").status_code == 200
        with server.client() as http:
            typed = {"token": " setting-token-0123456789 "}
            assert http.post("/signin", data=typed, follow_redirects=False).status_code == 303
    with pytest.raises(ConfigurationError, match="without the whitespace"):
        build_console(
            Settings(runtime_url=deployment.url, console_token=" " * 20), ConsoleOptions()
        )


def test_the_console_adds_no_tables(console: Server, deployment: Deployment) -> None:
    with console.client(ADMIN) as http:
        for route in ROUTES:
            http.get("/api" + route)
    assert tables(deployment.root / "journal.db") == deployment.tables


def test_the_command_binds_localhost_and_changes_no_tables(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        await store.append(AuditRecord(user_id="u", actor="t", action="x"))
        await store.close()

    asyncio.run(make())
    before = tables(path)
    from console_helpers import free_port

    port = free_port()
    # The code under test, wherever it is imported from here (a checkout on PYTHONPATH).
    code = str(Path(loomflow.__file__).parent.parent)
    env = {"LOOMFLOW_CONSOLE_TOKEN": ADMIN, "PATH": "/usr/bin:/bin", "PYTHONPATH": code}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loomflow.cli",
            "--url",
            f"sqlite:///{path}",
            "console",
            "--port",
            str(port),
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/" in line
        import httpx

        for _ in range(100):
            try:
                got = httpx.get(
                    f"http://127.0.0.1:{port}/api/users",
                    headers={"Authorization": f"Bearer {ADMIN}"},
                )
                break
            except httpx.ConnectError:
                import time

                time.sleep(0.1)
        assert got.status_code == 200
        # "u", and the console's own chain, where that very query was recorded.
        assert [u["user_id"] for u in got.json()["users"]] == ["console:console-token", "u"]
        # No journal in this database: the runs page says so rather than failing.
        runs = httpx.get(
            f"http://127.0.0.1:{port}/api/runs", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert runs.status_code == 400
        assert "journal" in runs.json()["error"]
        # A client on 127.0.0.1 could name any address it liked for its failed sign-in.
        forged = httpx.get(
            f"http://127.0.0.1:{port}/api/users",
            headers={"Authorization": "Bearer not-a-token", "X-Forwarded-For": "203.0.113.9"},
        )
        assert forged.status_code == 401
    finally:
        proc.terminate()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()
    assert tables(path) == before  # no journal tables: the console made none

    async def failures() -> list[Any]:
        store = SqliteAuditStore(path)
        try:
            return [e.payload async for e in store.entries(user_id="console:(unknown)")]
        finally:
            await store.close()

    assert [p["clients"] for p in asyncio.run(failures())] == [["127.0.0.1"]]
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "loomflow.cli",
            "--url",
            f"sqlite:///{tmp_path / 'typo.db'}",
            "console",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode == 1
    assert "no audit log at" in missing.stderr
    assert not (tmp_path / "typo.db").exists()
    nobody = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", "console"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert nobody.returncode == 1
    assert "needs a way in" in nobody.stderr
    assert "console on http" not in nobody.stderr  # never announced: it could not serve


def test_a_tampered_trail_fails_verification_on_the_page(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        await store.append(
            [AuditRecord(user_id="eve", actor="t", action="x", payload={"n": n}) for n in range(3)]
        )
        await store.close()

    asyncio.run(make())
    with sqlite3.connect(path) as db:  # someone with write access to the file
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        db.execute("""UPDATE loom_audit SET payload = '{"n":99}' WHERE seq = 2""")
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        report = http.get("/api/users/eve", params={"verify": 1}).json()["verify"]
        assert report["ok"] is False
        assert [(p["kind"], p["seq"]) for p in report["problems"]] == [("edited", 2)]
        page = http.get("/users/eve", params={"verify": 1}).text
        assert "Chain verification FAILED" in page
        assert "entry 2 was changed" in page
        everyone = http.get("/api/verify").json()
        assert everyone["ok"] is False
        assert "FAILED" in http.get("/verify").text
        # The console's own chain, written while looking, verifies.
        mine = http.get("/api/users/console:console-token", params={"verify": 1}).json()
        assert mine["verify"]["ok"] is True


def _audit_db(folder: Path, records: list[AuditRecord]) -> Path:
    """A SQLite audit log in ``folder`` holding ``records``, appended one by one."""
    path = folder / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        for record in records:
            await store.append(record)
        await store.close()

    asyncio.run(make())
    return path


def test_an_exported_row_with_an_unreadable_payload_verifies_as_unreadable(
    tmp_path: Path,
) -> None:
    # The export carried {"unreadable_payload": ...} where the hashed payload was, and
    # verify --file called the entry edited; the page's verify says unreadable, as now does
    # the export's, in its place and alone.
    path = _audit_db(
        tmp_path,
        [AuditRecord(user_id="eve", actor="t", action="x", payload={"n": n}) for n in range(3)],
    )
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        db.execute("UPDATE loom_audit SET payload = ? WHERE seq = 2", (b"\xff{",))
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        shown = http.get("/api/users/eve", params={"verify": 1}).json()["verify"]
        assert [(p["kind"], p["seq"]) for p in shown["problems"]] == [("unreadable", 2)]
        for params in ({"user": "eve"}, {"user": "eve", "limit": 10}):
            lines = http.get("/api/export", params=params).text.splitlines()
            report = verify_lines(lines, user_id="eve")
            assert [(p.kind, p.seq, p.position) for p in report.problems] == [
                ("unreadable", 2, 3)  # the header is line 1
            ], report.problems


def found_in(http: httpx.Client, search: str) -> list[Any]:
    return [u["user_id"] for u in http.get("/api/users", params={"q": search}).json()["users"]]


def test_the_search_does_not_take_a_head_rows_word_for_its_user(tmp_path: Path) -> None:
    # The users page listed whoever a head row's user column named: edited to "mallory",
    # alice's trail was hidden from a search for her and listed as mallory's; a head row
    # under a made-up key listed a user with entries that do not exist.
    users = ("alice", "alice", "alice", "bob", "carol")
    path = _audit_db(tmp_path, [AuditRecord(user_id=u, actor="t", action="x") for u in users])
    with sqlite3.connect(path) as db:  # someone with write access to the file
        db.execute("DROP TRIGGER IF EXISTS loom_audit_heads_forward")
        db.execute("""UPDATE loom_audit_heads SET user_id = 'mallory' WHERE user_id = 'alice'""")
        db.execute(
            """UPDATE loom_audit_heads SET user_key = '"ghost"', user_id = 'ghost'
            WHERE user_id = 'carol'"""
        )
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:

        def found(search: str) -> list[tuple[Any, ...]]:
            users = http.get("/api/users", params={"q": search}).json()["users"]
            return [(u["user_id"], u["entries"], u["url"], u["problem"]) for u in users]

        assert found("alice") == [("alice", 3, "/users/alice", None)]
        assert found("mallory") == []
        assert found("bob") == [("bob", 1, "/users/bob", None)]
        [(user, entries, _, problem)] = found("ghost")
        assert (user, entries) == ("ghost", 1)
        assert "none is stored under this user" in problem
        page = http.get("/users", params={"q": "ghost"}).text
        assert "Not borne out by the trail" in page
    # A head whose user is no id (a control character) made the whole search a 400; one whose
    # user column holds no text (SQLite keeps bytes in it) made it a 500.
    with sqlite3.connect(path) as db:
        db.execute(
            """INSERT INTO loom_audit_heads VALUES ('"a\\nb"', 'a' || char(10) || 'b', 1, 'x')"""
        )
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        [listed] = http.get("/api/users", params={"q": "a\nb"}).json()["users"]
        assert "no id an entry can have" in listed["problem"]
        assert found_in(http, "alice") == ["alice"]
    with sqlite3.connect(path) as db:
        db.execute("""INSERT INTO loom_audit_heads VALUES ('"5"', X'35', 1, 'x')""")
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        # It was a 400 for everyone (see the test below): now that user alone is flagged.
        got = http.get("/api/users")
        assert got.status_code == 200, got.text[:300]
        [five] = [u for u in got.json()["users"] if u["user_id"] == "5"]
        assert five["entries"] is None
        assert "user_id is b'5', not text" in five["problem"]
        assert found_in(http, "alice") == ["alice"]


def test_one_damaged_head_row_does_not_hide_every_other_user(tmp_path: Path) -> None:
    # A head row edited by hand (text in its seq) made the users page a 400 for everyone: a
    # compliance officer could find no user at all. Now the others are listed, and that user
    # is flagged, with no entry count the row could vouch for; as is a head whose key names
    # no user, and a damaged head of the runs without a user.
    users = ("alice", "bob", "eve", "eve", None)
    path = _audit_db(tmp_path, [AuditRecord(user_id=u, actor="t", action="x") for u in users])
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_heads_forward")
        db.execute("""UPDATE loom_audit_heads SET seq = 'x' WHERE user_key = '"eve"'""")
        db.execute("""UPDATE loom_audit_heads SET seq = -3 WHERE user_key = '"bob"'""")
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        for search in ("", "e"):
            got = http.get("/api/users", params={"q": search})
            assert got.status_code == 200, got.text[:300]
            listed = {u["user_id"]: u for u in got.json()["users"]}
            assert listed["alice"]["problem"] is None
            eve = listed["eve"]
            assert (eve["entries"], eve["url"]) == (None, "/users/eve")
            assert "seq is 'x', not a whole number" in eve["problem"]
            if not search:
                assert "counts -3 entries" in listed["bob"]["problem"]
        assert {None, "console:console-token"} <= set(found_in(http, ""))
        page = http.get("/users")
        assert page.status_code == 200
        assert "Damaged head row" in page.text
        assert "seq is &#39;x&#39;, not a whole number" in page.text
    with sqlite3.connect(path) as db:
        db.execute("""UPDATE loom_audit_heads SET seq = 1.5 WHERE user_key = 'null'""")
        db.execute("""INSERT INTO loom_audit_heads VALUES (X'22ff22', 'zed', 1, 'x')""")
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/users")
        assert got.status_code == 200, got.text[:300]
        listed = got.json()["users"]
        # The runs without a user first, flagged; the key that names no one last, unlinked.
        assert listed[0]["user_id"] is None
        assert "seq is 1.5, not a whole number" in listed[0]["problem"]
        assert (listed[-1]["user_id"], listed[-1]["url"], listed[-1]["entries"]) == (
            None,
            None,
            None,
        )
        assert "user key is not text" in listed[-1]["problem"]
        assert [u["user_id"] for u in listed[1:-1]] == [
            "alice",
            "bob",
            "console:console-token",
            "eve",
        ]
        page = http.get("/users")
        assert page.status_code == 200
        assert "(a head row naming no user)" in page.text
        assert found_in(http, "zed") == []  # a head row's word is not taken for a user


def test_a_damaged_head_row_under_a_key_naming_no_user_is_listed_not_dropped(
    tmp_path: Path,
) -> None:
    # A head row under a text key that is no user's trail key ('garbage', '5', '"eve" ')
    # with text in its seq was filed under the runs without a user, then left off the users
    # page (which lists that bucket by its own head): the damage showed nowhere, and
    # iter_heads blamed the anonymous user. It is listed last, unlinked, as a blob key is.
    path = _audit_db(tmp_path, [AuditRecord(user_id=u, actor="t", action="x") for u in ("eve",)])
    with sqlite3.connect(path) as db:
        for key in ("garbage", "5", '"eve" '):
            db.execute("INSERT INTO loom_audit_heads VALUES (?, 'zed', 'x', 'h')", (key,))
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/users")
        assert got.status_code == 200, got.text[:300]
        listed = got.json()["users"]
        assert [u["user_id"] for u in listed] == ["console:console-token", "eve", None, None, None]
        for row in listed[2:]:
            assert (row["url"], row["entries"]) == (None, None)
            assert "names no user's trail" in row["problem"]
        assert found_in(http, "eve") == ["eve"]  # '"eve" ' is not taken for eve
        assert http.get("/users").text.count("(a head row naming no user)") == 3

    async def heads() -> None:
        store = SqliteAuditStore(path)
        try:
            with pytest.raises(AuditIntegrityError) as caught:
                [head async for head in store.iter_heads()]
            assert "anonymous" not in str(caught.value)
            report = await store.verify()  # named as rows of no user, not as the bucket's head
            assert sum("names no user's trail" in p.detail for p in report.problems) == 3
            assert "head_mismatch" not in {p.kind for p in report.problems}
        finally:
            await store.close()

    asyncio.run(heads())


def test_the_search_finds_ids_not_the_word_none(tmp_path: Path) -> None:
    # The runs without a user (no id) were matched as the text "None": a search for "no",
    # "ne" or "none" listed them, though no id contains it, and a search for "a" did not.
    records = [AuditRecord(user_id=u, actor="t", action="x") for u in (None, "nora", "al")]
    path = _audit_db(tmp_path, records)
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        everyone = found_in(http, "")  # no search: everyone, the bucket first
        assert everyone == [None, "al", "console:console-token", "nora"]
        assert found_in(http, "no") == ["nora"]
        assert found_in(http, "NONE") == []
        assert found_in(http, "ne") == []
        assert "(runs without a user)" not in http.get("/users", params={"q": "n"}).text


def _eve_with_a_text_seq(folder: Path) -> Settings:
    """Settings over an audit log where eve's entry 2 has text in its seq (a hand edit)."""
    path = _audit_db(folder, [AuditRecord(user_id="eve", actor="t", action="x")] * 3)
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        db.execute("UPDATE loom_audit SET seq = 'two' WHERE seq = 2")
    return Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)


def test_a_users_first_row_damaged_is_not_called_a_trail_with_no_entries(tmp_path: Path) -> None:
    # With a query going on past damaged rows, the users page read eve's first row, edited
    # into no entry, as no row at all and said her head was edited or her entries deleted:
    # an investigation pointed at the wrong damage.
    path = _audit_db(tmp_path, [AuditRecord(user_id="eve", actor="t", action="x")] * 3)
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        db.execute("UPDATE loom_audit SET seq = 'one' WHERE seq = 1")
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/users", params={"q": "eve"})
        assert got.status_code == 200, got.text[:300]
        [eve] = got.json()["users"]
        assert "none is stored" not in eve["problem"]
        assert "its first entry cannot be read" in eve["problem"]
        assert "seq is 'one', not a whole number" in eve["problem"]


def test_an_export_over_a_malformed_row_marks_it_in_place_as_the_cli_does(
    tmp_path: Path,
) -> None:
    # The admin export refused a trail (and a page of it) holding one row with text in its
    # seq: a 400, nothing downloaded, where `loomflow audit export` writes the readable
    # entries and marks the row in its place. The console now hands out the same lines.
    settings = _eve_with_a_text_seq(tmp_path)
    export = ["audit", "export", "--user", "eve", "--no-progress"]
    cli = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", settings.runtime_url, *export],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cli.returncode == 3, cli.stderr
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        for path in ("/api/export", "/export"):
            got = http.get(path, params={"user": "eve"})
            assert got.status_code == 200, got.text[:300]
            assert got.text == cli.stdout  # the marker too, byte for byte
        lines = [json.loads(line) for line in cli.stdout.splitlines()[1:]]
        assert [(line.get("seq"), "hash" in line, line.get("row")) for line in lines] == [
            (1, True, None),
            (None, False, 2),
            (3, True, None),
        ]
        assert "seq is 'two', not a whole number" in lines[1]["unreadable"]
        page = http.get("/api/export", params={"user": "eve", "limit": 10})
        assert page.status_code == 200, page.text[:300]
        assert page.text.splitlines()[1:] == cli.stdout.splitlines()[1:]
        report = verify_lines(page.text.splitlines(), user_id="eve")
        assert "unreadable" in {p.kind for p in report.problems}
        # The heads still say what verify says of the chain.
        assert http.get("/api/export/heads", params={"user": "eve"}).json()["ok"] is False


def test_a_trail_with_a_malformed_row_lists_the_rest_and_names_it(tmp_path: Path) -> None:
    # A trail holding a hand-edited row answered 400 (the page's entries could not be read)
    # unless its verification was asked for, where `loomflow audit query` lists the readable
    # entries and names the row. The page now lists them and warns of the row; the JSON
    # names it in "damaged", as the CLI's --json does.
    settings = _eve_with_a_text_seq(tmp_path)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        for params in ({}, {"verify": 1}):
            got = http.get("/api/users/eve", params=params)
            assert got.status_code == 200, got.text[:300]
            body = got.json()
            assert [e["seq"] for e in body["entries"]] == [1, 3]
            assert [(d["kind"], d["seq"], d["position"]) for d in body["damaged"]] == [
                ("unreadable", None, 2)
            ]
            assert "seq is 'two', not a whole number" in body["damaged"][0]["detail"]
            page = http.get("/users/eve", params=params)
            assert page.status_code == 200
            assert 'id="damaged"' in page.text
            assert "row 2, entry ?" in page.text
            assert 'id="entries"' in page.text
        assert body["verify"]["ok"] is False
        assert ("unreadable", None) in [(p["kind"], p["seq"]) for p in body["verify"]["problems"]]
        assert "Chain verification FAILED" in page.text
        # An intact trail's answer is as it was: no "damaged" key, no warning.
        mine = http.get("/api/users/console:console-token").json()
        assert "damaged" not in mine
        assert 'id="damaged"' not in http.get("/users/console:console-token").text


def _edit_row(path: Path, change: str, where: str) -> int:
    """Edit the audit row ``where`` selects by hand (``SET change``); its row id."""
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        row = int(db.execute(f"SELECT id FROM loom_audit WHERE {where}").fetchone()[0])
        db.execute(f"UPDATE loom_audit SET {change} WHERE id = ?", (row,))
    return row


def _eve_run(run_id: str, secret: str) -> list[AuditRecord]:
    """Three entries of eve's run ``run_id``; the payload of the second holds ``secret``."""
    return [
        AuditRecord(
            user_id="eve",
            session_id="s-1",
            run_id=run_id,
            actor="t",
            action=action,
            payload={"tool": "lookup", "note": secret if n == 1 else "plain"},
        )
        for n, action in enumerate(("run.start", "tool.call", "run.end"))
    ]


def test_a_run_with_a_malformed_row_tells_the_rest_and_marks_it(tmp_path: Path) -> None:
    # The run page read the run's entries with entries(), which raises at a row that reads as
    # no entry: a run holding one hand-edited row was a 400, where the export marks the row
    # in its place and goes on. Now the run is told, the row marked where it stood (nothing of
    # its content), and the page says the user's trail fails verification.
    path = _audit_db(tmp_path, [*_eve_run("r-1", "kiwi-4411"), *_eve_run("r-2", "plain")])
    row = _edit_row(path, "seq = 'two'", "seq = 2")
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/run", params={"user": "eve", "run": "r-1"})
        assert got.status_code == 200, got.text[:300]
        story = got.json()
        assert [e["seq"] for e in story["entries"]] == [1, 3]
        assert [(d["kind"], d["seq"], d["position"]) for d in story["damaged"]] == [
            ("unreadable", None, row)
        ]
        assert "seq is 'two', not a whole number" in story["damaged"][0]["detail"]
        assert story["verify"]["ok"] is False
        assert "unreadable" in {p["kind"] for p in story["verify"]["problems"]}
        assert "kiwi-4411" not in got.text
        page = http.get("/run", params={"user": "eve", "run": "r-1"})
        assert page.status_code == 200
        text = page.text
        assert "kiwi-4411" not in text
        assert f"Unreadable row {row}: " in text
        assert "Chain verification of this user's trail FAILED" in text
        # In its place: after entry 1, before entry 3.
        assert text.index('seq=1"') < text.index("Unreadable row") < text.index('seq=3"')
        # A run with no damaged row answers as it did: no "damaged", no verification.
        other = http.get("/api/run", params={"user": "eve", "run": "r-2"}).json()
        assert [e["seq"] for e in other["entries"]] == [4, 5, 6]
        assert "damaged" not in other
        assert "verify" not in other
        intact = http.get("/run", params={"user": "eve", "run": "r-2"}).text
        assert 'id="verification"' not in intact
        assert '<a href="/users/eve?verify=1" id="verify">' in intact  # checked on request


@pytest.mark.postgres
def test_a_run_with_an_unreadable_payload_on_postgresql_is_flagged_and_verified(
    pg_dsn: str,
) -> None:
    # On PostgreSQL a hand edit leaves rows typed, but a payload edited into no JSON reads as
    # an entry marked unreadable: the run page listed it as any other, with no word of the
    # damage and no verification. It is marked in its row now, and the trail is verified.
    settings = Settings(runtime_url=pg_dsn, console_token=ADMIN)

    async def make() -> None:
        async with Stores(settings) as stores:
            await stores.migrate()
            await stores.audit.append(_eve_run("r-1", "kiwi-4411"))
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute("SET session_replication_role = replica")  # triggers off
            await conn.execute(
                """UPDATE loom_audit SET payload = '{"note": "kiwi-4411"' """
                """WHERE user_key = '"eve"' AND seq = 2"""
            )
        finally:
            await conn.close()

    asyncio.run(make())
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/run", params={"user": "eve", "run": "r-1"})
        assert got.status_code == 200, got.text[:300]
        story = got.json()
        assert [e["seq"] for e in story["entries"]] == [1, 2, 3]
        assert "damaged" not in story  # no row that reads as no entry
        assert "unreadable payload" in story["entries"][1]["unreadable"]
        assert story["verify"]["ok"] is False
        assert ("unreadable", 2) in [(p["kind"], p["seq"]) for p in story["verify"]["problems"]]
        page = http.get("/run", params={"user": "eve", "run": "r-1"}).text
        assert "Unreadable payload: entry 2 has an unreadable payload" in page
        assert "Chain verification of this user's trail FAILED" in page
        assert "kiwi-4411" not in page


def test_an_entry_is_looked_up_by_its_seq_not_found_by_walking_the_trail(
    tmp_path: Path,
) -> None:
    # The entry page read the trail from its first entry until it met the seq: the last
    # entry of a 200,000-entry trail took half a minute, a malformed row before the one
    # asked for made it a 400, and a row moved out of order hid the entry (404).
    settings = _eve_with_a_text_seq(tmp_path)
    path = Path(settings.runtime_url.removeprefix("sqlite:///"))
    asyncio.run(_append(path, [AuditRecord(user_id="ray", actor="t", action="x")] * 3))
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        db.execute("""UPDATE loom_audit SET id = id + 1000 WHERE user_key = '"ray"' AND seq = 2""")
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/entry", params={"user": "eve", "seq": 3})
        assert got.status_code == 200, got.text[:300]
        assert got.json()["seq"] == 3
        got = http.get("/api/entry", params={"user": "ray", "seq": 2})
        assert got.status_code == 200, got.text[:300]
        assert got.json()["seq"] == 2
        for seq in (4, 9223372036854775807, 9999999999999999999):
            assert http.get("/api/entry", params={"user": "ray", "seq": seq}).status_code == 404


def test_an_entry_whose_row_reads_as_no_entry_is_marked_not_a_400(tmp_path: Path) -> None:
    # The entry page answered 400 for a row with bytes in its actor column, as if the asker
    # had sent a bad request. It names the row now and marks it, as the export's line does.
    records = [AuditRecord(user_id="eve", actor="t", action="x", payload={"n": "kiwi-77"})] * 3
    path = _audit_db(tmp_path, records)
    row = _edit_row(path, "actor = X'ff00'", "seq = 2")
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/entry", params={"user": "eve", "seq": 2})
        assert got.status_code == 200, got.text[:300]
        marker = got.json()
        assert (marker["row"], marker["user_id"], marker["seq"]) == (row, "eve", 2)
        assert "actor is stored as bytes, not text" in marker["unreadable"]
        assert "hash" not in marker
        page = http.get("/entry", params={"user": "eve", "seq": 2})
        assert page.status_code == 200
        assert f"Unreadable row {row}: " in page.text
        assert "kiwi-77" not in page.text + got.text
        assert http.get("/api/entry", params={"user": "eve", "seq": 3}).json()["seq"] == 3


async def _append(path: Path, records: list[AuditRecord]) -> None:
    store = SqliteAuditStore(path)
    for record in records:
        await store.append(record)
    await store.close()


def test_a_malformed_head_row_is_a_problem_verify_reports_not_an_error(tmp_path: Path) -> None:
    # One head row edited into no number made `loomflow audit verify` and the console's
    # "Verify all" an error: no report at all, so the damage elsewhere in the log (zed's
    # edited entry here) went unreported with it.
    path = _audit_db(
        tmp_path, [AuditRecord(user_id=u, actor="t", action="x") for u in ("eve", "eve", "zed")]
    )
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_heads_forward")
        db.execute("""UPDATE loom_audit_heads SET seq = 'x' WHERE user_key = '"eve"'""")
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        db.execute("""UPDATE loom_audit SET payload = '{"n": 1}' WHERE user_key = '"zed"'""")
    expected = {("eve", "head_mismatch"), ("zed", "edited")}
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/verify")
        assert got.status_code == 200, got.text[:300]
        problems = got.json()["problems"]
        assert expected <= {(p["user_id"], p["kind"]) for p in problems}, problems
        assert "seq" in next(p["detail"] for p in problems if p["kind"] == "head_mismatch")
        page = http.get("/verify").text
        assert "Verification FAILED" in page
        assert "<td>None</td>" not in page  # a problem of no seq (or of no user) shows "-"
        mine = http.get("/api/users/eve", params={"verify": 1}).json()["verify"]
        assert ("eve", "head_mismatch") in {(p["user_id"], p["kind"]) for p in mine["problems"]}
    cli = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "audit", "verify", "--json", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "LOOMFLOW_RUNTIME_URL": settings.runtime_url},
    )
    assert cli.returncode == 1, cli.stderr
    report = json.loads(cli.stdout)
    assert expected <= {(p["user_id"], p["kind"]) for p in report["problems"]}


def test_ages_and_bad_filters(console: Server) -> None:
    with console.client(ADMIN) as http:
        recent = http.get("/api/users/bob", params={"since": "1d", "limit": 100}).json()
        assert recent["entries"]  # written minutes ago
        assert http.get("/api/users/bob", params={"until": "1d"}).json()["entries"] == []
        bad = http.get("/api/export", params={"user": BOB, "session": "a\x00b"})
        assert bad.status_code == 400
        assert "session_id" in bad.json()["error"]
        # An entry's seq is written as the address shows it, not as int() would read it
        # (" 1", "1_0", Arabic-Indic digits, thousands of digits were all taken).
        assert http.get("/api/entry", params={"user": BOB, "seq": "10"}).json()["seq"] == 10
        for seq in (" 1", "1_0", "\u0661", "9" * 400, "-1", "1.0", ""):
            got = http.get("/api/entry", params={"user": BOB, "seq": seq})
            assert got.status_code == 400, seq
            assert got.json()["error"] == "seq must be a whole number"
        assert http.get("/api/verify").json()["ok"] is True


def test_times_out_of_range_are_a_400_naming_the_filter(console: Server) -> None:
    hostile = [
        ("since", "999999d"),
        ("until", "99999999999d"),
        ("since", "9" * 5000 + "d"),
        ("since", "9999-12-31T23:59:59-12:00"),  # year 10000 once in UTC
        ("until", "0001-01-01T00:00:00+05:00"),  # year 0 once in UTC
    ]
    routes = [
        ("/users/bob", {}),
        ("/trail", {"user": BOB}),
        ("/export", {"user": BOB}),
        ("/export", {"user": BOB, "limit": "25"}),
    ]
    with console.client(ADMIN) as http:
        for name, value in hostile:
            for route, extra in routes:
                params = extra | {name: value}
                api = http.get("/api" + route, params=params)
                assert api.status_code == 400, (route, name, value, api.text[:200])
                error = api.json()["error"]
                assert error.startswith(f"{name}: "), error
                assert "out of range" in error, error
                page = http.get(route, params=params)
                assert page.status_code == 400, (route, name, value)
                assert f"{name}: " in page.text
                assert "out of range" in page.text
                assert len(page.text) < 20_000  # the 5000 digits are not echoed back whole
        # The longest age there is, and the ends of the calendar, are fine.
        for name, value in (("since", "365000d"), ("since", "0001-01-01"), ("until", "9999-12-31")):
            assert http.get("/api/users/bob", params={name: value}).status_code == 200, value
        assert http.get("/api/verify").json()["ok"] is True


def test_a_time_range_that_selects_nothing_is_a_400_as_in_the_cli(console: Server) -> None:
    # "since 7d until 30d" read as "from a week back to a month back" selects nothing: an
    # empty page (or an export of no entries) would pass for a trail with nothing in that time.
    routes = [
        ("/users/bob", {}),
        ("/trail", {"user": BOB}),
        ("/export", {"user": BOB}),
        ("/export", {"user": BOB, "limit": "25"}),
    ]
    ranges = [
        {"since": "7d", "until": "30d"},
        {"since": "2026-06-01", "until": "2026-06-01"},
        {"since": "2026-06-02", "until": "2026-06-02T01:00:00+02:00"},  # 06-01 23:00 UTC
    ]
    with console.client(ADMIN) as http:
        for window in ranges:
            for route, extra in routes:
                api = http.get("/api" + route, params=extra | window)
                assert api.status_code == 400, (route, window, api.text[:200])
                assert api.json()["error"].startswith("since ("), api.json()
                assert "is not before until" in api.json()["error"]
                page = http.get(route, params=extra | window)
                assert page.status_code == 400, (route, window)
                assert "is not before until" in page.text
        # A range the right way round is served.
        fine = {"since": "30d", "until": "0d"}
        assert http.get("/api/users/bob", params=fine).json()["entries"]


FORGOTTEN = "forget-me-7731"  # not an email: the redactor would hide that one itself


def _forget_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOOMFLOW_RUNTIME_URL": settings.runtime_url}
    if settings.audit_url:
        env["LOOMFLOW_AUDIT_URL"] = settings.audit_url
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "users", "forget", *args, "--yes", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def _raw(folder: Path) -> bytes:
    """Every byte SQLite or the JSON-lines store left on disk (WAL and heads included)."""
    return b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())


def test_a_forget_erases_a_refused_request_about_the_user(tmp_path: Path) -> None:
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}", console_token=ADMIN)

    async def make() -> None:
        async with Stores(settings) as stores:
            await stores.migrate()
        for i, user in enumerate((FORGOTTEN, BOB)):
            await run_agent(settings, user, f"s-{i}")

    asyncio.run(make())
    (tmp_path / "tokens").write_text(f"reader {READER} rob\n", encoding="utf-8")
    with (
        Server(settings, ConsoleOptions(tokens_file=tmp_path / "tokens")) as server,
        server.client(READER) as http,
    ):
        for route, user in (("/api/export", FORGOTTEN), ("/export/heads", FORGOTTEN),
                            ("/api/export", BOB)):  # fmt: skip
            assert http.get(route, params={"user": user}).status_code == 403

    async def refused() -> list[Any]:
        async with Stores(settings, journal=False) as stores:
            return [e async for e in stores.audit.entries(user_id="console:rob")]

    before = [e for e in asyncio.run(refused()) if e.action == "console.refused"]
    assert [e.payload["viewed_user"] for e in before] == [FORGOTTEN, FORGOTTEN, BOB]
    done = _forget_cli(settings, FORGOTTEN)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["console_erased"] == 2
    after = asyncio.run(refused())
    assert [e.payload for e in after[:3]] == [None, None, before[2].payload]
    assert after[-1].action == "audit.erasure"
    assert after[-1].payload is not None
    assert after[-1].payload["seqs"] == [before[0].seq, before[1].seq]
    assert all(FORGOTTEN not in e.to_line() for e in after)

    async def verify() -> Any:
        async with Stores(settings, journal=False) as stores:
            return await stores.audit.verify()

    assert asyncio.run(verify()).ok


@pytest.mark.parametrize(
    "kind", ["sqlite", "jsonl", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_a_forget_erases_the_console_looks_at_the_user(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    if kind == "postgres":
        settings = Settings(runtime_url=request.getfixturevalue("pg_dsn"), console_token=ADMIN)
    else:
        settings = Settings(
            runtime_url=f"sqlite:///{store_dir / 'journal.db'}",
            audit_url=f"jsonl:///{store_dir / 'audit.jsonl'}" if kind == "jsonl" else None,
            console_token=ADMIN,
        )

    async def make() -> dict[str, str]:
        async with Stores(settings) as stores:
            await stores.migrate()
        return {u: await run_agent(settings, u, f"s-{i}") for i, u in enumerate((FORGOTTEN, BOB))}

    runs = asyncio.run(make())
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        looks = [
            ("/api" + user_url(FORGOTTEN), {}),
            (user_url(FORGOTTEN), {"since": "7d"}),
            ("/api/users", {"q": FORGOTTEN}),  # a search naming them
            ("/api/entry", {"user": FORGOTTEN, "seq": "1"}),
            ("/api/run", {"user": FORGOTTEN, "run": runs[FORGOTTEN]}),
            ("/api/export", {"user": FORGOTTEN}),
            ("/api/export/heads", {"user": FORGOTTEN}),
        ]
        for route, params in looks:
            assert http.get(route, params=params).status_code == 200, route
        assert http.get("/api" + user_url(BOB)).status_code == 200
        assert http.get("/api/users", params={"q": "forget"}).status_code == 200  # not the id
    chain = "console:console-token"

    async def read() -> list[Any]:
        async with Stores(settings, journal=False) as stores:
            return [e async for e in stores.audit.entries()]

    before = asyncio.run(read())
    if kind != "postgres":
        assert b'"viewed_user":"' + FORGOTTEN.encode() in _raw(store_dir)  # the bytes searched
    assert len([e for e in before if e.user_id == chain and FORGOTTEN in e.to_line()]) == 7

    # The console's own chain is the record of who looked at what: never forgotten.
    refused = _forget_cli(settings, chain)
    assert refused.returncode == 1, refused.stderr
    assert "loomflow: error: " in refused.stderr
    assert "console chain" in refused.stderr
    assert asyncio.run(read()) == before  # nothing deleted, nothing recorded

    done = _forget_cli(settings, FORGOTTEN)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["console_erased"] == 7

    after = asyncio.run(read())
    # The id is left only as the user id of the forgotten user's own (erased) entries.
    for entry in after:
        if entry.user_id != FORGOTTEN:
            assert FORGOTTEN not in entry.to_line(), entry.to_line()
        elif entry.action != "audit.erasure":
            assert entry.payload is None
    mine = [e for e in after if e.user_id == chain]
    record = mine[-1]
    assert record.action == "audit.erasure"
    assert record.payload is not None
    assert record.payload["entries"] == 7
    assert record.payload["reason"] == "forget"
    erased = [e.seq for e in mine if e.payload is None]
    assert record.payload["seqs"] == erased
    assert len(erased) == 7
    # Who looked at bob, and the search that did not name the user, are still on record.
    kept = [e.payload for e in mine if e.payload is not None and e.action == "console.query"]
    assert any(p.get("viewed_user") == BOB for p in kept)
    assert any(p.get("details") == {"search": "forget"} for p in kept)

    async def verify() -> Any:
        async with Stores(settings, journal=False) as stores:
            return await stores.audit.verify()

    report_ = asyncio.run(verify())
    assert report_.ok, report_.problems
    # A second forget finds nothing more to erase in the console's chain.
    again = _forget_cli(settings, FORGOTTEN)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["console_erased"] == 0
    if kind == "postgres":

        async def stored() -> list[Any]:
            conn = await asyncpg.connect(settings.runtime_url)
            try:
                return await conn.fetch(
                    "SELECT user_id, payload FROM loom_audit "
                    "WHERE strpos(payload, $1) > 0 OR (user_id <> $1 AND strpos(user_id, $1) > 0)",
                    FORGOTTEN,
                )
            finally:
                await conn.close()

        assert asyncio.run(stored()) == []
    else:
        needle = FORGOTTEN.encode()
        if kind == "jsonl":
            log = store_dir / "audit.jsonl"
            for line in log.read_bytes().splitlines():
                if needle in line:  # only on a line of their own, as its user id
                    stays = json.loads(line)
                    assert stays["user_id"] == FORGOTTEN
                    assert stays["payload"] is None or stays["action"] == "audit.erasure"
                    assert needle not in json.dumps(stays["payload"]).encode()
            log.unlink()
            for heads in store_dir.glob("audit.jsonl.heads"):  # their chain's head, no other
                recorded = json.loads(heads.read_bytes())
                recorded["users"].pop(json.dumps(FORGOTTEN))
                assert needle not in json.dumps(recorded).encode()
                heads.unlink()
        # In no JSON value anywhere on disk (a viewed user, a search), WAL pages included.
        assert b'":"' + needle not in _raw(store_dir)
        if kind == "sqlite":
            with sqlite3.connect(store_dir / "journal.db") as db:
                rows = db.execute(
                    "SELECT user_id FROM loom_audit WHERE instr(payload, ?) > 0", (FORGOTTEN,)
                ).fetchall()
            assert rows == []


@pytest.mark.postgres
def test_the_console_on_postgresql(pg_dsn: str) -> None:
    settings = Settings(runtime_url=pg_dsn, console_token=ADMIN)

    async def make() -> str:
        async with Stores(settings) as stores:
            await stores.migrate()
        return await run_agent(settings, HOSTILE, "s-pg")

    run_id = asyncio.run(make())
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        users = http.get("/api/users").json()["users"]
        assert HOSTILE in [u["user_id"] for u in users]
        trail = http.get("/api" + user_url(HOSTILE), params={"verify": 1}).json()
        assert trail["verify"]["ok"] is True
        assert {e["run_id"] for e in trail["entries"]} == {run_id}
        story = http.get("/api/run", params={"user": HOSTILE, "run": run_id}).json()
        assert story["state"] == "finished"
        assert story["executed"] >= 2
        runs = http.get("/api/runs").json()["runs"]
        assert [(r["user_id"], r["state"]) for r in runs] == [(HOSTILE, "finished")]
        assert "&lt;script&gt;" in http.get(user_url(HOSTILE)).text
        # An entry is looked up by its seq, one that no BIGINT holds included.
        entry = http.get("/api/entry", params={"user": HOSTILE, "seq": 2}).json()
        assert (entry["user_id"], entry["seq"]) == (HOSTILE, 2)
        for seq in (9223372036854775807, 9999999999999999999):
            got = http.get("/api/entry", params={"user": HOSTILE, "seq": seq})
            assert got.status_code == 404, got.text[:300]


def test_loomflow_settings_hides_the_console_secrets(tmp_path: Path) -> None:
    token, key = "settings-token-0123456789", "k" * 40
    env = {
        "PATH": "/usr/bin:/bin",
        "LOOMFLOW_CONSOLE_TOKEN": token,
        "LOOMFLOW_CONSOLE_SESSION_SECRET": key,
    }
    for args in ([], ["--json"]):
        shown = subprocess.run(
            [sys.executable, "-m", "loomflow.cli", "settings", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=tmp_path,
        )
        assert shown.returncode == 0, shown.stderr
        assert token not in shown.stdout
        assert key not in shown.stdout
        assert shown.stdout.count("(set, hidden)") >= 2


def test_an_address_the_console_cannot_listen_on_is_one_line(tmp_path: Path) -> None:
    import socket

    url = f"sqlite:///{tmp_path / 'j.db'}"
    env = {**os.environ, "LOOMFLOW_RUNTIME_URL": url, "LOOMFLOW_CONSOLE_TOKEN": ADMIN}
    subprocess.run([sys.executable, "-m", "loomflow.cli", "migrate"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args in (["--host", "999.1.1.1"], ["--port", str(port)]):
            done = subprocess.run(
                [sys.executable, "-m", "loomflow.cli", "console", *args],
                env=env, capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert done.returncode == 1, (args, done.stderr)
            assert done.stderr.startswith("loomflow: error: the console cannot listen on")
            assert done.stderr.count("\n") == 1, done.stderr  # not announced, then failed


def test_a_control_character_in_the_path_is_refused_before_routing(console: Server) -> None:
    # A route's pattern stops at a line feed, and matches before a final one: without the
    # check /api/users/bob%0A served bob's trail and /api/users/a%0Ab was a bare 404.
    with console.client(ADMIN) as http:
        for path in ("/api/users/bob%0A", "/api/users/a%0Ab", "/api/users/a%0Db", "/api/runs%0A",
                     "/api/entry%0A", "/api/users/a%00b"):  # fmt: skip
            got = http.get(path, params={"user": "bob", "seq": 1})
            assert got.status_code == 400, path
            assert "control character U+00" in got.json()["error"], path
            assert "default-src 'none'" in got.headers["content-security-policy"]
        page = http.get("/users/bob%0A")
        assert page.status_code == 400
        assert "bob" not in page.text.replace("U+000A", "")
        assert http.get("/api/users/bob").status_code == 200  # the id itself is served


def test_an_address_that_encodes_no_utf8_is_refused_not_read_as_another_id(
    console: Server,
) -> None:
    # %FF (or an encoded surrogate) was decoded to U+FFFD: the console served, and recorded
    # a look at, the trail of the user "\ufffd", whom the address never named.
    with console.client(ADMIN) as http:
        for path, query in (
            ("/api/users/%FF", ""),
            ("/api/users/%ED%A0%80", ""),
            ("/api/trail", "user=%FF"),
            ("/api/export", "user=bob&action=%ED%A0%80"),
            ("/api/users", "q=%C3"),
            ("/users/%FF", ""),
        ):
            got = http.get(path + ("?" + query if query else ""))
            assert got.status_code == 400, (path, query)
            assert "not UTF-8 text" in got.text, (path, query)
        assert http.get("/api/users/%C3%A9v%C3%A9").status_code == 200  # UTF-8 is an id
        assert http.get("/api/trail", params={"user": "\ufffd"}).status_code == 200


def test_the_viewed_user_is_recorded_as_named_even_when_it_looks_like_personal_data(
    console: Server, deployment: Deployment
) -> None:
    """The console's records redact what they carry, but not the user ids: "who has looked
    at alice@example.com?" must find its records (PII redaction is on by default)."""
    email, card = "alice@example.com", "4111111111111111"
    before = len(_audit(deployment, user_id="console:ada"))
    with console.client(ADMIN) as http:
        for user in (email, card):
            assert http.get("/api" + user_url(user)).status_code == 200
        assert http.get("/api/users", params={"q": email}).status_code == 200
    records = [e["payload"] for e in _audit(deployment, user_id="console:ada")[before:]]
    assert [p.get("viewed_user") for p in records[:2]] == [email, card]  # type: ignore[union-attr]
    assert records[2]["details"]["search"] == email  # type: ignore[index]


def test_the_console_and_audit_commands_refuse_a_database_without_an_audit_log(
    tmp_path: Path,
) -> None:
    """Reading the audit log of a journal-only database used to create its tables there
    (an empty console for an operator who forgot --audit-url, its records in the journal)."""
    path = tmp_path / "journal.db"

    async def journal_only() -> None:
        agent = Agent("x", model=ScriptedModel(["ok"]), runtime=SqliteRuntime(path), audit=None)
        await agent.run("hi", session_id="s", user_id="ana")

    asyncio.run(journal_only())
    before = tables(path)
    assert "loom_audit" not in before
    env = {**os.environ, "LOOMFLOW_CONSOLE_TOKEN": ADMIN, "PYTHONIOENCODING": "utf-8:strict"}
    for command in (["console", "--port", "1"], ["audit", "query"], ["audit", "verify"]):
        got = subprocess.run(
            [sys.executable, "-m", "loomflow.cli", "--url", f"sqlite:///{path}", *command],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert got.returncode == 1, (command, got.stderr)
        assert "holds no audit log" in got.stderr, command
    assert tables(path) == before


def test_a_tampered_hash_is_shown_escaped_and_a_store_failure_names_no_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.db"

    async def make() -> None:
        store = SqliteAuditStore(path)
        await store.append([AuditRecord(user_id="bob", actor="agent:x", action="run.start")])
        await store.close()

    asyncio.run(make())
    with sqlite3.connect(path) as db:  # a hand-edited row (the trigger dropped first)
        db.execute("DROP TRIGGER loom_audit_no_update")
        db.execute("UPDATE loom_audit SET hash = 'ab\u202ecd', prev_hash = 'p\u2028q'")
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        page = http.get("/entry", params={"user": "bob", "seq": 1})
        assert page.status_code == 200
        for raw in ("\u202e", "\u2028"):
            assert raw not in page.text
        assert "ab\\u202ecd" in page.text

    # An audit store that cannot be used: 503, with the detail in the log, not on the page.
    down = Settings(
        runtime_url=f"sqlite:///{path}", console_token=ADMIN,
        audit_url="postgresql://loomflow@127.0.0.1:1/audit",
    )  # fmt: skip
    with Server(down, ConsoleOptions()) as server, server.client(ADMIN) as http:
        got = http.get("/api/users")
        assert got.status_code == 503
        assert "127.0.0.1" not in got.text
        assert "StoreUnavailableError" in got.json()["error"]
        # A sign-in through the form is audited as a query is: when that cannot be written,
        # the same 503 (it was an untyped 500), and no cookie.
        form = http.post("/signin", data={"token": ADMIN})
        assert form.status_code == 503
        assert "StoreUnavailableError" in form.text
        assert "127.0.0.1" not in form.text
        assert form.headers["cache-control"] == "no-store"
        assert "loomflow_console" not in http.cookies


@pytest.mark.parametrize(
    "headers",
    [
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "https://evil.example"},
        {"Origin": "null"},
    ],
)
def test_a_form_post_from_another_site_is_refused(
    console: Server, deployment: Deployment, headers: dict[str, str]
) -> None:
    # Login CSRF: another site's page must not sign a browser in with the attacker's token,
    # nor sign it out.
    with console.client(follow_redirects=False) as http:
        forged = http.post("/signin", data={"token": READER}, headers=headers)
        assert forged.status_code == 403
        assert "set-cookie" not in forged.headers
        assert "Content-Security-Policy" in forged.headers
        assert http.post("/signout", headers=headers).status_code == 403
        # The console's own form (same origin, or a script that says nothing) still works.
        same = {"Sec-Fetch-Site": "same-origin", "Origin": console.base}
        assert http.post("/signin", data={"token": READER}, headers=same).status_code == 303
        assert http.post("/signin", data={"token": READER}).status_code == 303
        assert http.post("/signout", headers={"Origin": console.base}).status_code == 303


@pytest.mark.parametrize(
    "route",
    ["/api/export", "/api/export/heads", "/api/trail", "/api/entry?seq=1", "/api/run?run=x"],
)
def test_a_query_naming_a_user_and_the_anonymous_bucket_is_refused(
    console: Server, route: str
) -> None:
    # An export of ?user=bob&anonymous=1 used to be the anonymous bucket's, under bob's name.
    sep = "&" if "?" in route else "?"
    with console.client(ADMIN) as http:
        answer = http.get(f"{route}{sep}user=bob&anonymous=1")
        assert answer.status_code == 400
        assert "not both" in answer.json()["error"]


def test_a_journal_time_no_date_can_hold_is_shown_not_a_500(tmp_path: Path) -> None:
    # A hand-edited journal row (a time of 1e300 seconds, or one stored as text) once made the
    # runs page and the run's story a 500 while their JSON twins answered.
    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    settings = Settings(runtime_url=url, console_token=ADMIN)

    async def make() -> str:
        async with Stores(settings) as stores:
            await stores.migrate()
        return await run_agent(settings, "bob", "s-bob")

    run_id = asyncio.run(make())
    with sqlite3.connect(path) as db:
        db.execute("UPDATE loom_sessions SET updated_at = 1e300, owner = 'w\u202e1'")
        db.execute("UPDATE loom_entries SET created_at = 'abc'")
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        runs = http.get("/runs")
        assert runs.status_code == 200
        # Said to be unreadable (null in the JSON), never shown as if it were a time.
        assert "1e+300" not in runs.text
        assert "<td>unreadable</td>" in runs.text
        assert "w\\u202e1" in runs.text  # an owner is shown escaped, as ids are
        assert "\u202e" not in runs.text
        assert http.get("/api/runs").json()["runs"][0]["updated_at"] is None
        story = http.get("/run", params={"user": "bob", "run": run_id})
        assert story.status_code == 200
        assert '<table id="journal">' in story.text


def test_an_address_or_method_the_console_does_not_serve(console: Server) -> None:
    # Starlette's own 404 and 405 were text without the console's headers, even under /api/.
    with console.client(ADMIN) as http:
        for method, path, status in (
            ("GET", "/api/nope", 404),
            ("POST", "/api/users", 405),
            ("DELETE", "/api/export", 405),
        ):
            got = http.request(method, path)
            assert got.status_code == status
            assert "error" in got.json()
            assert got.headers["cache-control"] == "no-store"
            assert got.headers["content-security-policy"].startswith("default-src 'none'")
        assert "GET" in http.post("/api/users").headers["allow"]
        page = http.get("/nope")
        assert page.status_code == 404
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["content-type"].startswith("text/plain")
        # A trailing slash is no redirect built from the Host header the client sent.
        slashed = http.get("/runs/", headers={"host": "evil.example"}, follow_redirects=False)
        assert slashed.status_code == 404
        assert "evil.example" not in slashed.headers.get("location", "")
        assert slashed.headers["cache-control"] == "no-store"


def test_the_api_answers_401_to_anyone_not_signed_in_whatever_the_address(
    console: Server,
) -> None:
    # Unknown addresses under /api/ were a 404 (and a wrong method a 405) without a token,
    # where the real ones said 401: anyone could map the API.
    probes = [
        ("GET", "/api/nope"),
        ("GET", "/api"),
        ("GET", "/api/"),
        ("GET", "/api/..%2F..%2Fetc%2Fpasswd"),
        ("GET", "/api/admin' OR '1'='1"),
        ("GET", "/api/" + "x" * 5000),
        ("GET", "/api/%C3%A9v%C3%A9"),
        ("POST", "/api/users"),
        ("DELETE", "/api/export"),
    ]
    for token in (None, "not-a-token-at-all-0123456789"):
        with console.client(token) as http:
            for method, path in probes:
                got = http.request(method, path)
                assert got.status_code == 401, (token, method, path, got.status_code)
                assert got.headers["www-authenticate"] == "Bearer"
                assert got.json() == {"error": "sign in: send Authorization: Bearer <token>"}
                assert got.headers["cache-control"] == "no-store"
    with console.client(ADMIN) as http:  # signed in, the addresses that do not exist are 404
        assert http.get("/api/nope").status_code == 404
        assert http.get("/api").status_code == 404
        assert http.post("/api/users").status_code == 405


def test_a_run_without_a_session_is_not_given_another_runs_state(tmp_path: Path) -> None:
    # Entries of a run that name no session (an application's own records) were told with the
    # state and journal of the user's latest session: "finished", for a run never journaled.
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'journal.db'}", console_token=ADMIN)

    async def make() -> None:
        async with Stores(settings) as stores:
            await stores.migrate()
        await run_agent(settings, "bob", "s-bob")
        async with Stores(settings, journal=False) as stores:
            await stores.audit.append(
                AuditRecord(user_id="bob", run_id="r-app", actor="app", action="export.sent")
            )

    asyncio.run(make())
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        story = http.get("/api/run", params={"user": "bob", "run": "r-app"}).json()
        assert story["session_id"] is None
        assert story["state"] is None
        assert story["journal"] == []
        page = http.get("/run", params={"user": "bob", "run": "r-app"}).text
        assert "not in the journal" in page


def _bobs_runs(path: Path, *sessions: str) -> Settings:
    """A migrated journal at ``path`` with one finished run of bob in each session."""
    settings = Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)

    async def make() -> None:
        async with Stores(settings) as stores:
            await stores.migrate()
        for session in sessions:
            await run_agent(settings, "bob", session)

    asyncio.run(make())
    return settings


def test_runs_by_state_says_when_there_are_more_than_it_shows(tmp_path: Path) -> None:
    # The page lists the 500 most recent runs; past that it passed for every run there was.
    path = tmp_path / "journal.db"
    settings = _bobs_runs(path, "s-0")
    with sqlite3.connect(path) as db:  # 500 more finished runs, as the first one is stored
        row = db.execute("SELECT * FROM loom_sessions").fetchone()
        names = [d[0] for d in db.execute("SELECT * FROM loom_sessions").description]
        copies = []
        for n in range(1, 501):
            values = dict(zip(names, row, strict=True))
            # The key as the journal makes it (compact JSON): another spelling reads as a
            # row whose ids were edited away from its key.
            scope = json.dumps([f"s-{n}", "bob"], separators=(",", ":"))
            values |= {"scope": scope, "session_id": f"s-{n}"}
            copies.append(tuple(values[k] for k in names))
        marks = ", ".join("?" * len(names))
        db.executemany(f"INSERT INTO loom_sessions VALUES ({marks})", copies)
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        for query in ({}, {"state": "finished"}):
            listed = http.get("/api/runs", params=query).json()
            assert len(listed["runs"]) == 500
            assert listed["more"] is True
            assert 'id="more"' in http.get("/runs", params=query).text
        assert http.get("/api/runs", params={"state": "open"}).json() == {
            "runs": [],
            "more": False,
        }


def test_a_cost_that_sums_past_any_number_is_not_a_500(tmp_path: Path) -> None:
    # Two live model calls recorded at 1e308 each (a writer's nonsense, valid JSON) sum to inf,
    # which the JSON encoder refused: the run's JSON twin was a 500.
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'audit.db'}", console_token=ADMIN)

    async def make() -> None:
        async with Stores(settings, journal=False) as stores:
            await stores.audit.append(
                [
                    AuditRecord(
                        user_id="rich",
                        session_id="s",
                        run_id="r",
                        actor="agent:x",
                        action="model.call",
                        payload={"cost_usd": 1e308},
                    )
                    for _ in range(2)
                ]
            )

    asyncio.run(make())
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        story = http.get("/api/run", params={"user": "rich", "run": "r"})
        assert story.status_code == 200
        assert story.json()["cost_usd"] == "Infinity"
        assert http.get("/run", params={"user": "rich", "run": "r"}).status_code == 200


def test_the_users_page_lists_and_finds_users_past_the_first_page_of_heads(
    tmp_path: Path,
) -> None:
    # The heads are read a thousand at a time (the page shows 200): a search must still find
    # a user whose head is in a later page, and the anonymous bucket still comes first.
    settings = Settings(runtime_url=f"sqlite:///{tmp_path / 'audit.db'}", console_token=ADMIN)
    users = [None, *(f"user-{n:04}" for n in range(1300))]

    async def make() -> None:
        async with Stores(settings, journal=False) as stores:
            await stores.audit.append(
                [AuditRecord(user_id=u, actor="app", action="run.start") for u in users]
            )

    asyncio.run(make())
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        listed = http.get("/api/users").json()
        assert listed["more"] is True
        # The console's own chain (its looks) sorts among them.
        shown = [None, "console:console-token", *users[1:199]]
        assert [u["user_id"] for u in listed["users"]] == shown
        found = http.get("/api/users", params={"q": "USER-1250"}).json()
        assert [u["user_id"] for u in found["users"]] == ["user-1250"]
        assert found["more"] is False
        many = http.get("/api/users", params={"q": "user-12"}).json()
        assert [u["user_id"] for u in many["users"]] == [f"user-12{n:02}" for n in range(100)]
        assert http.get("/api/users", params={"q": "zzz"}).json() == {"users": [], "more": False}


@pytest.mark.postgres
def test_the_console_does_not_start_on_an_audit_database_it_cannot_open(
    tmp_path: Path, pg_dsn: str
) -> None:
    """A PostgreSQL database that does not exist (a typo in its name), or a server that does
    not answer, was announced as `loomflow console on http://...` and then served a 503 on
    every page, the reason only in a log line per request; every other command exits 1 with
    that one line, as the console does for a SQLite file that is not there."""
    gone = pg_dsn + "_gone"  # the same server, a database nobody created
    env = {**os.environ, "LOOMFLOW_CONSOLE_TOKEN": ADMIN}
    for url, audit in (
        (gone, None),
        (f"sqlite:///{tmp_path / 'j.db'}", "postgresql://x@127.0.0.1:1/audit"),
    ):
        port = str(free_port())
        command = [sys.executable, "-m", "loomflow.cli", "--url", url, "console", "--port", port]
        if audit is not None:
            command += ["--audit-url", audit]
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=30, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"the console started on {audit or url}: {exc.stderr!r}") from None
        assert done.returncode == 1, (url, done.stderr)
        assert "console on http" not in done.stderr
        assert done.stderr.startswith("loomflow: error:"), done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "j.db").exists()


def test_runs_by_state_keeps_the_unreadable_runs_it_lists(tmp_path: Path) -> None:
    """A session row edited into values no release writes is listed as `unreadable` (as `runs
    list` shows it); asking for those alone, as `runs list --state unreadable` does, was a 400
    saying the state must be one of the others."""
    path = tmp_path / "journal.db"
    settings = _bobs_runs(path, "s-ok", "s-edited")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE loom_sessions SET status = 'bogus' WHERE session_id = 's-edited'")
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        listed = http.get("/api/runs").json()["runs"]
        assert {(r["session_id"], r["state"]) for r in listed} == {
            ("s-ok", "finished"),
            ("s-edited", "unreadable"),
        }
        damaged = http.get("/api/runs", params={"state": "unreadable"})
        assert damaged.status_code == 200, damaged.text
        assert [r["session_id"] for r in damaged.json()["runs"]] == ["s-edited"]
        assert "s-edited" in http.get("/runs", params={"state": "unreadable"}).text
        refused = http.get("/api/runs", params={"state": "gone"})
        assert refused.status_code == 400
        assert "unreadable" in refused.json()["error"]


def test_a_value_no_id_can_hold_is_refused_before_it_is_recorded(
    console: Server, deployment: Deployment
) -> None:
    """Every look is written to the asker's chain, which can never be cleaned up, before the
    store checked what it named: a search, id, session, run or cursor of ~60 KB (what an
    address can carry) was kept in full in the entry of every such request, a 400 or not."""
    huge = "x" * 3000
    asked = [
        ("/api/users", {"q": huge}),
        ("/api" + user_url(huge), {}),
        ("/api/trail", {"user": huge}),
        ("/api/users/bob", {"session": huge}),
        ("/api/users/bob", {"cursor": "9" * 3000}),
        ("/api/entry", {"user": huge, "seq": "1"}),
        ("/api/run", {"user": BOB, "run": huge}),
        ("/api/export", {"user": huge}),
        ("/api/export", {"user": BOB, "session": huge}),
        ("/api/export/heads", {"user": huge}),
    ]
    for who, chain in ((ADMIN, "console:ada"), (READER, "console:rob")):
        before = len(_audit(deployment, user_id=chain))
        with console.client(who) as http:
            for route, params in asked:
                got = http.get(route, params=params)
                assert got.status_code == 400, (route, params.keys(), got.text)
                assert "x" * 100 not in got.text
        written = _audit(deployment, user_id=chain)[before:]
        assert written == [], [(e["action"], len(json.dumps(e["payload"]))) for e in written]
    with console.client(ADMIN) as http:  # a search as long as an id still runs
        assert http.get("/api/users", params={"q": "x" * 256}).json()["users"] == []


# What whoever edits the database by hand may put in a row: markup, a terminal escape, the
# characters that reorder or hide text, and DEL and a C1 control (which JSON may carry raw).
CRAFTED = '<script>alert(1)</script>"><img src=x onerror=alert(1)>\x1b[31m\u202e\u200b\x85\x7f'
_RAW = ("\x1b", "\u202e", "\u200b", "\x85", "\x7f")


def _eve_edited(folder: Path, *edits: tuple[str, tuple[Any, ...]]) -> Settings:
    """Settings over an audit log of eve's 3 entries (in run r1), then ``edits`` by hand."""
    records = [AuditRecord(user_id="eve", run_id="r1", actor="t", action="x")] * 3
    path = _audit_db(folder, records)
    with sqlite3.connect(path) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        for sql, args in edits:
            db.execute(sql, args)
    return Settings(runtime_url=f"sqlite:///{path}", console_token=ADMIN)


def test_the_json_of_a_crafted_row_is_utf8_with_no_raw_control_characters(
    tmp_path: Path,
) -> None:
    # A session id holding bytes that are not UTF-8 (SQLite keeps them in a text column) made
    # /api/users/eve, /api/entry, /api/run, /api/verify and the heads a 500: the encoder
    # cannot spell the lone surrogates they are read as. And DEL, C1 controls and the
    # characters that reorder or hide text went out raw, where the CLI's --json escapes them.
    settings = _eve_edited(
        tmp_path,
        ("UPDATE loom_audit SET session_id = CAST(X'ff3c623e' AS TEXT) WHERE seq = 2", ()),
        ("UPDATE loom_audit SET actor = ? WHERE seq = 3", (CRAFTED,)),
        ("UPDATE loom_audit SET user_id = CAST(X'fe' AS TEXT) WHERE seq = 1", ()),
    )
    routes = [
        ("/api/users/eve", {}),
        ("/api/users/eve", {"verify": 1}),
        ("/api/entry", {"user": "eve", "seq": 2}),
        ("/api/entry", {"user": "eve", "seq": 3}),
        ("/api/run", {"user": "eve", "run": "r1"}),
        ("/api/verify", {}),
        ("/api/export/heads", {"user": "eve"}),
    ]
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        for route, params in routes:
            got = http.get(route, params=params)
            assert got.status_code == 200, (route, got.status_code, got.text[:200])
            text = got.content.decode("utf-8")  # strictly
            assert not any(raw in text for raw in _RAW), route
            json.loads(text)
        # Escaped as JSON, the values read back as stored.
        entry = http.get("/api/entry", params={"user": "eve", "seq": 3}).json()
        assert entry["actor"] == CRAFTED
        assert http.get("/api/entry", params={"user": "eve", "seq": 2}).json()["session_id"] == (
            "\udcff<b>"
        )


def test_a_huge_crafted_value_is_cut_in_the_damaged_rows_warning(tmp_path: Path) -> None:
    # A seq edited into 100 KB of markup was quoted whole in the reason the trail's warning,
    # its "damaged" list, the verification, the export's marker and the run's refusal give:
    # a page of 200 KB, and a crafted user column the same.
    huge = CRAFTED + "A" * 100_000
    settings = _eve_edited(
        tmp_path,
        ("UPDATE loom_audit SET seq = ? WHERE seq = 2", (huge,)),
        ("UPDATE loom_audit SET seq = 'x', user_id = ? WHERE seq = 3", (huge,)),
    )
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        body = http.get("/api/users/eve", params={"verify": 1}).json()
        details = [d["detail"] for d in body["damaged"]]
        details += [p["detail"] for p in body["verify"]["problems"]]
        assert len(details) >= 4
        assert all(len(d) < 1000 for d in details), [len(d) for d in details]
        assert "seq is '<script>alert(1)</script>" in details[0]  # what it holds, cut
        for params in ({}, {"verify": 1}):
            page = http.get("/users/eve", params=params)
            assert page.status_code == 200
            assert len(page.text) < 20_000
            assert "<script>" not in page.text
            assert "<img" not in page.text
            assert not any(raw in page.text for raw in _RAW)
        # The run was refused with the reason (kept short); it is told now, its damaged rows
        # marked with their reasons cut, on the page as in the JSON.
        story = http.get("/api/run", params={"user": "eve", "run": "r1"}).json()
        details = [d["detail"] for d in story["damaged"]]
        details += [p["detail"] for p in story["verify"]["problems"]]
        assert len(story["damaged"]) == 2
        assert all(len(d) < 1000 for d in details), [len(d) for d in details]
        page = http.get("/run", params={"user": "eve", "run": "r1"})
        assert page.status_code == 200
        assert len(page.text) < 20_000
        assert "<script>" not in page.text
        marked = [
            json.loads(line)
            for line in http.get("/api/export", params={"user": "eve"}).text.splitlines()[1:]
        ]
        assert [len(line["unreadable"]) < 1000 for line in marked if "hash" not in line] == [
            True,
            True,
        ]


def test_runs_by_state_lists_a_run_whose_user_is_no_utf8_text(tmp_path: Path) -> None:
    # A journal row whose user column holds bytes that are not UTF-8 made the whole runs page
    # a 500 (the link to the user's trail could not be percent-encoded), while the CLI's
    # `runs list` lists the run as unreadable. The page now lists it, unlinked: no trail can
    # be asked for under such an id.
    path = tmp_path / "journal.db"
    settings = _bobs_runs(path, "s-bob", "s-other")
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE loom_sessions SET user_id = CAST(X'ff3c623e' AS TEXT) "
            "WHERE session_id = 's-other'"
        )
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        page = http.get("/runs")
        assert page.status_code == 200, page.text[:300]
        assert "&#39;\\udcff&lt;b&gt;&#39;" in page.text  # escaped and quoted, as ids are
        assert page.text.count('href="/users/bob"') == 1
        runs = http.get("/api/runs").json()["runs"]
        assert sorted((r["user_id"], r["state"]) for r in runs) == [
            ("bob", "finished"),
            ("\udcff<b>", "unreadable"),
        ]


def test_a_huge_value_read_back_from_a_store_is_cut_on_the_page(tmp_path: Path) -> None:
    # A session id, an owner or a journal step name edited into 100 KB was shown whole, on
    # every row of the runs page and the run's story (400 KB for one step), where the CLI's
    # tables cut a cell at 1,000 characters. The JSON still has the value as stored.
    path = tmp_path / "journal.db"
    settings = _bobs_runs(path, "s-bob")
    huge = CRAFTED + "A" * 100_000
    with sqlite3.connect(path) as db:
        db.execute("UPDATE loom_sessions SET owner = ?", (huge,))
        db.execute("UPDATE loom_entries SET name = ?", (huge,))
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_update")
        db.execute("UPDATE loom_audit SET actor = ?", (huge,))
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        [run] = http.get("/api/runs").json()["runs"]
        assert run["owner"] == huge
        story = http.get("/api/run", params={"user": "bob", "run": _run_of(http, "bob")}).json()
        pages = {
            "runs": http.get("/runs").text,
            "run": http.get("/run", params={"user": "bob", "run": story["run_id"]}).text,
            "trail": http.get("/users/bob").text,
            "entry": http.get("/entry", params={"user": "bob", "seq": 1}).text,
        }
        for name, page in pages.items():
            assert len(page) < 40_000, (name, len(page))
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page, name
            assert "<script>" not in page
            assert "A" * 900 + "…" in page, name  # cut at 1,000 characters, escapes and all
            assert "A" * 1000 not in page, name


def _run_of(http: httpx.Client, user: str) -> str:
    [entry] = [
        e for e in http.get(f"/api/users/{user}").json()["entries"] if e["action"] == "run.end"
    ]
    return str(entry["run_id"])


def test_an_entry_whose_run_id_is_no_utf8_text_is_shown_unlinked(tmp_path: Path) -> None:
    # A run id edited into bytes that are not UTF-8 made the trail page, the entry and its
    # JSON a 500: the link to the run's story cannot be percent-encoded. Now the run id is
    # shown escaped, with no link (no address can name it: the console refuses one that
    # percent-encodes such bytes).
    settings = _eve_edited(
        tmp_path, ("UPDATE loom_audit SET run_id = CAST(X'ff3c623e' AS TEXT) WHERE seq = 2", ())
    )
    with Server(settings, ConsoleOptions()) as server, server.client(ADMIN) as http:
        for params in ({}, {"verify": 1}):
            trail = http.get("/users/eve", params=params)
            assert trail.status_code == 200, trail.text[:200]
            assert "\\udcff&lt;b&gt;" in trail.text
            assert trail.text.count('class="run"') == 2  # entries 1 and 3
        entry = http.get("/entry", params={"user": "eve", "seq": 2})
        assert entry.status_code == 200, entry.text[:200]
        assert 'id="run"' not in entry.text
        assert "\\udcff&lt;b&gt;" in entry.text
        got = http.get("/api/entry", params={"user": "eve", "seq": 2})
        assert got.status_code == 200, got.text[:200]
        assert got.json()["run_id"] == "\udcff<b>"
