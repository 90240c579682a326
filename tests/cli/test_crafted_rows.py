"""The command line on a real SQLite journal whose rows were edited by hand: every time it
prints is a time or says it is unreadable, and a request it cannot read is never "not found"."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from _cli import loomflow

from loomflow.agent import Agent
from loomflow.config import Settings
from loomflow.governance import StandardPermissions
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.tools import Tool

_ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
_TABLE_TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


def _waiting_run(path: Path) -> str:
    """A journal at ``path`` whose run of session ops-1 (user ana) waits on one approval
    request; the request's id."""

    def send_notice(to: str) -> str:
        """Send a notice."""
        return f"sent to {to}"

    async def run() -> str:
        async with Agent.from_settings(
            "x",
            model=ScriptedModel([[ToolCall(id="c0", name="send_notice", arguments={"to": "ops"})]]),
            settings=Settings(runtime_url=f"sqlite:///{path}"),
            tools=[Tool(send_notice, edits=True)],
            permissions=StandardPermissions(approval="defer"),
            memory=False,
            telemetry=False,
        ) as agent:
            result = await agent.run("Send it.", session_id="ops-1", user_id="ana")
        [request] = result.pending_approvals
        return request.request_id

    return asyncio.run(run())


def _edit(path: Path, sql: str, *params: Any) -> None:
    with sqlite3.connect(path) as db:
        assert db.execute(sql, params).rowcount > 0


# What a hand edit leaves in a REAL column: SQLite keeps text and blobs as they are (the
# store reads them as NaN), and overflows 9e999 to infinity.
CRAFTED = ["1e300", "-1e300", "9e999", "'garbage'"]


@pytest.mark.parametrize("value", CRAFTED)
def test_a_crafted_time_is_null_in_json_and_unreadable_in_tables(
    value: str, tmp_path: Path
) -> None:
    # Before: `runs list --json` said "updated_at": "1e+300" (or "nan", "inf") where an ISO
    # time is promised, and the tables of `runs list` and `runs show` printed the same.
    path = tmp_path / "journal.db"
    _waiting_run(path)
    _edit(path, f"UPDATE loom_sessions SET updated_at = {value}")
    _edit(path, f"UPDATE loom_entries SET created_at = {value} WHERE name LIKE 'approval_%'")
    url = f"sqlite:///{path}"

    listed = loomflow("--url", url, "runs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [run] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert run["session_id"] == "ops-1"
    assert run["updated_at"] is None
    table = loomflow("--url", url, "runs", "list")
    assert table.returncode == 0, table.stderr
    [row] = [line for line in table.stdout.splitlines() if line.startswith("ops-1")]
    assert row.endswith("unreadable")

    shown = loomflow("--url", url, "runs", "show", "ops-1", "--json")
    assert shown.returncode == 0, shown.stderr
    entries = {e["name"]: e for e in map(json.loads, shown.stdout.splitlines())}
    assert entries["approval_request_0_0"]["created_at"] is None
    assert _ISO.match(entries["model_call_0"]["created_at"])
    steps = loomflow("--url", url, "runs", "show", "ops-1")
    assert steps.returncode == 0, steps.stderr
    [step] = [line for line in steps.stdout.splitlines() if "approval_request_0_0" in line]
    assert step.endswith("unreadable")
    [call] = [line for line in steps.stdout.splitlines() if "model_call_0" in line]
    assert _TABLE_TIME.search(call)

    exported = loomflow("--url", url, "users", "export", "ana")
    assert exported.returncode == 0, exported.stderr
    document = json.loads(exported.stdout)
    [session] = document["journal"]["sessions"]
    assert session["updated_at"] is None
    for output in (listed, table, shown, steps, exported):
        assert not re.search(r"\b(nan|inf|e\+300|garbage)\b", output.stdout, re.IGNORECASE)

    # The request still lists (and its session sorts without failing).
    waiting = loomflow("--url", url, "approvals", "list", "--json")
    assert waiting.returncode == 0, waiting.stderr
    assert [json.loads(line)["session_id"] for line in waiting.stdout.splitlines()] == ["ops-1"]


def _rows(path: Path) -> list[tuple[Any, ...]]:
    """Every journal row and session row, to see that a refused command changed nothing."""
    with sqlite3.connect(path) as db:
        entries = db.execute("SELECT * FROM loom_entries ORDER BY seq").fetchall()
        return entries + db.execute("SELECT * FROM loom_sessions").fetchall()


def _decisions_audited(url: str) -> int:
    found = loomflow("--url", url, "audit", "query", "--user", "ana", "--json")
    assert found.returncode == 0, found.stderr
    return [e["action"] for e in json.loads(found.stdout)["entries"]].count("approval.decision")


def test_a_request_a_newer_loomflow_wrote_is_said_to_exist_not_not_found(tmp_path: Path) -> None:
    # Before: approve and deny of a request whose row a newer release wrote (a rollback of
    # the deploy) said "no approval request ... in the last run", so a person holding its id
    # from the run's result was told it did not exist.
    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    request_id = _waiting_run(path)
    _edit(path, "UPDATE loom_entries SET codec_version = 99 WHERE name = 'approval_request_0_0'")
    before = _rows(path)

    for decide in (["approve"], ["deny", "--reason", "not now"]):
        refused = loomflow("--url", url, "approvals", *decide, request_id, "--session", "ops-1")
        assert refused.returncode == 1, refused.stdout
        assert refused.stdout == ""
        [line] = refused.stderr.splitlines()
        assert line.startswith(f"loomflow: error: approval request {request_id!r}")
        assert "exists" in line
        assert "a newer loomflow wrote it (codec v99)" in line
        assert "nothing was recorded" in line
    assert _rows(path) == before
    assert _decisions_audited(url) == 0

    # An id of no request is still not found, and told of the requests it could not read.
    other = "apr_" + "0" * 24
    missing = loomflow("--url", url, "approvals", "approve", other, "--session", "ops-1")
    assert missing.returncode == 1, missing.stdout
    assert f"no approval request {other!r}" in missing.stderr
    assert "1 request(s) a newer loomflow wrote" in missing.stderr
    assert _rows(path) == before


def test_a_request_a_newer_loomflow_decided_is_not_listed_or_decided_again(
    tmp_path: Path,
) -> None:
    # Before: a decision row a newer release wrote was skipped, so the request was listed as
    # waiting, and a deny was audited as a decision before the journal refused it: the audit
    # trail held a decision that never took effect.
    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    request_id = _waiting_run(path)
    approved = loomflow("--url", url, "approvals", "approve", request_id, "--session", "ops-1")
    assert approved.returncode == 0, approved.stderr
    _edit(path, "UPDATE loom_entries SET codec_version = 99 WHERE name LIKE 'approval_decision_%'")
    before = _rows(path)

    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["request_id"] == request_id
    assert "was written by a newer loomflow (codec v99)" in row["unreadable"]

    denied = loomflow("--url", url, "approvals", "deny", request_id, "--session", "ops-1",
                      "--reason", "changed my mind")  # fmt: skip
    assert denied.returncode == 1, denied.stdout
    assert "exists, but this loomflow cannot act on it" in denied.stderr
    assert "its decision" in denied.stderr
    assert _rows(path) == before
    assert _decisions_audited(url) == 1  # the first approve's, alone


@pytest.mark.parametrize("column", ["session_id", "user_id"])
def test_a_session_row_with_a_control_character_in_an_id_hides_no_other_request(
    column: str, tmp_path: Path
) -> None:
    # Before: `approvals list` failed as a whole ("session_id contains the control character
    # U+001B", exit 1) on one hand-edited session row, hiding every request that waits.
    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    request_id = _waiting_run(path)
    crafted = "o\x1b]0;owned\x07"
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT * FROM loom_sessions").fetchone()
        names = [d[0] for d in db.execute("SELECT * FROM loom_sessions").description]
        copy = dict(zip(names, row, strict=True)) | {"scope": "crafted", column: crafted}
        copy["updated_at"] += 1  # listed first
        marks = ", ".join("?" * len(copy))
        db.execute(
            f"INSERT INTO loom_sessions ({', '.join(copy)}) VALUES ({marks})", [*copy.values()]
        )

    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["request_id"] for r in rows] == [request_id, None]
    assert rows[1][column] == crafted
    assert "control character U+001B" in rows[1]["unreadable"]
    table = loomflow("--url", url, "approvals", "list")
    assert table.returncode == 0, table.stderr
    assert request_id in table.stdout
    assert "\x1b" not in table.stdout + table.stderr
    assert "\\x1b]0;owned\\x07" in table.stdout


@pytest.mark.parametrize("invisible", ["\u200b", "\u200d", "\u2060", "\ufeff", "\xad"])
def test_json_output_shows_an_invisible_character_of_an_id_as_an_escape(
    invisible: str, tmp_path: Path
) -> None:
    # Before: `users holds --json` and `audit query --json` printed a zero-width character
    # raw, so a hold on "a\u200bna" read as a hold on "ana" at the terminal.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    user = f"a{invisible}na"
    held = loomflow("--url", url, "users", "hold", user, "--reason", "case 1")
    assert held.returncode == 0, held.stderr

    holds = loomflow("--url", url, "users", "holds", "--json")
    entries = loomflow("--url", url, "audit", "query", "--user", user, "--json")
    for shown in (holds, entries):
        assert shown.returncode == 0, shown.stderr
        assert invisible not in shown.stdout
        assert f"a\\u{ord(invisible):04x}na" in shown.stdout
    # The same documents to a JSON reader.
    assert [json.loads(line)["user_id"] for line in holds.stdout.splitlines()] == [user]
    assert [e["user_id"] for e in json.loads(entries.stdout)["entries"]] == [user]


def test_a_request_time_that_is_no_time_is_null_not_the_text(tmp_path: Path) -> None:
    # Before: `approvals list --json` gave a hand-edited "requested_at" text back as it was,
    # where an ISO time is promised.
    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    request_id = _waiting_run(path)
    _edit(
        path,
        "UPDATE loom_entries SET value = CAST(replace(CAST(value AS TEXT), "
        '\'"requested_at":"\', \'"requested_at":"soon \') AS BLOB) '
        "WHERE name = 'approval_request_0_0'",
    )
    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["request_id"] == request_id  # the time is not part of what its id vouches for
    assert row["requested_at"] is None
    table = loomflow("--url", url, "approvals", "list")
    assert table.returncode == 0, table.stderr
    [line] = [x for x in table.stdout.splitlines() if x.startswith(request_id)]
    assert "unreadable" in line
    assert "soon" not in line
