"""Findings of a new user's black-box review of the command line, each held by a test.

Real processes (``python -m loomflow.cli``) or the ``main()`` entry point, on real SQLite
files: options that were accepted and ignored, a 0.20 database that a listing changed,
settings typos and values reported without their name, usage errors naming internal
variables, and times in more than one format.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _cli import clean_env, loomflow
from pydantic_settings import EnvSettingsSource, SettingsError

from loomflow import config
from loomflow.config import Settings

cli_main = importlib.import_module("loomflow.cli.main")

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        found = sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master"))
    db.close()
    return found


# An application the worker loads: one agent journaling to journal.db beside it.
_APP = """
from loomflow import Agent
from loomflow.models import ScriptedModel
from loomflow.runtime import SqliteRuntime

agent = Agent("x", name="orders", model=ScriptedModel(["done"]), memory=False,
              telemetry=False, runtime=SqliteRuntime("journal.db"))
AGENTS = {agent.name: agent}
"""


# -- a long-running worker: plain text unless --json ------------------------------------------


def _worker_lines(tmp_path: Path, *extra: str) -> list[str]:
    """What a long-running worker prints from start to SIGINT."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomflow.cli", "worker", "reviewapp:AGENTS", "--port", "0",
         "--interval", "0.2", *extra],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]  # serving, started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return [line.rstrip("\n") for line in lines + out.splitlines(keepends=True)]


def test_a_long_running_worker_prints_plain_text_unless_json(tmp_path: Path) -> None:
    (tmp_path / "reviewapp.py").write_text(_APP)
    plain = _worker_lines(tmp_path)
    assert len(plain) == 3, plain
    assert re.fullmatch(
        r"serving /metrics, /healthz and /readyz on http://127\.0\.0\.1:\d+", plain[0]
    )
    assert re.fullmatch(r"worker \S+ started: a sweep every 0\.2s", plain[1])
    assert re.fullmatch(r"worker \S+ stopped: the runs it held are handed over", plain[2])
    assert not any(line.startswith("{") for line in plain)
    as_json = [json.loads(line) for line in _worker_lines(tmp_path, "--json")]
    assert [e["event"] for e in as_json] == ["serving", "started", "stopped"]
    assert as_json[0]["port"] > 0


# -- --url on worker and demo; the store URLs of a group after its command --------------------


def test_worker_and_demo_refuse_url_on_either_side_of_the_command(tmp_path: Path) -> None:
    (tmp_path / "reviewapp.py").write_text(_APP)
    for argv, why in (
        (["--url", "sqlite:///doesnotexist.db", "worker", "reviewapp:AGENTS", "--once"],
         "worker takes no --url: it recovers the journal of the agents APP registers"),
        (["worker", "reviewapp:AGENTS", "--once", "--url", "sqlite:///doesnotexist.db"],
         "worker takes no --url: it recovers the journal of the agents APP registers"),
        (["demo", "--url", "sqlite:///mine.db", "--workdir", str(tmp_path)],
         "demo takes no --url: it makes a journal of its own, in --workdir"),
        (["--url", "sqlite:///mine.db", "demo", "--workdir", str(tmp_path)],
         "demo takes no --url: it makes a journal of its own, in --workdir"),
    ):  # fmt: skip
        done = loomflow(*argv, cwd=tmp_path)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"loomflow: error: {why}"), done.stderr
        assert done.stdout == ""
    # Nothing ran: no journal of the agents, no demo files, no mine.db.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["reviewapp.py"]
    for command in ("worker", "demo"):
        helped = loomflow(command, "--help")
        assert "--url" not in helped.stdout, command  # not offered where it is refused


def test_worker_refuses_a_runtime_url_naming_another_journal(tmp_path: Path) -> None:
    (tmp_path / "reviewapp.py").write_text(_APP)
    other = loomflow(
        "worker", "reviewapp:AGENTS", "--once", cwd=tmp_path,
        env=clean_env(LOOMFLOW_RUNTIME_URL="sqlite:///other.db"),
    )  # fmt: skip
    assert other.returncode == 1
    assert other.stderr.splitlines() == [
        "loomflow: error: LOOMFLOW_RUNTIME_URL names sqlite:///other.db but the agents of "
        "reviewapp:AGENTS journal to the SQLite file journal.db: the worker recovers the "
        "agents' journal, not the one the other commands read; point both at one journal "
        "(Agent.from_settings takes the variable) or unset it for the worker"
    ]
    assert not (tmp_path / "other.db").exists()
    assert not (tmp_path / "journal.db").exists()  # nothing was swept
    # The same file, however it is spelled, is the agents' journal: swept as usual.
    same = loomflow(
        "worker", "reviewapp:AGENTS", "--once", cwd=tmp_path,
        env=clean_env(LOOMFLOW_RUNTIME_URL=f"sqlite:///{tmp_path / 'journal.db'}"),
    )  # fmt: skip
    assert same.returncode == 0, same.stderr
    assert same.stdout.startswith("sweep: resumed 0")
    unset = loomflow("worker", "reviewapp:AGENTS", "--once", cwd=tmp_path)
    assert unset.returncode == 0, unset.stderr


def test_store_urls_of_a_command_group_go_after_its_command_too(tmp_path: Path) -> None:
    gov = f"sqlite:///{tmp_path / 'gov.db'}"
    missing = f"sqlite:///{tmp_path / 'missing.db'}"
    assert loomflow("--url", gov, "migrate").returncode == 0
    for argv, out in (
        (["budget", "reclaim", "--budget-url", gov], "reclaimed 0 reservations\n"),
        (["budget", "--budget-url", gov, "reclaim"], "reclaimed 0 reservations\n"),
        (["budget", "--budget-url", missing, "reclaim", "--budget-url", gov],
         "reclaimed 0 reservations\n"),  # the later one wins, as for --url
        (["audit", "query", "--audit-url", gov, "--json"], None),
        (["audit", "--audit-url", missing, "verify", "--audit-url", gov], None),
    ):  # fmt: skip
        done = loomflow("--url", missing, *argv)
        assert done.returncode == 0, (argv, done.stderr)
        if out is not None:
            assert done.stdout == out
    earlier = loomflow("budget", "--budget-url", gov, "reclaim", "--budget-url", missing)
    assert earlier.returncode == 1
    assert "no budget store at" in earlier.stderr
    assert not (tmp_path / "missing.db").exists()


# -- usage errors in people's words -----------------------------------------------------------


def _groups(
    parser: argparse.ArgumentParser, prefix: list[str]
) -> list[tuple[list[str], list[str]]]:
    """Every parser with commands under it: its argv and the names of its commands."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.append((prefix, list(action.choices)))
            for name, child in action.choices.items():
                found += _groups(child, [*prefix, name])
    return found


def test_a_missing_command_is_named_by_the_commands_there_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    groups = _groups(cli_main._parser(), [])
    assert len(groups) == 8  # loomflow, runs, journal, approvals, audit, budget, ...
    for argv, commands in groups:
        with pytest.raises(SystemExit) as stopped:
            cli_main.main(argv)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1].endswith(f": error: choose a command: {', '.join(commands)}")
        assert "_command" not in err, argv
        assert "arguments are required" not in err, argv


# -- a database holding only a 0.20 journal ---------------------------------------------------


def test_read_only_commands_refuse_a_database_with_only_a_0_20_journal(tmp_path: Path) -> None:
    db = tmp_path / "legacy2.db"
    with sqlite3.connect(db) as conn:
        for table in ("journal_steps", "journal_streams"):
            conn.execute(
                f"CREATE TABLE {table} (session_id TEXT, user_id TEXT, epoch INTEGER, "
                "seq INTEGER, step_key TEXT, fingerprint TEXT, value TEXT, finished INTEGER, "
                "created_at REAL)"
            )
    conn.close()
    before = _tables(db)
    url = f"sqlite:///{db}"
    for command in (
        ["runs", "list"],
        ["runs", "show", "s"],
        ["journal", "prune", "--all"],
        ["budget", "show"],
        ["audit", "query"],
        ["checkpoints", "list", "s"],
        ["approvals", "list"],
        ["users", "export", "alice"],
    ):
        done = loomflow("--url", url, *command)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert done.stdout == "", command
        assert done.stderr.splitlines() == [
            f"loomflow: error: {url!r} holds a loomflow 0.20 journal and no store of this "
            f"release: run `loomflow migrate --url {url} --import-0.20` once every worker runs "
            "this release, to add this release's tables and import its runs "
            "(docs/operations/upgrading.md); other commands add no tables to a database"
        ], command
        assert _tables(db) == before, command
    # migrate is the command that adds the tables.
    assert loomflow("--url", url, "migrate").returncode == 0
    listed = loomflow("--url", url, "runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("no sessions in the journal")


# -- settings: typos in .env, values that are not JSON ----------------------------------------


def test_a_misspelt_setting_in_dotenv_is_warned_of_like_one_in_the_environment(
    tmp_path: Path,
) -> None:
    (tmp_path / ".env").write_text(
        "LOOMFLOW_RUNTIM_URL=x\nloomflow_lease_secnds=5\nLOOMFLOW_LEASE_SECONDS=7\nOTHER=1\n"
    )
    done = loomflow("settings", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lease_seconds"] == {
        "value": 7.0,
        "from": ".env",
    }
    assert done.stderr.splitlines() == [
        "loomflow: warning: LOOMFLOW_RUNTIM_URL in .env is not a setting and is ignored "
        "(did you mean LOOMFLOW_RUNTIME_URL?)",
        "loomflow: warning: loomflow_lease_secnds in .env is not a setting and is ignored "
        "(did you mean LOOMFLOW_LEASE_SECONDS?)",
    ]


@pytest.mark.parametrize("where", ["environment", ".env"])
def test_redact_patterns_that_are_not_a_json_object_name_the_variable(
    where: str, tmp_path: Path
) -> None:
    for value, problem in (
        ("x", "not JSON (Expecting value: line 1 column 1 (char 0)): give a JSON object"),
        ('["CUST-[0-9]+"]', "a JSON list, not a JSON object"),
    ):
        if where == ".env":
            (tmp_path / ".env").write_text(f"LOOMFLOW_REDACT_PATTERNS='{value}'\n")
            env = clean_env()
        else:
            env = clean_env(LOOMFLOW_REDACT_PATTERNS=value)
        done = loomflow("settings", cwd=tmp_path, env=env)
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(
            f"loomflow: error: bad setting LOOMFLOW_REDACT_PATTERNS: {problem} of kind to "
            'regular expression, e.g. {"customer_id": "CUST-[0-9]{8}"}'
        ), done.stderr
    blank = loomflow("settings", "--json", cwd=tmp_path, env=clean_env(LOOMFLOW_REDACT_PATTERNS=""))
    assert blank.returncode == 0, blank.stderr
    assert json.loads(blank.stdout)["redact_patterns"]["value"] == {}


def test_every_json_typed_setting_names_its_variable_when_it_does_not_parse(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    source = EnvSettingsSource(Settings)
    complex_fields = [
        name for name, field in Settings.model_fields.items() if source.field_is_complex(field)
    ]
    assert {"redact_patterns", "redact_secrets", "redact_env"} <= set(complex_fields)
    # A list of names or patterns also takes one bare item ("x", even "{"); a JSON list of
    # numbers is refused by each, and a map of kinds to patterns takes only a JSON object of
    # strings.
    refused = {"[1, 2]"}
    refusing = {"redact_patterns": {"x", "{", '{"a": 1}', "[1, 2]"}}
    for name in complex_fields:
        variable = f"LOOMFLOW_{name.upper()}"
        for value in ("x", "{", '{"a": 1}', "[1, 2]"):
            monkeypatch.setenv(variable, value)
            code = cli_main.main(["settings"])
            _, err = capsys.readouterr()
            if value not in refusing.get(name, refused):
                assert code == 0, (variable, value, err)
                continue
            assert code == 1, (variable, value)
            assert err.count("\n") == 1, err
            assert err.startswith(f"loomflow: error: bad setting {variable}"), (value, err)
        monkeypatch.delenv(variable)
    # What pydantic-settings reports itself, for a JSON-typed setting it decodes, is named too.
    unreadable = SettingsError('error parsing value for field "some_map" from source "Env"')
    assert config._unreadable_setting(unreadable).startswith(
        "bad setting LOOMFLOW_SOME_MAP: its value is not the JSON this setting takes"
    )


# -- what people read: the budget table, the anonymous user -----------------------------------


def test_the_anonymous_user_is_called_so_and_model_time_has_a_readable_label(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    cancel = loomflow("--url", url, "runs", "cancel", "nope", "--anonymous")
    assert cancel.returncode == 1
    assert cancel.stderr.splitlines() == [
        "loomflow: error: session 'nope' of the anonymous user has no open or interrupted run "
        "to cancel"
    ]
    forget = loomflow("--url", url, "users", "forget", "--anonymous", "--yes")
    assert forget.returncode == 1
    assert forget.stderr.splitlines() == [
        "loomflow: error: no store holds anything about the anonymous user"
    ]
    hold = loomflow("--url", url, "users", "hold", "--anonymous", "--reason", "audit")
    assert hold.stdout == "the anonymous user is under legal hold (audit entry 1)\n"
    again = loomflow("--url", url, "users", "hold", "--anonymous", "--reason", "audit")
    assert again.stderr.startswith("loomflow: error: the anonymous user is already under legal")
    released = loomflow("--url", url, "users", "release", "--anonymous")
    assert released.stdout == "released the legal hold of the anonymous user\n"
    not_held = loomflow("--url", url, "users", "release", "--anonymous")
    assert not_held.stderr == "loomflow: error: the anonymous user is not under legal hold\n"
    for done in (cancel, forget, hold, again, released, not_held):
        assert "None" not in done.stdout + done.stderr

    asyncio.run(_spend(url))
    header = loomflow("--url", url, "budget", "show").stdout.splitlines()[0]
    assert re.search(r"\bcost USD  model seconds  calls\b", header), header


def test_approval_errors_call_the_anonymous_user_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_anonymous_run(url))
    done = loomflow("--url", url, "approvals", "deny", "apr_x", "--session", "s", "--anonymous",
                    "--reason", "no")  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "loomflow: error: no approval request 'apr_x' in the last run of session 's' of the "
        "anonymous user (pending_approvals() or `loomflow approvals list` shows the ones "
        "waiting)"
    ]
    assert loomflow("--url", url, "runs", "cancel", "s", "--anonymous").returncode == 1
    asyncio.run(_anonymous_run(url, keep_open=True))
    assert loomflow("--url", url, "runs", "cancel", "s", "--anonymous").returncode == 0
    late = loomflow("--url", url, "approvals", "deny", "apr_x", "--session", "s", "--anonymous",
                    "--reason", "no")  # fmt: skip
    assert late.returncode == 1
    assert late.stderr.startswith(
        "loomflow: error: session 's' of the anonymous user was cancelled and its last run "
        "asked for no approval"
    ), late.stderr


async def _anonymous_run(url: str, *, keep_open: bool = False) -> None:
    """A run of session ``s`` without a user: finished, or left open (it raised)."""
    from loomflow.stores import Stores

    async def step() -> int:
        return 1

    async with Stores(Settings(runtime_url=url)) as stores:
        runtime = stores.runtime
        assert runtime is not None
        try:
            async with runtime.session("s", user_id=None):
                await runtime.step("one", step)
                if keep_open:
                    raise RuntimeError("the run stops here")
        except RuntimeError:
            pass


async def _spend(url: str) -> None:
    from loomflow.governance.budget import Amount, Bucket
    from loomflow.stores import Stores

    async with Stores(Settings(runtime_url=url)) as stores:
        await stores.budget.record([Bucket("user", "ana")], Amount(3, 4, wall_s=1.5))


# -- one time format: users export, approvals -------------------------------------------------


async def _keyed_runs(url: str) -> None:
    """Runs of ana: an agent's (memory on) and steps with idempotency keys."""
    from loomflow.agent import Agent
    from loomflow.models import ScriptedModel
    from loomflow.stores import Stores

    async def charge(order: str) -> dict[str, Any]:
        return {"order": order, "receipt": f"r-{order}"}

    async with Stores(Settings(runtime_url=url)) as stores:
        runtime = stores.runtime
        assert runtime is not None
        agent = Agent("x", model=ScriptedModel(["hi"]), runtime=runtime, telemetry=False)
        await agent.run("hello", session_id="chat", user_id="ana")
        async with runtime.session("orders", user_id="ana"):
            await runtime.step("charge", charge, "42", idempotency_key="charge-order-42")
            await runtime.step("charge", charge, "43", idempotency_key="charge-order-43")
        async with runtime.session("orders", user_id="bob"):
            await runtime.step("charge", charge, "44", idempotency_key="charge-order-44")


def test_users_export_gives_every_time_in_the_one_format(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_keyed_runs(url))
    done = loomflow("--url", url, "users", "export", "ana")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    journal = document["journal"]
    times = [document["exported_at"], document["memory"]["exported_at"]]
    for session in journal["sessions"]:
        times += [session["updated_at"], session["created_at"]]
    times += [e["created_at"] for e in journal["entries"]]
    assert len(times) == 2 + 2 * 2 + len(journal["entries"])
    for value in times:
        assert isinstance(value, str), value
        assert ISO.match(value), value


async def _waiting_run(url: str) -> str:
    """A run stopped at a call that waits for approval; its request id."""
    from loomflow.agent import Agent
    from loomflow.governance import StandardPermissions
    from loomflow.messages import ToolCall
    from loomflow.models import ScriptedModel
    from loomflow.tools import Tool

    def notify(to: str) -> str:
        """Send a notice."""
        return f"sent to {to}"

    script = [[ToolCall(id="c0", name="notify", arguments={"to": "ops"})], "done"]
    async with Agent.from_settings(
        "x",
        model=ScriptedModel(script),
        settings=Settings(runtime_url=url),
        tools=[Tool(notify, edits=True)],
        permissions=StandardPermissions(approval="defer"),
        memory=False,
        telemetry=False,
    ) as agent:
        stopped = await agent.run("notify ops", session_id="ops-1", user_id="ana")
    (request,) = stopped.pending_approvals
    return request.request_id


def test_approval_times_are_in_the_one_format(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    request_id = asyncio.run(_waiting_run(url))
    listed = loomflow("--url", url, "approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert ISO.match(row["requested_at"]), row
    table = loomflow("--url", url, "approvals", "list").stdout
    shown = row["requested_at"][:19].replace("T", " ")
    assert re.search(rf"\s{re.escape(shown)}\s", table), table
    decided = loomflow(
        "--url", url, "approvals", "approve", request_id, "--session", "ops-1", "--json"
    )
    assert decided.returncode == 0, decided.stderr
    assert ISO.match(json.loads(decided.stdout)["decided_at"]), decided.stdout
    # A time journaled by an earlier build (+00:00) is shown in the one format too.
    from loomflow.cli.approvals import _iso

    assert _iso("2026-12-04T22:37:16.123456+00:00") == "2026-12-04T22:37:16.123456Z"
    assert _iso("") == ""


# -- users export: the results kept under idempotency keys ------------------------------------


def test_users_export_lists_the_idempotency_results_that_forget_deletes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_keyed_runs(url))
    done = loomflow("--url", url, "users", "export", "ana")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    keyed = document["journal"]["idempotency"]
    assert [(r["key"], r["session_id"], r["name"], r["user_id"]) for r in keyed] == [
        ("charge-order-42", "orders", "charge", "ana"),
        ("charge-order-43", "orders", "charge", "ana"),
    ]
    for row in keyed:
        assert row["size"] > 0
        assert "value" not in row  # described, as the journal entries are
        assert ISO.match(row["created_at"]), row
    assert document["counts"]["idempotency results"] == 2
    # forget deletes them, and the export then shows none; another user's stay.
    assert loomflow("--url", url, "users", "forget", "ana", "--yes").returncode == 0
    after = json.loads(loomflow("--url", url, "users", "export", "ana").stdout)
    assert after["journal"]["idempotency"] == []
    bob = json.loads(loomflow("--url", url, "users", "export", "bob").stdout)
    assert [r["key"] for r in bob["journal"]["idempotency"]] == ["charge-order-44"]


def _workers_of(workdir: Path) -> list[int]:
    """Demo workers still running for ``workdir`` (their command line names its ledger)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"loomflow.cli._demo_task" in cmdline and str(workdir).encode() in cmdline:
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize(("lines_before", "then"), [(1, 0.0), (3, 0.0), (3, 0.3), (3, 0.6)])
def test_ctrl_c_stops_the_demo_and_its_worker_without_a_traceback(
    tmp_path: Path, lines_before: int, then: float
) -> None:
    workdir = tmp_path / "demo"
    # As a terminal does: the demo leads a process group, and Ctrl-C signals the whole group.
    demo = subprocess.Popen(
        [sys.executable, "-m", "loomflow.cli", "demo", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        start_new_session=True,
    )
    assert demo.stdout is not None
    for _ in range(lines_before):  # the banner, the blank line, the worker's start
        demo.stdout.readline()
    time.sleep(then)  # the worker importing loomflow, or running
    os.killpg(demo.pid, signal.SIGINT)
    _, err = demo.communicate(timeout=120)
    assert demo.returncode in (130, 0), (demo.returncode, err)  # 0: it had already finished
    assert "Traceback" not in err, err
    assert _workers_of(workdir) == []


def test_a_short_console_token_is_said_to_be_short_in_characters(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOMFLOW_CONSOLE_TOKEN", "short")
    assert cli_main.main(["settings"]) == 1
    assert capsys.readouterr().err == (
        "loomflow: error: bad setting LOOMFLOW_CONSOLE_TOKEN: a console token must be 16 "
        "characters or more\n"
    )
    monkeypatch.setenv("LOOMFLOW_CONSOLE_TOKEN", "x" * 16)
    assert cli_main.main(["settings"]) == 0
    assert "x" * 16 not in capsys.readouterr().out  # a secret, never printed


def test_settings_warns_of_hashed_user_ids_without_their_key(tmp_path: Path) -> None:
    # Each valid alone; together the telemetry set-up refuses to start, which `settings`
    # used to show as fine.
    env = {"LOOMFLOW_TELEMETRY_USER_IDS": "hashed"}
    done = loomflow("settings", "--json", env=clean_env(**env), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "LOOMFLOW_TELEMETRY_USER_IDS=hashed needs LOOMFLOW_TELEMETRY_USER_ID_KEY" in done.stderr
    # It named setup_telemetry() as refusing, which starts without a word (it builds no
    # Telemetry); the agent built next is what refuses, as the warning now says.
    assert "setup_telemetry" not in done.stderr
    check = (
        "from loomflow import Agent\n"
        "from loomflow.errors import ConfigurationError\n"
        "from loomflow.telemetry import setup_telemetry\n"
        "setup_telemetry()\n"
        "try:\n"
        "    Agent('x', model='scripted')\n"
        "except ConfigurationError:\n"
        "    print('agent refused')\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(**env),
        check=False,
    )
    assert ran.stdout == "agent refused\n", ran.stderr
    assert "an agent with the default telemetry (Agent(...)" in done.stderr
    keyed = {**env, "LOOMFLOW_TELEMETRY_USER_ID_KEY": "k" * 16}
    assert "needs" not in loomflow("settings", env=keyed, cwd=tmp_path).stderr
