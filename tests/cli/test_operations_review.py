"""Findings of an operator's black-box review (migrations, settings, the command line), each
held by a test on real SQLite files, a real PostgreSQL server, or a socket that never answers.
"""

from __future__ import annotations

import importlib
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _cli import clean_env, loomflow

from loomflow.errors import StoreUnavailableError
from loomflow.storage import PostgresDatabase

cli_main = importlib.import_module("loomflow.cli.main")


# -- a PostgreSQL host that takes the connection and never answers ----------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener accepts connections and never sends a byte (a server that is
    paused, or a firewall that swallows packets after the handshake)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


async def test_connecting_is_bounded_by_the_postgres_timeout(silent_port: int) -> None:
    # Before, the connection waited asyncpg's own 60 s, then said it had waited 1 s.
    db = PostgresDatabase(f"postgresql://app@127.0.0.1:{silent_port}/app", timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"did not answer within 1s"):
        await db.open()
    assert time.monotonic() - t0 < 10


def test_a_command_gives_up_on_a_silent_server_after_the_timeout(
    silent_port: int, tmp_path: Path
) -> None:
    # Before, the schema check waited 10 s and the command's own open 60 s more.
    t0 = time.monotonic()
    done = loomflow(
        "--url",
        f"postgresql://app:s3cret-pw@127.0.0.1:{silent_port}/app",
        "runs",
        "list",
        cwd=tmp_path,
        env=clean_env(LOOMFLOW_POSTGRES_TIMEOUT_SECONDS="2"),
    )
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stderr
    assert "did not answer within 2s" in done.stderr
    assert "LOOMFLOW_POSTGRES_TIMEOUT_SECONDS" in done.stderr
    assert "s3cret-pw" not in done.stderr
    assert "Traceback" not in done.stderr
    assert took < 10, took


# -- a SQLite file this user may not write -----------------------------------------------------


def test_a_read_only_sqlite_file_is_named_with_the_reason(tmp_path: Path) -> None:
    from loomflow.storage import SqliteDatabase
    from loomflow.storage._database import store_error

    path = tmp_path / "journal.db"
    sqlite3.connect(path).close()
    # The error SQLite gives a user who may not write the file (root may write any file, so
    # the file is opened read-only here rather than made so by its mode).
    reader = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        with pytest.raises(sqlite3.OperationalError) as caught:
            reader.execute("CREATE TABLE t (x)")
    finally:
        reader.close()
    assert caught.value.sqlite_errorcode == sqlite3.SQLITE_READONLY

    db = SqliteDatabase(path)
    error = store_error(caught.value, "sqlite journal acquire", db._explain)
    # Before: "sqlite journal acquire failed: OperationalError: attempt to write a readonly
    # database", naming no file.
    assert str(path) in str(error)
    assert "read-only for this user" in str(error)


# -- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "shortest"),
    [
        ("LOOMFLOW_TELEMETRY_USER_ID_KEY", 16),
        ("LOOMFLOW_CONSOLE_SESSION_SECRET", 32),
        ("LOOMFLOW_CONSOLE_TOKEN", 16),
    ],
)
def test_a_short_secret_is_measured_in_characters(
    variable: str, shortest: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.MonkeyPatch.context() as env:
        env.chdir(tmp_path)
        env.setenv(variable, "x" * (shortest - 1))
        assert cli_main.main(["settings"]) == 1
        err = capsys.readouterr().err
        # Before: "Value should have at least 16 items after validation, not 15".
        assert err.startswith(f"loomflow: error: bad setting {variable}: "), err
        assert f"must be {shortest} characters or more" in err
        assert "items" not in err
        env.setenv(variable, "x" * shortest)
        assert cli_main.main(["settings"]) == 0


# -- a database changed behind the version table's back -----------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("DROP TABLE loom_sessions", "table loom_sessions (migration 1)"),
        ("ALTER TABLE loom_sessions DROP COLUMN last_error", "column loom_sessions.last_error"),
        ("DROP TABLE loom_budget_buckets", "table loom_budget_buckets"),
        # The audit log's refusal of deletes is a trigger: without it, `migrate` said all was well.
        ("DROP TRIGGER loom_audit_no_delete", "trigger loom_audit_no_delete"),
    ],
)
def test_migrate_reports_a_table_column_or_trigger_dropped_by_hand(
    change: str, named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert cli_main.main(["--url", url, "migrate"]) == 0
    capsys.readouterr()
    with sqlite3.connect(tmp_path / "journal.db") as db:
        db.execute(change)
    db.close()
    # Before: "journal schema at version 2" and exit 0; then every run failed with
    # "no such table", which reads like the database being down.
    assert cli_main.main(["--url", url, "migrate"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert named in err
    assert "changed outside loomflow" in err


async def test_migrate_reports_a_column_dropped_by_hand_on_postgres(pg_dsn: str) -> None:
    import asyncpg

    from loomflow.config import Settings
    from loomflow.errors import MigrationError
    from loomflow.stores import Stores

    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        await stores.migrate()  # a whole, fresh schema passes the check
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("ALTER TABLE loom_entries DROP COLUMN seq")
        await conn.execute("DROP TRIGGER loom_audit_no_truncate ON loom_audit")
    finally:
        await conn.close()
    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        with pytest.raises(MigrationError, match=r"column loom_entries\.seq \(migration 1\)"):
            await stores.migrate()
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("ALTER TABLE loom_entries ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")
    finally:
        await conn.close()
    async with Stores(Settings(runtime_url=pg_dsn)) as stores:
        with pytest.raises(MigrationError, match="trigger loom_audit_no_truncate"):
            await stores.migrate()


def test_a_dotenv_line_for_a_setting_that_cannot_be_parsed_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loomflow.config import Settings
    from loomflow.errors import ConfigurationError

    with pytest.MonkeyPatch.context() as env:
        env.chdir(tmp_path)
        for name in [n for n in os.environ if n.startswith("LOOMFLOW_")]:
            env.delenv(name)
        (tmp_path / ".env").write_text(
            'OTHER TOOL=1\nexport LOOMFLOW_AUDIT_URL="postgresql://audit@db/audit\n',
            encoding="utf-8",
        )
        # Before: python-dotenv skipped the line with a warning naming neither the file nor
        # the variable, and the audit log quietly went to the journal's database.
        with pytest.raises(ConfigurationError, match=r"LOOMFLOW_AUDIT_URL: line 2 of \.env"):
            Settings()
        assert cli_main.main(["settings"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("loomflow: error: bad setting LOOMFLOW_AUDIT_URL: line 2 of .env")
        # Another program's line is its own business; a setting quoted whole is read.
        (tmp_path / ".env").write_text(
            "OTHER TOOL=1\nLOOMFLOW_AUDIT_URL='sqlite:///audit.db'\n", encoding="utf-8"
        )
        assert Settings().audit_url == "sqlite:///audit.db"


async def test_a_busy_timeout_sqlite_cannot_hold_is_refused(tmp_path: Path) -> None:
    from loomflow.config import Settings
    from loomflow.errors import ConfigurationError, InvalidArgumentError
    from loomflow.storage import SqliteDatabase

    # SQLite keeps the timeout in a C int and took 2**31 as 0: no wait at all, so every
    # contended write failed at once, the opposite of what was asked for.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOOMFLOW_SQLITE_BUSY_TIMEOUT_MS", str(2**31))
        with pytest.raises(ConfigurationError, match="LOOMFLOW_SQLITE_BUSY_TIMEOUT_MS"):
            Settings()
    with pytest.raises(InvalidArgumentError, match="busy_timeout_ms"):
        SqliteDatabase(tmp_path / "j.db", busy_timeout_ms=2**31)
    db = SqliteDatabase(tmp_path / "j.db", busy_timeout_ms=2**31 - 1)
    try:
        assert (await db.fetch("PRAGMA busy_timeout"))[0][0] == 2**31 - 1
    finally:
        await db.close()


async def test_a_host_that_does_not_resolve_is_named() -> None:
    # Before: "postgres connect failed: gaierror: [Errno -2] Name or service not known".
    db = PostgresDatabase("postgresql://app:s3cret@no-such-host.invalid/app", timeout_s=10)
    with pytest.raises(StoreUnavailableError) as caught:
        await db.open()
    message = str(caught.value)
    assert "'postgresql://app:***@no-such-host.invalid/app'" in message
    assert "cannot be resolved" in message
    assert "s3cret" not in message


@pytest.mark.postgres
def test_a_libpq_only_dsn_option_is_named_with_what_to_do(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "postgres connect failed: UndefinedObjectError: unrecognized configuration
    # parameter "connect_timeout"", naming neither the URL nor what to do instead.
    assert cli_main.main(["--url", pg_dsn, "migrate"]) == 0
    capsys.readouterr()
    assert cli_main.main(["--url", f"{pg_dsn}?connect_timeout=5", "runs", "list"]) == 1
    err = capsys.readouterr().err
    assert "the URL's ?connect_timeout= option" in err
    assert "remove it from the URL" in err
    assert "LOOMFLOW_POSTGRES_TIMEOUT_SECONDS" in err
    # An option the server does know as a setting still just works.
    assert cli_main.main(["--url", f"{pg_dsn}?application_name=w-1", "runs", "list"]) == 0


# -- a URL whose scheme is in capitals ---------------------------------------------------------


@pytest.mark.parametrize("via", ["--url", "LOOMFLOW_RUNTIME_URL"])
def test_a_capitalised_sqlite_scheme_creates_no_store(
    via: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.MonkeyPatch.context() as env:
        env.chdir(tmp_path)
        url = "SQLite:///journal.db"
        argv = ["runs", "list"]
        if via == "--url":
            argv = ["--url", url, *argv]
        else:
            env.setenv(via, url)
        # Before: the checks compared "sqlite://" case for case, let the URL through, and
        # the journal it opened made journal.db: "no sessions in the journal", exit 0.
        assert cli_main.main(argv) == 1
        assert "no journal at journal.db" in capsys.readouterr().err
        assert not list(tmp_path.iterdir())


def test_a_capitalised_postgres_scheme_adds_no_tables(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import asyncpg

    shouted = "POSTGRESQL" + pg_dsn[len("postgresql") :]
    # Before: another application's database got the journal's tables from a listing.
    assert cli_main.main(["--url", shouted, "runs", "list"]) == 1
    assert "holds no loomflow store yet" in capsys.readouterr().err

    async def tables() -> list[str]:
        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            return [r[0] for r in rows]
        finally:
            await conn.close()

    assert asyncio.run(tables()) == []
    assert cli_main.main(["--url", shouted, "migrate"]) == 0  # migrate may, and reads it alike
    assert "loom_sessions" in asyncio.run(tables())


def test_a_directory_named_as_the_journal_is_called_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "journal.db").mkdir()
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert cli_main.main(["--url", url, "migrate"]) == 1
    err = capsys.readouterr().err
    # Before: "SQLite cannot open or create it: is its directory writable by this user?"
    assert "it is a directory, not a SQLite file" in err


@pytest.mark.parametrize("header", ["X-Forwarded User", "X-User\n", "X-User:"])
def test_a_proxy_header_no_request_can_carry_is_refused(header: str, tmp_path: Path) -> None:
    from loomflow.console._access import ConsoleAccess
    from loomflow.errors import ConfigurationError

    # Before: the console started, and refused every sign-in the proxy made.
    with pytest.raises(ConfigurationError, match="is not an HTTP header name"):
        ConsoleAccess(proxy_header=header)
    assert ConsoleAccess(proxy_header="X-Forwarded-User").proxy_header == "x-forwarded-user"
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    command = [sys.executable, "-m", "loomflow.cli", "--url", url, "console"]
    done = subprocess.run(
        [*command, "--trust-proxy-header", header],
        capture_output=True,
        text=True,
        timeout=60,  # the old code served (and so never returned)
        check=False,
        env=clean_env(),
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "is not an HTTP header name" in done.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_settings_hides_the_password_of_the_otlp_endpoint(
    as_json: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.MonkeyPatch.context() as env:
        env.chdir(tmp_path)
        env.setenv("LOOMFLOW_OTLP_ENDPOINT", "https://tenant:s3cret-pw@collector:4318")
        # Before: only settings with "url" in their name were masked, so this one was shown.
        assert cli_main.main(["settings", *(["--json"] if as_json else [])]) == 0
        out = capsys.readouterr().out
    assert "s3cret-pw" not in out
    assert "https://tenant:***@collector:4318" in out


@pytest.mark.parametrize("endpoint", ["http://collector:43l8", "http://collector:99999"])
def test_an_otlp_endpoint_with_a_bad_port_is_refused_by_name(endpoint: str) -> None:
    from loomflow.config import Settings
    from loomflow.errors import ConfigurationError

    # Before: accepted, and only the exporter's background thread found out.
    with pytest.raises(ConfigurationError, match="LOOMFLOW_OTLP_ENDPOINT: bad port"):
        Settings(otlp_endpoint=endpoint)


def test_python_dash_m_loomflow_is_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loomflow", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("loomflow ")
