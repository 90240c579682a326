"""Hostile values on the command line: each one a clear error, or a result that still checks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import clean_env, loomflow

from loomflow import Agent
from loomflow.audit._entry import MIN_TIME_US, iso_time, time_us_of_text
from loomflow.config import Settings
from loomflow.models import ScriptedModel


def _journal_with_a_trail(tmp_path: Path) -> str:
    """The URL of a new journal whose audit log holds one entry (ana's legal hold)."""
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    held = loomflow("--url", url, "users", "hold", "ana", "--reason", "audit test")
    assert held.returncode == 0, held.stderr
    return url


@pytest.mark.parametrize("bound", ["--since", "--until"])
def test_an_export_filtered_from_year_one_verifies(bound: str, tmp_path: Path) -> None:
    # Before: the header said "1-01-01T00:00:00.000000Z" (strftime drops a year's zeros
    # before 1000), and both verifiers refused the export they were handed as unreadable.
    url = _journal_with_a_trail(tmp_path)
    export = tmp_path / "ana.jsonl"
    done = loomflow("--url", url, "audit", "export", bound, "0001-01-01", "-o", str(export))
    assert done.returncode == 0, done.stderr
    assert '"0001-01-01T00:00:00.000000Z"' in export.read_text().splitlines()[0]
    checked = loomflow("audit", "verify", "--file", str(export))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_audit_times_keep_the_zeros_of_early_years() -> None:
    assert iso_time(MIN_TIME_US) == "0001-01-01T00:00:00.000000Z"
    assert time_us_of_text("0999-12-31T23:59:59.999999Z") < 0
    assert iso_time(time_us_of_text("0999-12-31T23:59:59.999999Z")) == "0999-12-31T23:59:59.999999Z"


@pytest.mark.parametrize(
    "export",
    [
        ["users", "export", "ana"],
        ["checkpoints", "export", "--user", "ana"],
        ["audit", "export", "--user", "ana"],
    ],
)
def test_an_export_is_never_written_over_the_journal(export: list[str], tmp_path: Path) -> None:
    # Before: `-o journal.db` replaced the journal with the export (audit export even read
    # the emptied file back and exported 0 entries), and the command said it succeeded.
    url = _journal_with_a_trail(tmp_path)
    journal = tmp_path / "journal.db"
    done = loomflow("--url", url, *export, "-o", str(journal))
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "is a SQLite database" in done.stderr
    assert journal.read_bytes().startswith(b"SQLite format 3\x00")
    checked = loomflow("--url", url, "audit", "verify")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "checked 1 entries" in checked.stdout
    # A file of the export's own (written once already) is still overwritten as before.
    again = tmp_path / "ana.json"
    for _ in range(2):
        assert loomflow("--url", url, *export, "-o", str(again)).returncode == 0


@pytest.mark.parametrize("through_a_link", [False, True], ids=["named", "symlinked"])
@pytest.mark.parametrize("suffix", ["-shm", "-wal"])
def test_an_export_is_never_written_over_the_journals_shm_or_wal(
    suffix: str, through_a_link: bool, tmp_path: Path
) -> None:
    # Before: `-o journal.db-shm` truncated the shared-memory index of a journal in use; every
    # process that had it open (workers, and the export itself) died of SIGBUS. A symlink
    # to the -shm file (`-o out.json`) was judged by its own name and did the same.
    url = _journal_with_a_trail(tmp_path)
    journal = tmp_path / "journal.db"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('PRAGMA journal_mode=WAL'); c.execute('CREATE TABLE IF NOT EXISTS t(x)')\n"
            "c.execute('INSERT INTO t VALUES (1)'); print('open', flush=True)\n"
            "while True:\n"
            "    c.execute('SELECT count(*) FROM t').fetchall(); time.sleep(0.01)\n",
            str(journal),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline() == "open\n"
        target = tmp_path / f"journal.db{suffix}"
        before = target.read_bytes()
        out = target
        if through_a_link:
            out = tmp_path / "out.json"
            out.symlink_to(target)
        done = loomflow("--url", url, "users", "export", "ana", "-o", str(out))
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert f"is the {suffix[1:]} file of the SQLite database" in done.stderr
        assert target.read_bytes()[:32] == before[:32]
        assert worker.poll() is None, f"the worker died ({worker.returncode})"
    finally:
        worker.kill()
        worker.wait()
        if worker.stdout is not None:
            worker.stdout.close()


def test_the_demo_on_a_server_that_does_not_answer_says_so_in_one_line(tmp_path: Path) -> None:
    # Before: the story began on stdout, the worker printed its error, then the demo another.
    work = tmp_path / "work"
    done = loomflow(
        "demo", "--postgres", "postgresql://root@127.0.0.1:1/test", "--workdir", str(work)
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("loomflow: error: postgres connect failed: "), done.stderr
    assert not work.exists()


@pytest.mark.parametrize(
    ("export", "own"),
    [
        (["audit", "export"], "audit.jsonl"),
        (["audit", "export"], "audit.jsonl.heads"),
        (["users", "export", "ana"], "audit.jsonl"),
        (["checkpoints", "export", "--user", "ana"], "audit.jsonl"),
        # Its heads file too: overwritten, every later append was refused as damage.
        (["users", "export", "ana"], "audit.jsonl.heads"),
        (["checkpoints", "export", "--user", "ana"], "audit.jsonl.heads"),
        (["users", "export", "ana"], "audit.jsonl.lock"),
    ],
)
def test_an_export_is_never_written_over_a_jsonl_audit_log(
    export: list[str], own: str, tmp_path: Path
) -> None:
    # Before: `audit export -o audit.jsonl` on that very log emptied it, "exported 0 audit
    # entries", and the tamper-evident trail was gone.
    log = tmp_path / "audit.jsonl"
    env = clean_env(LOOMFLOW_AUDIT_URL=str(log))
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate", env=env).returncode == 0
    assert loomflow("--url", url, "users", "hold", "ana", "--reason", "r", env=env).returncode == 0
    files = [log, tmp_path / "audit.jsonl.heads", tmp_path / "audit.jsonl.lock"]
    before = [f.read_bytes() for f in files]
    done = loomflow("--url", url, *export, "-o", str(tmp_path / own), env=env)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "audit log" in done.stderr
    assert [f.read_bytes() for f in files] == before
    checked = loomflow("--url", url, "audit", "verify", env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr


_QUERY = "reads no ?query or #fragment"
_TILDE = "'~' is not expanded here"


@pytest.mark.parametrize(
    ("option", "url", "why"),
    [
        ("--url", "sqlite:///journal.db?mode=ro", _QUERY),
        ("--url", "sqlite:///journal.db#main", _QUERY),
        ("LOOMFLOW_RUNTIME_URL", "sqlite:///journal.db?timeout=5", _QUERY),
        ("LOOMFLOW_AUDIT_URL", "jsonl:///audit.jsonl?x=1", _QUERY),
        ("audit --audit-url", "sqlite:///journal.db?mode=ro", _QUERY),
        ("--url", "sqlite:///~/app/journal.db", _TILDE),
        ("--url", "~/app/journal.db", _TILDE),
        ("LOOMFLOW_RUNTIME_URL", "sqlite:///~/app/journal.db", _TILDE),
        ("LOOMFLOW_AUDIT_URL", "jsonl:///~/audit.jsonl", _TILDE),
        ("audit --audit-url", "sqlite:///~alice/journal.db", _TILDE),
    ],
)
def test_a_file_url_with_a_query_or_a_tilde_is_refused_and_makes_no_file(
    option: str, url: str, why: str, tmp_path: Path
) -> None:
    # Before: SQLAlchemy-style options were part of the file name: `sqlite:///journal.db?mode=ro`
    # made a new, empty journal named "journal.db?mode=ro" beside the real one. And no shell
    # expands '~' in a setting: `sqlite:///~/app/journal.db` made a directory named '~' in
    # the working directory, and an empty journal in it.
    if option.startswith("LOOMFLOW_"):
        done = loomflow("audit", "verify", cwd=tmp_path, env=clean_env(**{option: url}))
    elif option == "--url":
        done = loomflow("--url", url, "migrate", cwd=tmp_path)
    else:
        done = loomflow("audit", "--audit-url", url, "verify", cwd=tmp_path)
    assert done.returncode != 0
    assert why in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sqlite_runtime_refuses_a_path_under_a_tilde() -> None:
    from loomflow.errors import ConfigurationError
    from loomflow.runtime import SqliteRuntime

    with pytest.raises(ConfigurationError, match=_TILDE):
        SqliteRuntime("~/journal.db")


def test_a_bare_path_may_still_name_a_file_with_a_question_mark(tmp_path: Path) -> None:
    done = loomflow("--url", "odd?.db", "migrate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "odd?.db").read_bytes().startswith(b"SQLite format 3\x00")


@pytest.mark.parametrize(
    "command",
    [
        ["demo", "--workdir", ""],
        ["audit", "verify", "--file", " "],
        ["users", "export", "ana", "-o", ""],
        ["console", "--tokens-file", ""],
    ],
)
def test_an_empty_path_is_refused_by_name(command: list[str], tmp_path: Path) -> None:
    # Before: Path("") is the current directory: `demo --workdir "$UNSET"` wrote its journal
    # and ledger there.
    done = loomflow(*command, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "an empty path" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_empty_tokens_file_is_named_as_such(tmp_path: Path) -> None:
    from loomflow.console._access import load_tokens
    from loomflow.errors import ConfigurationError

    tokens = tmp_path / "tokens"
    tokens.write_text("# filled in by the deploy\n\n")
    with pytest.raises(ConfigurationError, match="holds no `role token name` line"):
        load_tokens(tokens)


def test_a_tokens_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    # An editor that saves UTF-8 with a BOM (Notepad) made the first role "\ufeffadmin", and
    # the console refused to start: "role must be reader or admin, not '\ufeffadmin'".
    from loomflow.console._access import load_tokens

    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin {'t' * 20} ada\r\nreader {'u' * 20} rob\r\n", encoding="utf-8-sig")
    assert tokens.read_bytes().startswith(b"\xef\xbb\xbf")
    assert [(e.role, e.name) for e in load_tokens(tokens)] == [("admin", "ada"), ("reader", "rob")]


# Sessions of one user that a plain cell showed alike: spaces at an end, a line separator
# (written as its escape) beside the escape typed as text, "-" beside an entry of no session.
HOSTILE_SESSIONS = ("s-1", "s-1 ", " s-1", "-", "a\u2028b", "a\\u2028b", "'x'")


async def _runs_in_sessions(url: str) -> None:
    settings = Settings(runtime_url=url)
    async with Agent.from_settings("S.", model=ScriptedModel(["hi"] * 9), settings=settings) as a:
        for session in HOSTILE_SESSIONS:
            await a.run("hello", session_id=session, user_id="ana")


def test_tables_tell_sessions_apart_that_read_alike(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_runs_in_sessions(url))
    assert loomflow("--url", url, "users", "hold", "ana", "--reason", "r").returncode == 0
    expected = {"s-1", "'s-1 '", "' s-1'", "'-'", "'a\\u2028b'", "a\\u2028b", "\"'x'\""}
    assert _column(url, ["runs", "list"], "session", "user") == expected
    # The hold is the one audit entry of no session: "-", and the session "-" quoted.
    audit = ["audit", "query", "--limit", "1000"]
    assert _column(url, audit, "session", "actor") == expected | {"-"}


def _column(url: str, command: list[str], start: str, end: str) -> set[str]:
    """The cells of a table's column (from header ``start`` to ``end``), as printed."""
    done = loomflow("--url", url, *command)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.strip().splitlines()
    cells = {row[header.index(start) : header.index(end)].rstrip() for row in rows}
    cells.discard("")  # the line that offers the next page
    return cells


@pytest.mark.parametrize("variable", ["LOOMFLOW_RUNTIME_URL", "LOOMFLOW_AUDIT_URL"])
def test_a_postgres_url_setting_that_is_not_utf8_is_named(variable: str, tmp_path: Path) -> None:
    # Before: a DSN holding a byte that is not UTF-8 (an environment set from Latin-1 text)
    # reached asyncpg, which failed mid-handshake with a traceback ("surrogates not allowed").
    # "\udcff" is how Python reads the byte 0xff of the environment; it is passed back as it.
    env = clean_env(**{variable: "postgresql://postgres@127.0.0.1:5432/caf\udcff"})
    done = loomflow("runs", "list", cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"bad setting {variable}" in done.stderr
    assert "not UTF-8 text" in done.stderr


# One name, three spellings: precomposed é (NFC), e plus a combining accent (NFD, as macOS
# spells file names) and the "fi" ligature. Ids compare code point for code point, so these
# are three users; a table showing them raw read as "café" twice and "file" twice.
READ_ALIKE_USERS = {"café": "café", "cafe\u0301": "'cafe\\u0301'", "\ufb01le": "'\\ufb01le'"}


async def _runs_of_users(url: str) -> None:
    settings = Settings(runtime_url=url)
    async with Agent.from_settings("S.", model=ScriptedModel(["hi"] * 9), settings=settings) as a:
        for user in (*READ_ALIKE_USERS, "file"):
            await a.run("hello", session_id="s", user_id=user)


def test_tables_and_messages_tell_users_apart_that_read_alike(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    asyncio.run(_runs_of_users(url))
    expected = {*READ_ALIKE_USERS.values(), "file"}
    assert _column(url, ["runs", "list"], "user", "runs") == expected
    assert _column(url, ["audit", "query", "--limit", "1000"], "user", "seq") == expected
    # Each still reaches its own user, by the id as it is.
    for user in READ_ALIKE_USERS:
        done = loomflow("--url", url, "runs", "list", "--user", user, "--json")
        assert done.returncode == 0, done.stderr
        assert [json.loads(line)["user_id"] for line in done.stdout.splitlines()] == [user]
    done = loomflow("--url", url, "runs", "show", "nope", "--user", "cafe\u0301")
    assert done.returncode != 0
    assert "user 'cafe\\u0301'" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("command", "hint"),
    [
        (["runs", "show", "-x"], "as in loomflow runs show ... -- -x)"),
        (["users", "forget", "-x", "--yes"], "as in loomflow users forget ... -- -x)"),
        (["runs", "show", "s", "--user", "-x"], "write --user=-x)"),
        (["audit", "query", "--session", "-x"], "write --session=-x)"),
    ],
    ids=["positional", "positional-group", "option", "audit-option"],
)
def test_an_id_that_starts_with_a_dash_is_named_with_the_way_to_pass_it(
    command: list[str], hint: str, tmp_path: Path
) -> None:
    # argparse reads "-x" as an unknown option, then said only "the following arguments are
    # required: session_id" or "argument --user: expected one argument", never naming it.
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    done = loomflow("--url", url, *command)
    assert done.returncode == 2
    assert "'-x' starts with '-', so it was read as an option" in done.stderr, done.stderr
    assert done.stderr.rstrip().endswith(hint), done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["users", "export", "-o", "-"],  # "-" is stdout, a value argparse never takes as option
        ["runs", "show", "--js"],  # argparse reads it as --json
        ["runs", "show", "--user", "-a b"],  # a token with a space is a value to argparse
    ],
    ids=["stdout", "abbreviation", "space"],
)
def test_a_dash_led_token_argparse_took_as_a_value_or_option_gets_no_hint(
    command: list[str], tmp_path: Path
) -> None:
    # The hint blamed these for the missing id ("'-' starts with '-', so it was read as an
    # option: ... -- -"), sending the user to quote a token that was never the problem.
    done = loomflow("--url", f"sqlite:///{tmp_path / 'journal.db'}", *command)
    assert done.returncode == 2
    assert "required" in done.stderr, done.stderr
    assert "starts with '-'" not in done.stderr, done.stderr


def test_the_ways_the_dash_hint_gives_do_reach_the_user(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    settings = Settings(runtime_url=url)

    async def run() -> None:
        async with Agent.from_settings("S.", model=ScriptedModel(["hi"]), settings=settings) as a:
            await a.run("hello", session_id="-s", user_id="-x")

    asyncio.run(run())
    shown = loomflow("--url", url, "runs", "show", "--user=-x", "--", "-s")
    assert shown.returncode == 0, shown.stderr
    assert "model_call_0" in shown.stdout
    listed = loomflow("--url", url, "runs", "list", "--user=-x", "--json")
    assert [json.loads(line)["session_id"] for line in listed.stdout.splitlines()] == ["-s"]
    # A missing id with no dash-led token in sight gets no hint.
    missing = loomflow("--url", url, "runs", "show")
    assert missing.returncode == 2
    assert "starts with '-'" not in missing.stderr
