"""The command line, run as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def loomflow(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomflow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
        env={**os.environ, **env} if env else None,
    )


def demo_file(workdir: Path, suffix: str) -> Path:
    """The one file of a demo run in ``workdir`` (the demo names its files after the run)."""
    (found,) = workdir.glob(f"loomflow-demo-*{suffix}")
    return found


def test_demo_kills_a_worker_resumes_and_proves_no_side_effect_repeated(tmp_path: Path) -> None:
    result = loomflow("demo", "--workdir", str(tmp_path), "--kill-after", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "killed with SIGKILL" in out
    assert "replayed from journal" in out
    assert "ran fresh" in out
    # Four model calls and five tool calls, then the run's episode (written once, fresh).
    assert "hits=5 misses=6 divergences=0" in out
    assert "the run's episode (memory)" in out
    assert "chain verified: ok" in out
    assert "tool.replay      charge_card" in out  # the replay is audited as a replay
    assert out.count("tool.call        charge_card") == 1  # and the charge once, as live
    # The killed worker's hold for its call in flight is charged, and the report says so.
    assert "reserved by the killed worker for the call it was starting" in out
    assert ", 0 held" in out
    ledger = [
        json.loads(line)
        for line in demo_file(tmp_path, "-side-effects.jsonl").read_text().splitlines()
    ]
    assert len(ledger) == 5
    assert len({r["action"] for r in ledger}) == 5
    assert len({r["pid"] for r in ledger}) == 2  # the killed worker and the resuming process


@pytest.mark.postgres
def test_demo_on_postgres(tmp_path: Path, pg_dsn: str) -> None:
    # Twice on one database: each demo reports only its own run's budget and audit trail.
    used = []
    for _ in range(2):
        result = loomflow("demo", "--postgres", pg_dsn, "--workdir", str(tmp_path))
        assert result.returncode == 0, result.stderr
        assert "hits=7 misses=4" in result.stdout  # the last miss: the run's episode
        assert "(31 entries, both processes)" in result.stdout  # 6 model.start
        budget = next(line for line in result.stdout.splitlines() if line.startswith("budget:"))
        used.append(int(budget.split()[1].replace(",", "")))
    assert used[0] == used[1]


def test_migrate_show_and_prune(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    assert loomflow("--url", url, "migrate").stdout.startswith("journal schema at version")
    assert loomflow("demo", "--workdir", str(tmp_path)).returncode == 0
    import sqlite3

    with sqlite3.connect(demo_file(tmp_path, ".db")) as conn:
        session, user = conn.execute("SELECT session_id, user_id FROM loom_sessions").fetchone()
    assert user.startswith("alice+")  # a user of its own per demo run
    demo_url = f"sqlite:///{demo_file(tmp_path, '.db')}"
    shown = loomflow("--url", demo_url, "runs", "show", session, "--user", user, "--json")
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    names = [r["name"] for r in rows]
    assert names[:2] == ["model_call_0", names[1]]
    assert names[1].startswith("tool_call_0_0_")
    assert len(names) == 11
    assert names[-1] == "persist_episode_5"
    table = loomflow("--url", demo_url, "runs", "show", session, "--user", user)
    assert "model_call_4" in table.stdout
    assert "replays" in table.stdout
    listed = loomflow("--url", demo_url, "runs", "list", "--json")
    (entry,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert entry["session_id"] == session
    assert entry["user_id"] == user
    assert entry["entries"] == 11
    assert entry["open"] is False
    people = loomflow("--url", demo_url, "runs", "list", "--user", "nobody")
    assert people.stdout.strip() == "no runs of user 'nobody' in the journal"
    assert "finished" in loomflow("--url", demo_url, "runs", "list").stdout
    # --url after the command, where people type it; the later one wins over an earlier one.
    after = loomflow("runs", "list", "--json", "--url", demo_url)
    assert [json.loads(line)["session_id"] for line in after.stdout.splitlines()] == [session]
    later = loomflow("--url", url, "runs", "show", session, "--user", user, "--url", demo_url)
    assert "model_call_4" in later.stdout
    earlier = loomflow("--url", url, "runs", "list", "--json")  # url's journal is empty
    assert earlier.stdout.strip() == ""
    assert "epoch" in table.stdout
    kept = loomflow(
        "--url",
        demo_url,
        "journal",
        "prune",
        "--json",
        env={"LOOMFLOW_JOURNAL_RETENTION_DAYS": "1"},
    )
    assert json.loads(kept.stdout) == {"deleted": 0}  # a day's retention keeps today's run
    refused = loomflow("--url", demo_url, "journal", "prune")
    assert refused.returncode == 2  # no filter and no retention: say --all
    assert "--all" in refused.stderr
    dry = loomflow("--url", demo_url, "journal", "prune", "--all", "--dry-run", "--json")
    assert json.loads(dry.stdout) == {"would_delete": 11}
    pruned = loomflow("--url", demo_url, "journal", "prune", "--all", "--json")
    assert json.loads(pruned.stdout) == {"deleted": 11}


def test_version() -> None:
    import loomflow as package

    done = loomflow("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"loomflow {package.__version__}"


def test_errors_and_usage_have_distinct_exit_codes(tmp_path: Path) -> None:
    bad_url = loomflow("--url", "mysql://x", "migrate")
    assert bad_url.returncode == 1
    assert "scheme" in bad_url.stderr
    assert loomflow("journal", "prune", "--older-than", "soon").returncode == 2
    assert loomflow("no-such-command").returncode == 2


# Every option that takes an age or a time, with a value no datetime can hold.
_OUT_OF_RANGE = [
    ("audit", "query", "--since", "999999999d"),
    ("audit", "query", "--since", "999999d"),
    ("audit", "query", "--until", "99999999999d"),
    ("audit", "query", "--since", "9" * 400 + "w"),
    ("audit", "query", "--since", "9999-12-31T23:59:59-12:00"),  # year 10000 in UTC
    ("audit", "query", "--until", "0001-01-01T00:00:00+05:00"),  # year 0 in UTC
    ("audit", "export", "--since", "999999999d"),
    ("audit", "export", "--until", "9999-12-31T23:00-05:00"),
    ("audit", "retain", "--dry-run", "--older-than", "9999999d"),
    ("audit", "retain", "--dry-run", "--older-than", "999999999999999999999d"),
    ("journal", "prune", "--dry-run", "--older-than", "99999999999999d"),
    ("budget", "prune", "--dry-run", "--older-than", "9999999d"),
]


def test_ages_and_times_out_of_range_are_usage_errors(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    for argv in _OUT_OF_RANGE:
        done = loomflow("--url", url, *argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert "Traceback" not in done.stderr, argv
        assert done.stdout == ""
        # argparse's report, as for any bad option value: the option named, then why.
        last = done.stderr.strip().splitlines()[-1]
        assert f": error: argument {argv[-2]}: " in last, (argv, last)
        assert "out of range" in last, (argv, last)
    # The longest age there is (1000 years) still works, everywhere.
    for argv in (
        ("audit", "query", "--since", "365000d"),
        ("audit", "retain", "--dry-run", "--older-than", "365000d"),
        ("journal", "prune", "--dry-run", "--older-than", "365000d"),
        ("budget", "prune", "--dry-run", "--older-than", "52142w"),
    ):
        done = loomflow("--url", url, *argv)
        assert done.returncode == 0, (argv, done.stderr)
    # The retention setting is an age too: out of range, it is a bad setting, not a crash.
    for days in ("1e12", "inf"):
        done = loomflow(
            "--url",
            url,
            "journal",
            "prune",
            "--dry-run",
            env={"LOOMFLOW_JOURNAL_RETENTION_DAYS": days},
        )
        assert done.returncode == 1, (days, done.stderr)
        assert done.stderr.startswith("loomflow: error: bad setting LOOMFLOW_JOURNAL_RETENTION")
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["runs", "list"],
        ["journal", "prune", "--all"],
        ["checkpoints", "list", "s"],
        ["budget", "show"],
        ["audit", "verify"],
    ],
)
def test_commands_that_read_a_store_refuse_a_mistyped_path(
    tmp_path: Path, command: list[str]
) -> None:
    # No empty database is created at the typo, and the exit code says something is wrong.
    typo = tmp_path / "tpyo" / "journal.db"
    done = loomflow("--url", f"sqlite:///{typo}", *command, cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert f"at {typo}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not typo.parent.exists()


def test_a_bad_setting_is_named_without_a_traceback(tmp_path: Path) -> None:
    done = loomflow("runs", "list", cwd=tmp_path, env={"LOOMFLOW_JOURNAL_RETENTION_DAYS": "0"})
    assert done.returncode == 1
    assert "LOOMFLOW_JOURNAL_RETENTION_DAYS" in done.stderr
    assert "Traceback" not in done.stderr


def test_without_auto_migration_the_cli_says_to_migrate(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    (tmp_path / "j.db").touch()  # exists, never migrated
    off = {"LOOMFLOW_AUTO_MIGRATE": "false"}
    done = loomflow("--url", url, "runs", "list", env=off)
    assert done.returncode == 1
    assert f"run `loomflow migrate --url {url}` first" in done.stderr
    assert loomflow("--url", url, "migrate", env=off).returncode == 0
    assert loomflow("--url", url, "runs", "list", env=off).returncode == 0


def test_commands_that_read_add_no_tables_and_upgrade_no_schema(tmp_path: Path) -> None:
    import sqlite3

    app = tmp_path / "app.db"  # another application's database, named by mistake
    with sqlite3.connect(app) as db:
        db.execute("CREATE TABLE customers (id INTEGER)")
    for command in (["runs", "list"], ["budget", "show"], ["audit", "verify"],
                    ["users", "export", "bob"], ["checkpoints", "list", "s"],
                    ["approvals", "list"], ["users", "hold", "bob", "--reason", "r"]):  # fmt: skip
        done = loomflow("--url", f"sqlite:///{app}", *command)
        assert done.returncode == 1, command
        assert "holds no loomflow store yet" in done.stderr, command
    with sqlite3.connect(app) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    assert tables == ["customers"]
    # A journal one release behind: a listing must not upgrade it under the old workers.
    old = tmp_path / "old.db"
    url = f"sqlite:///{old}"
    assert loomflow("--url", url, "migrate").returncode == 0
    with sqlite3.connect(old) as db:
        db.execute("DROP TRIGGER IF EXISTS loom_audit_no_delete")
        db.execute(
            "DELETE FROM loom_schema_version WHERE component = 'journal' AND version = "
            "(SELECT MAX(version) FROM loom_schema_version WHERE component = 'journal')"
        )
        before = db.execute("SELECT COUNT(*) FROM loom_schema_version").fetchone()
    for command in (["runs", "list"], ["budget", "show"], ["users", "export", "bob"]):
        done = loomflow("--url", url, *command)
        assert done.returncode == 1, command
        assert f"run `loomflow migrate --url {url}` once every worker runs" in done.stderr
    with sqlite3.connect(old) as db:
        assert db.execute("SELECT COUNT(*) FROM loom_schema_version").fetchone() == before


def test_a_full_disk_a_bad_port_and_a_utf16_env_file_are_one_line_each(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    for command in (["runs", "list"], ["settings"]):  # stdout on a full disk
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [sys.executable, "-m", "loomflow.cli", "--url", url, *command],
                stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, check=False,
            )  # fmt: skip
        assert done.returncode == 1, command
        assert done.stderr.splitlines() == [
            "loomflow: error: the output could not be written: No space left on device"
        ], command
    assert loomflow("--url", url, "users", "hold", "bob", "--reason", "r").returncode == 0
    written = loomflow("--url", url, "audit", "export", "-o", "/dev/full")
    assert written.returncode == 1
    assert written.stderr.endswith("could not be written: No space left on device\n")
    for command in (["worker", "app:agents", "--once", "--port", "99999"],
                    ["worker", "app:agents", "--port", "-1"],
                    ["console", "--port", "70000"], ["console", "--port", "0"]):  # fmt: skip
        refused = loomflow(*command, cwd=tmp_path)
        assert refused.returncode == 2, command
        assert "is not a port" in refused.stderr
        assert "Traceback" not in refused.stderr
    (tmp_path / ".env").write_text("LOOMFLOW_RUNTIME_URL=memory://\n", encoding="utf-16")
    odd = loomflow("runs", "list", cwd=tmp_path)
    assert odd.returncode == 1
    assert odd.stderr.startswith("loomflow: error: a file read is not UTF-8 text"), odd.stderr
    assert "Traceback" not in odd.stderr


def test_session_and_user_ids_on_the_command_line_meet_the_id_rule(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    for command, named in (
        (["runs", "show", ""], "session_id must not be empty"),
        (["runs", "show", "x" * 100_000], "session_id is 100000 bytes long"),
        (["runs", "list", "--user", ""], "user_id must not be empty"),
        (["budget", "show", "--user", "a\nb"], "user_id contains the control character"),
        (["journal", "prune", "--session", ""], "session_id must not be empty"),
    ):
        done = loomflow("--url", url, *command)
        assert done.returncode == 1, command
        assert done.stderr.startswith(f"loomflow: error: {named}"), (command, done.stderr)
        assert len(done.stderr) < 300, command  # an overlong id is not echoed back whole


def test_dash_is_stdout_and_app_login_needs_an_app_role(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    assert loomflow("--url", url, "users", "hold", "bob", "--reason", "r").returncode == 0
    done = loomflow("--url", url, "users", "export", "bob", "-o", "-", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["user_id"] == "bob"
    assert not (tmp_path / "-").exists()
    lone = loomflow("--url", url, "migrate", "--app-login")
    assert lone.returncode == 2
    assert "--app-login goes with --app-role" in lone.stderr


def test_a_memory_store_and_a_mistyped_audit_url_are_refused_not_written(tmp_path: Path) -> None:
    # A memory:// store of a command's own is empty and gone at exit: a hold placed there, or
    # a verify that passes on it, would be a report of something that never happened.
    for command in (
        ["users", "hold", "bob", "--reason", "litigation"],
        ["audit", "verify"],
        ["runs", "list"],
        ["approvals", "list"],
    ):
        done = loomflow("--url", "memory://", *command, cwd=tmp_path)
        assert done.returncode == 1, command
        assert "lives inside the process that made it" in done.stderr, command
        assert done.stdout == "", command
        # SQLite's own in-memory database is the same: a new, empty one per connection.
        done = loomflow("--url", "sqlite:///:memory:", *command, cwd=tmp_path)
        assert done.returncode == 1, command
        assert "SQLite :memory:" in done.stderr, command
        assert done.stdout == "", command
    url = f"sqlite:///{tmp_path / 'j.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    typo = f"sqlite:///{tmp_path / 'audti.db'}"
    cancel = loomflow("--url", url, "runs", "cancel", "s1", "--user", "ana", "--audit-url", typo)
    assert cancel.returncode == 1
    assert "no audit log at" in cancel.stderr
    assert not (tmp_path / "audti.db").exists()


# -- progress bars: drawn on a terminal's stderr, never into pipes --------------------------


def loomflow_on_a_terminal(*args: str, columns: int | None = None) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (stdout stays a pipe).

    Returns the exit code, stdout, and what the terminal was sent. ``columns`` sets the
    terminal's size; without it the terminal reports 0x0, as a bare pty does.
    """
    import fcntl
    import os
    import select
    import struct
    import termios
    import time

    master, slave = os.openpty()
    if columns is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    with subprocess.Popen(
        [sys.executable, "-m", "loomflow.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
    ) as proc:
        os.close(slave)
        assert proc.stdout is not None
        # Read both at once: a child blocked on a full stdout pipe never closes the terminal.
        piped = proc.stdout.fileno()
        got: dict[int, bytes] = {master: b"", piped: b""}
        open_fds = set(got)
        deadline = time.monotonic() + 120
        while open_fds and time.monotonic() < deadline:
            for fd in select.select(list(open_fds), [], [], 1)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child closed its end of the terminal
                    chunk = b""
                if chunk:
                    got[fd] += chunk
                else:
                    open_fds.discard(fd)
        os.close(master)
        code = proc.wait(timeout=10)
    return code, got[piped].decode(), got[master].decode(errors="replace")


async def _journal_with_entries(path: Path, sessions: int, steps: int) -> None:
    from loomflow.runtime import SqliteRuntime

    runtime = SqliteRuntime(path)
    try:
        for s in range(sessions):
            async with runtime.session(f"s{s}", "alice"):
                for i in range(steps):
                    await runtime.step(f"step{i}", lambda i=i: i)
    finally:
        await runtime.close()


async def test_prune_draws_a_bar_on_a_terminal_and_nothing_into_a_pipe(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    url = f"sqlite:///{db}"
    await _journal_with_entries(db, 6, 5)
    # A prune keeps the runs of users under legal hold, so it reads the audit log's holds:
    # a journal written by the runtime alone gets its (empty) log from migrate.
    assert loomflow("--url", url, "migrate").returncode == 0
    code, out, screen = loomflow_on_a_terminal(
        "--url", url, "journal", "prune", "--all", "--batch-size", "7", columns=100
    )
    assert code == 0, screen
    assert out == "deleted 30 journal entries\n"
    assert "pruning: 100%|" in screen  # tqdm's bar, filled
    assert "30/30" in screen
    assert "deleted" not in screen  # the result went to stdout, only the bar to the terminal

    await _journal_with_entries(db, 2, 5)
    quiet = loomflow_on_a_terminal("--url", url, "journal", "prune", "--all", "--no-progress")
    assert quiet == (0, "deleted 10 journal entries\n", "")

    await _journal_with_entries(db, 2, 5)
    piped = loomflow("--url", url, "journal", "prune", "--all", "--json", "--batch-size", "3")
    assert (piped.returncode, piped.stdout, piped.stderr) == (0, '{"deleted": 10}\n', "")


async def test_audit_export_and_verify_draw_bars_without_touching_stdout(
    tmp_path: Path,
) -> None:
    from loomflow.audit import AuditRecord, SqliteAuditStore

    db = tmp_path / "audit.db"
    store = SqliteAuditStore(db)
    try:
        await store.append(
            [AuditRecord(user_id=f"u{i % 3}", actor="t", action="tool.call") for i in range(1200)]
        )
    finally:
        await store.close()
    audit = ("audit", "--audit-url", f"sqlite:///{db}")

    piped = loomflow(*audit, "export", "--user", "u1")
    assert piped.returncode == 0
    assert piped.stderr == ""
    header, *lines = piped.stdout.splitlines()
    assert json.loads(header) == {"filters": {"user_id": "u1"}, "loomflow_audit_export": 1}
    assert len(lines) == 400
    # A terminal of unknown size (0x0) still gets a bar; the lines on stdout are unchanged.
    code, out, screen = loomflow_on_a_terminal(*audit, "export", "--user", "u1")
    assert code == 0
    assert out == piped.stdout  # byte for byte
    assert "exporting: 100%|" in screen
    assert "400/400" in screen

    code, out, screen = loomflow_on_a_terminal(*audit, "export", "-o", str(tmp_path / "x.jsonl"))
    assert code == 0
    assert "1200/1200" in screen
    assert "exported 1200 audit entries" in screen
    assert (tmp_path / "x.jsonl").read_text().count("\n") == 1200

    code, out, screen = loomflow_on_a_terminal(*audit, "verify", "--json", columns=120)
    assert code == 0
    assert json.loads(out)["entries"] == 1200
    assert "verifying: 100%|" in screen
    assert loomflow_on_a_terminal(*audit, "verify", "--no-progress")[2] == ""
    verified = loomflow(*audit, "verify")
    assert verified.stderr == ""
    assert verified.stdout.startswith("OK: checked 1200 entries of 3 user(s)")


def test_a_bad_batch_size_is_a_usage_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'j.db'}"
    for bad in ("0", "-3", "many", "2.5"):
        result = loomflow("--url", url, "journal", "prune", "--batch-size", bad)
        assert result.returncode == 2, bad
        assert "--batch-size" in result.stderr
        assert "is not a whole number from 1 to" in result.stderr


@pytest.mark.postgres
def test_migrate_brings_every_configured_store_up_to_date(tmp_path: Path, pg_dsn: str) -> None:
    # Journal on SQLite; budget and audit on PostgreSQL, named by the environment.
    url = f"sqlite:///{tmp_path / 'j.db'}"
    env = {"LOOMFLOW_BUDGET_URL": pg_dsn, "LOOMFLOW_AUDIT_URL": pg_dsn}
    done = loomflow("--url", url, "migrate", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for component in ("journal", "checkpoints", "memory", "budget", "audit"):
        assert f"{component} schema at version" in done.stdout
    import asyncpg

    async def components() -> set[str]:
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch("SELECT DISTINCT component FROM loom_schema_version")
        finally:
            await conn.close()
        return {r[0] for r in rows}

    assert asyncio.run(components()) == {"budget", "audit"}
    # Without URLs of their own, the budget and the audit log live in the journal's database.
    bare = loomflow("--url", url, "migrate", cwd=tmp_path)
    assert "budget schema at version" in bare.stdout
    assert "audit schema at version" in bare.stdout
    import sqlite3

    with sqlite3.connect(tmp_path / "j.db") as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert {"loom_entries", "loom_budget_buckets", "loom_audit"} <= tables
    assert not (tmp_path / ".loomflow").exists()


def test_runs_show_finds_the_user_of_a_session_or_asks(tmp_path: Path) -> None:
    from loomflow.runtime import SqliteRuntime

    path = tmp_path / "j.db"

    async def journal() -> None:
        runtime = SqliteRuntime(path)
        for session, user in (("solo", "ana"), ("shared", "ana"), ("shared", "ben"), ("x", None)):
            async with runtime.session(session, user):
                await runtime.step("a", lambda: 1)
        await runtime.close()

    asyncio.run(journal())
    url = f"sqlite:///{path}"
    solo = loomflow("--url", url, "runs", "show", "solo", "--json")
    assert solo.returncode == 0, solo.stderr
    assert [json.loads(line)["user_id"] for line in solo.stdout.splitlines()] == ["ana"]
    shared = loomflow("--url", url, "runs", "show", "shared")
    assert shared.returncode == 1
    assert "several users ('ana', 'ben')" in shared.stderr
    ben = loomflow("--url", url, "runs", "show", "shared", "--user", "ben", "--json")
    assert json.loads(ben.stdout)["user_id"] == "ben"
    anonymous = loomflow("--url", url, "runs", "show", "x", "--anonymous", "--json")
    assert json.loads(anonymous.stdout)["user_id"] is None
    missing = loomflow("--url", url, "runs", "show", "nope")
    assert missing.returncode == 1
    assert "no session 'nope'" in missing.stderr


def test_settings_shows_effective_values_without_credentials(tmp_path: Path) -> None:
    env = {
        "LOOMFLOW_RUNTIME_URL": "postgresql://app:s3cret-pw@db:5432/app",
        "LOOMFLOW_REDACT_SECRETS": '["hunter2-vault"]',
        "LOOMFLOW_OTLP_HEADERS": "authorization=Bearer tok-123",
    }
    done = loomflow("settings", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for secret in ("s3cret-pw", "hunter2-vault", "tok-123"):
        assert secret not in done.stdout
    shown = json.loads(done.stdout)
    assert shown["runtime_url"] == {
        "value": "postgresql://app:***@db:5432/app",
        "from": "environment",
    }
    assert shown["lease_seconds"] == {"value": 30.0, "from": "default"}
    table = loomflow("settings", env=env, cwd=tmp_path)
    assert "LOOMFLOW_RUNTIME_URL" in table.stdout
    assert "s3cret-pw" not in table.stdout
    assert "warning" not in done.stderr + table.stderr  # every variable above is a setting


def test_settings_warns_of_a_variable_that_names_no_setting(tmp_path: Path) -> None:
    env = {"LOOMFLOW_LEASE_SECOND": "5", "LOOMFLOW_WHATEVER": "1"}
    done = loomflow("settings", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lease_seconds"]["value"] == 30.0  # the typo changed nothing
    assert (
        "LOOMFLOW_LEASE_SECOND is not a setting and is ignored (did you mean "
        "LOOMFLOW_LEASE_SECONDS?)" in done.stderr
    )
    assert "LOOMFLOW_WHATEVER is not a setting and is ignored\n" in done.stderr


def test_users_export_gathers_one_users_data_from_every_store(tmp_path: Path) -> None:
    assert loomflow("demo", "--workdir", str(tmp_path)).returncode == 0
    import sqlite3

    with sqlite3.connect(demo_file(tmp_path, ".db")) as conn:
        (user,) = conn.execute("SELECT user_id FROM loom_sessions").fetchone()
    url = f"sqlite:///{demo_file(tmp_path, '.db')}"
    out = tmp_path / "dsar.json"
    done = loomflow("--url", url, "users", "export", user, "-o", str(out))
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["user_id"] == user
    assert document["counts"]["sessions"] == 1
    assert len(document["journal"]["entries"]) == 11  # with the episode write
    assert document["counts"]["episodes"] == 1
    assert {e["user_id"] for e in document["audit"]} == {user}
    assert len(document["audit"]) == 31
    assert document["budget"][0]["calls"] >= 5
    nobody = json.loads(loomflow("--url", url, "users", "export", "zoe").stdout)
    assert nobody["counts"] == {
        "sessions": 0,
        "journal entries": 0,
        "idempotency results": 0,
        "checkpoints": 0,
        "episodes": 0,
        "facts": 0,
        "blocks": 0,
        "audit entries": 0,
    }
    assert loomflow("--url", url, "users", "export").returncode == 2  # whom?
