"""``loomflow approvals list|approve|deny`` as real subprocesses, on a journal an agent wrote.

The CLI journals the decision (and audits it); the application's next plain ``resume()``
applies it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loomflow.agent import Agent, RunResult
from loomflow.audit import AuditLog, actions
from loomflow.config import Settings
from loomflow.governance import StandardPermissions
from loomflow.messages import ToolCall
from loomflow.models import ScriptedModel
from loomflow.stores import Stores
from loomflow.tools import Tool

PROMPT = "Send the two notices."
SCRIPT = [
    [
        ToolCall(id="c0", name="send_notice", arguments={"to": "ops", "text": "down at 9"}),
        ToolCall(id="c1", name="send_notice", arguments={"to": "all", "text": "down at 9"}),
    ],
    "Notices handled.",
]


def loomflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def _run(
    url: str, sent: list[dict[str, Any]], *, resume: bool, sensitive: frozenset[str] = frozenset()
) -> RunResult:
    def send_notice(to: str, text: str) -> str:
        """Send a notice."""
        sent.append({"to": to, "text": text})
        return f"sent to {to}"

    # Journal and audit log from the settings, as a deployed application builds them.
    async with Agent.from_settings(
        "x",
        model=ScriptedModel(SCRIPT),
        settings=Settings(runtime_url=url),
        tools=[Tool(send_notice, edits=True, sensitive=sensitive)],
        permissions=StandardPermissions(approval="defer"),
        memory=False,
        telemetry=False,
    ) as agent:
        if resume:
            return await agent.resume(PROMPT, session_id="ops-1", user_id="ana")
        return await agent.run(PROMPT, session_id="ops-1", user_id="ana")


async def _audit(url: str) -> list[Any]:
    async with Stores(Settings(runtime_url=url)) as stores:
        page = await AuditLog(stores.audit, redact_logs=False).query(
            user_id="ana", action="approval.*"
        )
        return page.entries


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_list_approve_and_deny_from_a_shell(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        request.getfixturevalue("pg_dsn")
        if backend == "postgres"
        else f"sqlite:///{tmp_path / 'journal.db'}"
    )
    sent: list[dict[str, Any]] = []
    stopped = asyncio.run(_run(url, sent, resume=False))
    ops, everyone = stopped.pending_approvals
    assert sent == []

    listed = loomflow("--url", url, "approvals", "list", "--user", "ana", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["request_id"] for r in rows] == [ops.request_id, everyone.request_id]
    assert rows[0]["arguments"] == {"to": "ops", "text": "down at 9"}
    table = loomflow("--url", url, "approvals", "list", "--session", "ops-1")
    assert ops.request_id in table.stdout
    assert "send_notice" in table.stdout
    other = loomflow("--url", url, "approvals", "list", "--user", "bob", "--json")
    assert other.returncode == 0
    assert other.stdout == ""

    # Without --user, the one user who ran the session; a session nobody ran is an error.
    common = ["--session", "ops-1", "--by", "carol"]
    nobody = loomflow("--url", url, "approvals", "approve", ops.request_id, "--session", "nope")
    assert nobody.returncode == 1
    assert "no session 'nope'" in nobody.stderr
    anonymous = loomflow(
        "--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1", "--anonymous"
    )
    assert anonymous.returncode == 1
    approved = loomflow(
        "--url", url, "approvals", "approve", ops.request_id, *common,
        "--arguments", '{"to": "ops", "text": "down at 10"}', "--json",
    )  # fmt: skip
    assert approved.returncode == 0, approved.stderr
    assert json.loads(approved.stdout)["decision"] == "allow"

    # A decision is final; unknown ids, bad JSON and a denial without a reason are refused.
    again = loomflow("--url", url, "approvals", "deny", ops.request_id, *common, "--reason", "no")
    assert again.returncode == 1
    assert "already decided" in again.stderr
    unknown = loomflow("--url", url, "approvals", "approve", "apr_nope", *common)
    assert unknown.returncode == 1
    assert "no approval request 'apr_nope'" in unknown.stderr
    bad = loomflow(
        "--url", url, "approvals", "approve", everyone.request_id, *common, "--arguments", "[1]"
    )
    assert bad.returncode == 1
    assert "JSON object" in bad.stderr
    no_reason = loomflow("--url", url, "approvals", "deny", everyone.request_id, *common)
    assert no_reason.returncode == 2

    denied = loomflow(
        "--url", url, "approvals", "deny", everyone.request_id, *common,
        "--reason", "not to everyone",
    )  # fmt: skip
    assert denied.returncode == 0, denied.stderr
    assert "deny recorded" in denied.stdout
    empty = loomflow("--url", url, "approvals", "list")
    assert "no approval requests are waiting" in empty.stdout

    # The application resumes without passing decisions: the journaled ones apply.
    result = asyncio.run(_run(url, sent, resume=True))
    assert not result.interrupted
    assert sent == [{"to": "ops", "text": "down at 10"}]
    denial = [m.content for m in result.messages if m.role == "tool" and m.tool_call_id == "c1"]
    assert "not to everyone" in denial[0]

    entries = asyncio.run(_audit(url))
    decided = [e for e in entries if e.action == actions.APPROVAL_DECISION]
    assert [(e.actor, e.payload["decision"]) for e in decided] == [
        ("approver:carol", "allow"),
        ("approver:carol", "deny"),
    ]
    assert decided[0].payload["arguments"] == {"to": "ops", "text": "down at 10"}
    assert len([e for e in entries if e.action == actions.APPROVAL_REQUEST]) == 2


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_decision_from_a_shell_keeps_the_run_waiting_and_a_cancel_ends_it(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    import getpass

    url = (
        request.getfixturevalue("pg_dsn")
        if backend == "postgres"
        else f"sqlite:///{tmp_path / 'journal.db'}"
    )
    sent: list[dict[str, Any]] = []
    ops, everyone = asyncio.run(
        _run(url, sent, resume=False, sensitive=frozenset({"text"}))
    ).pending_approvals
    assert ops.sensitive == ["text"]

    def state() -> str:
        listed = loomflow("--url", url, "runs", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        [row] = [json.loads(line) for line in listed.stdout.splitlines()]
        return str(row["state"])

    # Without --by the person at the terminal is named; the edit's sensitive value is hidden.
    approved = loomflow(
        "--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1",
        "--arguments", '{"to": "ops", "text": "code kiwi77"}', "--json",
    )  # fmt: skip
    assert approved.returncode == 0, approved.stderr
    assert json.loads(approved.stdout)["decided_by"] == f"cli:{getpass.getuser()}"
    assert state() == "interrupted"  # decided, not resumed: it still waits

    [decided] = [e for e in asyncio.run(_audit(url)) if e.action == actions.APPROVAL_DECISION]
    assert decided.actor == f"approver:cli:{getpass.getuser()}"
    assert decided.payload["arguments"] == {"to": "ops", "text": "[REDACTED]"}
    # Not digits alone: those can turn up in a request id's hex or a timestamp by chance.
    assert "kiwi77" not in json.dumps([e.payload for e in asyncio.run(_audit(url))])

    # The waiting run can be cancelled; then nothing decides or resumes it.
    cancelled = loomflow("--url", url, "runs", "cancel", "ops-1", "--user", "ana")
    assert cancelled.returncode == 0, cancelled.stderr
    assert state() == "cancelled"
    late = loomflow(
        "--url", url, "approvals", "deny", everyone.request_id, "--session", "ops-1",
        "--reason", "too late",
    )  # fmt: skip
    assert late.returncode == 1
    assert "was cancelled while it waited for approval" in late.stderr
    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.stdout == ""
    from loomflow.errors import RunCancelledError

    with pytest.raises(RunCancelledError):
        asyncio.run(_run(url, sent, resume=True, sensitive=frozenset({"text"})))
    assert sent == []
    assert state() == "cancelled"


def test_a_cancelled_run_that_asked_nothing_is_not_said_to_have_waited() -> None:
    from loomflow.errors import RunCancelledError
    from loomflow.governance.approvals import Ledger, check_decidable

    with pytest.raises(RunCancelledError, match="asked for no approval") as caught:
        check_decidable(Ledger(epoch=0, cancelled=True), ["apr_x"], "ops-2", "ana")
    assert "waited" not in str(caught.value)


def _edit(path: Path, name: str, field: str, value: str) -> None:
    """Rewrite one field of a journaled request in place, as someone with the file could."""
    import sqlite3

    with sqlite3.connect(path) as db:
        changed = db.execute(
            f"UPDATE loom_entries SET value = CAST(json_set(CAST(value AS TEXT), '$.{field}', "
            f"json(?)) AS BLOB) WHERE name = ?",
            (value, name),
        ).rowcount
    assert changed == 1


def test_a_request_naming_another_user_is_refused_not_audited_in_their_trail(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ap.db"
    url = f"sqlite:///{path}"
    sent: list[dict[str, Any]] = []
    ops, _ = asyncio.run(_run(url, sent, resume=False)).pending_approvals
    _edit(path, "approval_request_0_0", "user_id", '"mallory"')

    approved = loomflow(
        "--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1",
        "--user", "ana", "--by", "carol",
    )  # fmt: skip
    assert approved.returncode == 1, approved.stdout
    assert "Traceback" not in approved.stderr
    assert approved.stderr.startswith("loomflow: error: ")
    assert "damaged" in approved.stderr
    assert "names user 'mallory'" in approved.stderr
    assert "recorded" not in approved.stdout

    async def decisions(user: str) -> list[Any]:
        async with Stores(Settings(runtime_url=url)) as stores:
            page = await AuditLog(stores.audit, redact_logs=False).query(
                user_id=user, action=actions.APPROVAL_DECISION
            )
            return page.entries

    assert asyncio.run(decisions("mallory")) == []
    assert asyncio.run(decisions("ana")) == []
    # The run never trusts the record either: its resume stops at it, and runs nothing.
    from loomflow.errors import CorruptEntryError

    with pytest.raises(CorruptEntryError, match="mallory"):
        asyncio.run(_run(url, sent, resume=True))
    assert sent == []


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("[" * 50_000, "--arguments is nested too deeply"),
        ('{"to": "ops", "text": ' + "[" * 950 + "]" * 950 + "}", "nested more than 100"),
        ('{"to": "ops", "text": ' + "9" * 5_000 + "}", "--arguments is not JSON"),
        ('{"to": "ops", "text": "a", "to": "all"}', "--arguments names 'to' twice"),
        ('{"to": "ops", "text": {"x": 1, "x": 2}}', "--arguments names 'x' twice"),
    ],
    ids=["nested-50000", "nested-950", "5000-digits", "duplicate-key", "nested-duplicate-key"],
)
def test_hostile_edited_arguments_are_one_line_errors(text: str, said: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    sent: list[dict[str, Any]] = []
    ops, _ = asyncio.run(_run(url, sent, resume=False)).pending_approvals
    approved = loomflow(
        "--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1",
        "--arguments", text,
    )  # fmt: skip
    assert approved.returncode == 1
    [line] = approved.stderr.splitlines()  # one line, no traceback
    assert line.startswith("loomflow: error: ")
    assert said in line
    # Nothing was decided: the request still waits.
    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert ops.request_id in listed.stdout


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("arguments", "[1, 2]", "arguments"),
        ("tool", "5", "tool"),
        ("path", '"x"', "path"),
        ("path", '["elsewhere"]', "sub-run path"),
        ("turn", "-1", "turn"),
        ("turn", "99999999999", "turn 99999999999"),
        ("slot", "1", "slot 1"),
        ("session_id", '"ops-2"', "session 'ops-2'"),
        ("epoch", "3", "epoch 3"),
    ],
)
def test_a_damaged_request_is_listed_refused_and_stops_the_resume(
    field: str, value: str, why: str, tmp_path: Path
) -> None:
    from loomflow.errors import CorruptEntryError

    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    sent: list[dict[str, Any]] = []
    ops, everyone = asyncio.run(_run(url, sent, resume=False)).pending_approvals
    _edit(path, "approval_request_0_0", field, value)

    # Listed as unreadable, with its id and why, beside the request that is fine.
    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["request_id"] for r in rows] == [everyone.request_id, ops.request_id]
    assert "unreadable" not in rows[0]
    assert rows[1]["step"] == "approval_request_0_0"
    assert rows[1]["user_id"] == "ana"
    assert why in rows[1]["unreadable"]
    table = loomflow("--url", url, "approvals", "list")
    assert table.returncode == 0, table.stderr
    [line] = [x for x in table.stdout.splitlines() if ops.request_id in x]
    assert "unreadable" in line
    assert ops.request_id in table.stderr
    assert "unreadable" in table.stderr

    # It cannot be decided...
    approved = loomflow("--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1")
    assert approved.returncode == 1, approved.stdout
    assert approved.stderr.startswith("loomflow: error: ")
    assert "damaged" in approved.stderr
    assert "Traceback" not in approved.stderr
    # ...and the run refuses it instead of waiting on it for ever.
    with pytest.raises(CorruptEntryError):
        asyncio.run(_run(url, sent, resume=True))
    assert sent == []


def test_a_request_a_newer_loomflow_wrote_is_listed_not_hidden(tmp_path: Path) -> None:
    """A request row of a codec version above this release's (a newer worker wrote it, and
    the deploy was rolled back) vanished from `approvals list` ("no approval requests are
    waiting") while the run's resume stops at it with NewerEntryError: a person waiting for
    the request saw nothing to decide, and the run never moved."""
    import sqlite3

    from loomflow.errors import NewerEntryError

    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    sent: list[dict[str, Any]] = []
    _ops, everyone = asyncio.run(_run(url, sent, resume=False)).pending_approvals
    with sqlite3.connect(path) as db:
        db.execute("UPDATE loom_entries SET codec_version = 99 WHERE name = 'approval_request_0_0'")

    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["request_id"] for r in rows] == [everyone.request_id, None]
    assert rows[1]["step"] == "approval_request_0_0"
    assert "newer loomflow" in rows[1]["unreadable"]
    table = loomflow("--url", url, "approvals", "list")
    assert table.returncode == 0, table.stderr
    assert "unreadable" in table.stdout
    assert "newer loomflow" in table.stderr
    # The run stops at it rather than asking again (the request is most likely sound).
    with pytest.raises(NewerEntryError):
        asyncio.run(_run(url, sent, resume=True))
    assert sent == []


def test_a_decision_the_audit_log_cannot_record_is_not_journaled(tmp_path: Path) -> None:
    """The audit entry is written before the decision is journaled: with the audit store
    down the command fails and nothing is decided, so the retry records (and audits) it."""
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    sent: list[dict[str, Any]] = []
    ops, _ = asyncio.run(_run(url, sent, resume=False)).pending_approvals
    down = "postgresql://loomflow@127.0.0.1:1/audit"  # nothing listens on port 1
    failed = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", url, "approvals", "approve",
         ops.request_id, "--session", "ops-1", "--by", "carol"],
        env={**os.environ, "LOOMFLOW_AUDIT_URL": down},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr
    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert ops.request_id in listed.stdout  # still waiting, not decided unaudited

    again = loomflow(
        "--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1", "--by", "carol"
    )
    assert again.returncode == 0, again.stderr
    decisions = [e for e in asyncio.run(_audit(url)) if e.action == actions.APPROVAL_DECISION]
    assert [(e.actor, e.payload["request_id"]) for e in decisions] == [
        ("approver:carol", ops.request_id)
    ]


def test_a_request_whose_decision_row_is_damaged_is_refused_not_said_recorded(
    tmp_path: Path,
) -> None:
    """A decision row edited into no decision (a "maybe") is what the run reads back at the
    request, so the resume stops at it: deciding again would hit that row and journal
    nothing. The request is listed as unreadable and `approve` refuses it, instead of
    printing "allow recorded" and auditing a decision that never takes effect."""
    from loomflow.errors import CorruptEntryError

    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    sent: list[dict[str, Any]] = []
    ops, everyone = asyncio.run(_run(url, sent, resume=False)).pending_approvals
    denied = loomflow(
        "--url", url, "approvals", "deny", ops.request_id, "--session", "ops-1", "--reason", "no"
    )
    assert denied.returncode == 0, denied.stderr
    _edit(path, f"approval_decision_0_0_{ops.request_id}", "behavior", '"maybe"')

    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["request_id"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert "unreadable" not in rows[everyone.request_id]
    assert "decision" in rows[ops.request_id]["unreadable"]

    approved = loomflow("--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1")
    assert approved.returncode == 1, approved.stdout
    assert approved.stderr.startswith("loomflow: error: ")
    assert "damaged" in approved.stderr
    assert "recorded" not in approved.stdout
    decisions = [e for e in asyncio.run(_audit(url)) if e.action == actions.APPROVAL_DECISION]
    assert [e.payload["decision"] for e in decisions] == ["deny"]  # the first one only
    with pytest.raises(CorruptEntryError):
        asyncio.run(_run(url, sent, resume=True))
    assert sent == []


def test_a_decision_row_moved_where_the_run_never_reads_it_leaves_the_request_open(
    tmp_path: Path,
) -> None:
    """A decision row renamed to another turn and slot is not read by the run, which keeps
    stopping at the request: the request stays listed and can be decided, instead of being
    shown as decided while the run waits on it for ever."""
    import sqlite3

    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    sent: list[dict[str, Any]] = []
    ops, everyone = asyncio.run(_run(url, sent, resume=False)).pending_approvals
    approved = loomflow("--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1")
    assert approved.returncode == 0, approved.stderr
    with sqlite3.connect(path) as db:
        moved = db.execute(
            "UPDATE loom_entries SET name = ? WHERE name = ?",
            (f"approval_decision_5_5_{ops.request_id}", f"approval_decision_0_0_{ops.request_id}"),
        ).rowcount
    assert moved == 1
    stopped = asyncio.run(_run(url, sent, resume=True))
    assert ops.request_id in [p.request_id for p in stopped.pending_approvals]

    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["request_id"] for line in listed.stdout.splitlines()] == [
        ops.request_id,
        everyone.request_id,
    ]
    again = loomflow("--url", url, "approvals", "approve", ops.request_id, "--session", "ops-1")
    assert again.returncode == 0, again.stderr
    stopped = asyncio.run(_run(url, sent, resume=True))
    assert [p.request_id for p in stopped.pending_approvals] == [everyone.request_id]
    assert sent == [{"to": "ops", "text": "down at 9"}]


@pytest.mark.parametrize(
    ("by", "login", "said"),
    [
        (None, "ops\nlead", "your login name 'ops\\nlead' cannot name the approver"),
        ("kim\x1b[2J", "kim", "--by contains the control character U+001B"),
        # An empty --by (a script's unset "$APPROVER") was taken as no --by at all: the
        # decision was recorded and audited as the login of whoever ran the script.
        ("", "kim", "--by must not be empty"),
    ],
    ids=["login", "by", "empty-by"],
)
def test_an_approver_name_that_is_no_id_names_where_it_came_from(
    by: str | None, login: str, said: str, tmp_path: Path
) -> None:
    # Without --by, a login name with a control character was refused as "decided_by
    # contains the control character U+000A": an option the person never gave.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ops, _ = asyncio.run(_run(url, [], resume=False)).pending_approvals
    named = ["--by", by] if by is not None else []
    approved = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "--url", url, "approvals", "approve",
         ops.request_id, "--session", "ops-1", "--user", "ana", *named],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "LOGNAME": login, "USER": login},
    )  # fmt: skip
    assert approved.returncode == 1, approved.stdout
    assert approved.stderr.startswith("loomflow: error: ")
    assert said in approved.stderr
    assert "decided_by" not in approved.stderr
    # Nothing decided: only the requests are on record.
    assert [e.action for e in asyncio.run(_audit(url))] == [actions.APPROVAL_REQUEST] * 2


def test_a_request_row_naming_a_tool_with_terminal_escapes_is_shown_escaped(
    tmp_path: Path,
) -> None:
    """A request row rewritten together with a matching id (the id is a hash, not a
    signature) reads as a request; `approve` printed its tool name raw, so a crafted row
    could retitle or clear the terminal of whoever decided it."""
    import sqlite3

    from loomflow.governance.approvals import _id_of
    from loomflow.runtime._store import Scope

    path = tmp_path / "journal.db"
    url = f"sqlite:///{path}"
    asyncio.run(_run(url, [], resume=False))
    with sqlite3.connect(path) as db:
        (value,) = db.execute(
            "SELECT value FROM loom_entries WHERE name = 'approval_request_0_0'"
        ).fetchone()
        row = json.loads(value)
        row["tool"] = "send\x1b]0;owned\x07_notice\x1b[2J"
        shown = [row["tool"], row["arguments"], row["reason"], row["policy"]]
        scope = Scope.checked(row["session_id"], row["user_id"])
        row["request_id"] = _id_of(scope, row["epoch"], row["path"], "approval_request_0_0", shown)
        db.execute(
            "UPDATE loom_entries SET value = ? WHERE name = 'approval_request_0_0'",
            (json.dumps(row).encode(),),
        )

    approved = loomflow(
        "--url", url, "approvals", "approve", row["request_id"], "--session", "ops-1",
        "--by", "carol",
    )  # fmt: skip
    assert approved.returncode == 0, approved.stderr
    assert "\x1b" not in approved.stdout
    assert "\x07" not in approved.stdout
    assert "send\\x1b]0;owned\\x07_notice\\x1b[2J" in approved.stdout


def test_arguments_copied_from_the_listing_with_a_redacted_value_are_refused(
    tmp_path: Path,
) -> None:
    # The README says to copy the arguments `approvals list --json` shows and change only
    # values; a sensitive one shows as "[REDACTED]", and the tool ran with that as its text.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    sent: list[dict[str, Any]] = []
    asyncio.run(_run(url, sent, resume=False, sensitive=frozenset({"text"})))
    listed = loomflow("--url", url, "approvals", "list", "--json")
    first = json.loads(listed.stdout.splitlines()[0])
    assert first["arguments"] == {"to": "ops", "text": "[REDACTED]"}
    copied = json.dumps({**first["arguments"], "to": "oncall"})
    approved = loomflow(
        "--url", url, "approvals", "approve", first["request_id"], "--session", "ops-1",
        "--arguments", copied, "--by", "carol",
    )  # fmt: skip
    assert approved.returncode == 1, approved.stdout
    [line] = approved.stderr.splitlines()
    assert line.startswith("loomflow: error: ")
    assert "edited argument 'text' is '[REDACTED]'" in line
    # Nothing decided or audited: the request still waits.
    assert [e.action for e in asyncio.run(_audit(url))] == [actions.APPROVAL_REQUEST] * 2
    again = loomflow("--url", url, "approvals", "list", "--json")
    assert first["request_id"] in again.stdout


def test_a_waiting_request_is_listed_behind_more_recent_finished_sessions(
    tmp_path: Path,
) -> None:
    # --limit counted every session: on a busy journal the newest ones are finished, and
    # `approvals list` said "no approval requests are waiting" while one waited.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    ops, everyone = asyncio.run(_run(url, [], resume=False)).pending_approvals

    async def chat(session_id: str) -> None:
        async with Agent.from_settings(
            "x",
            model=ScriptedModel(["hello"]),
            settings=Settings(runtime_url=url),
            memory=False,
            telemetry=False,
        ) as agent:
            await agent.run("hi", session_id=session_id, user_id="ana")

    for n in range(3):
        asyncio.run(chat(f"chat-{n}"))
    listed = loomflow("--url", url, "approvals", "list", "--limit", "2", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["request_id"] for r in rows] == [ops.request_id, everyone.request_id]
    table = loomflow("--url", url, "approvals", "list", "--limit", "1")
    assert ops.request_id in table.stdout
