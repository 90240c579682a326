"""What a new user trips over: the demo, error messages, --limit, migrate, JSON times."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loomflow.cli._format import positive_int
from loomflow.cli.audit import _page_size
from loomflow.config import Settings

cli_main = importlib.import_module("loomflow.cli.main")
ROOT = Path(__file__).resolve().parents[2]


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
    (found,) = workdir.glob(f"loomflow-demo-*{suffix}")
    return found


# -- every command, every setting: one line, no traceback -----------------------------------


def _leaves(
    parser: argparse.ArgumentParser, prefix: list[str]
) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield prefix, parser
        return
    for name, child in groups[0].choices.items():
        yield from _leaves(child, [*prefix, name])


# Values for required arguments whose type checks them.
_REQUIRED = {"older_than": "90d"}


def _argv(path: list[str], parser: argparse.ArgumentParser) -> list[str]:
    argv = list(path)
    for action in parser._actions:
        if not action.required:
            continue
        value = _REQUIRED.get(action.dest, "x")
        argv += [value] if not action.option_strings else [action.option_strings[0], value]
    for group in parser._mutually_exclusive_groups:
        if not group.required:
            continue
        # The first choice of a required group (a user id, positional or --user; or a flag).
        first = group._group_actions[0]
        if not first.option_strings:
            argv.append("x")
        elif first.nargs == 0:
            argv.append(first.option_strings[0])
        else:
            argv += [first.option_strings[0], "x"]
    return argv


def _commands() -> list[list[str]]:
    commands = [_argv(path, leaf) for path, leaf in _leaves(cli_main._parser(), [])]
    for argv in commands:
        cli_main._parser().parse_args(argv)  # each one parses
    return commands


# A value of each setting that does not parse or that no store would open.
BAD = {
    "runtime_url": "mysql://db/app",
    "serializer": "yaml",
    "max_payload_bytes": "0",
    "strict_replay": "perhaps",
    "turn_timeout_seconds": "-1",
    "lease_seconds": "soon",
    "recovery_interval_seconds": "0",
    "recovery_max_attempts": "none",
    "sqlite_busy_timeout_ms": "-5",
    "postgres_timeout_seconds": "-1",
    "sqlite_synchronous": "OFF",
    "auto_migrate": "maybe",
    "journal_retention_days": "0",
    "metrics_port": "70000",
    "metrics_host": "",
    "telemetry_capture_content": "sometimes",
    "telemetry_user_ids": "masked",
    "telemetry_user_id_key": "short",
    "audit_url": "ftp://logs/audit",
    "console_token": "short",
    "console_session_secret": "not-32-characters",
    "redact_secrets": '["unterminated',
    "redact_env": '[{"not": "a name"}]',
    "budget_url": "sqlite://relative-without-third-slash.db",
    "redact_pii": "sometimes",
    "redact_patterns": '{"order": "ORD-(["}',
}
# Free text, read only by setup_telemetry() (which the CLI does not call); it reports a bad
# endpoint or header as a ConfigurationError.
ANY_TEXT = {"otlp_endpoint", "otlp_headers", "otel_service_name"}


def test_every_setting_has_a_bad_value_here() -> None:
    # A new setting needs a bad value in BAD (or a reason to be in ANY_TEXT), so the test
    # below proves that every command reports it in one line.
    assert set(BAD) | ANY_TEXT == set(Settings.model_fields)


def test_every_command_reports_every_bad_setting_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    commands = _commands()
    assert len(commands) >= 17  # demo, settings, migrate, runs, journal, audit, budget, ...
    capsys.readouterr()  # the usage lines of trying out the arguments
    for name, bad in BAD.items():
        variable = f"LOOMFLOW_{name.upper()}"
        monkeypatch.setenv(variable, bad)
        for argv in commands:
            code = cli_main.main(argv)
            out, err = capsys.readouterr()
            assert code == 1, (variable, argv, out, err)
            assert err.count("\n") == 1, (variable, argv, err)
            assert err.startswith(f"loomflow: error: bad setting {variable}"), (argv, err)
        monkeypatch.delenv(variable)
    assert not list(tmp_path.iterdir())  # nothing was created on the way


def test_a_bad_boolean_setting_names_what_it_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # pydantic said only "Input should be a valid boolean", where the choices of every
    # Literal setting are listed.
    monkeypatch.chdir(tmp_path)
    flags = [name for name, field in Settings.model_fields.items() if field.annotation is bool]
    assert "auto_migrate" in flags
    for name in flags:
        variable = f"LOOMFLOW_{name.upper()}"
        monkeypatch.setenv(variable, BAD[name])
        assert cli_main.main(["settings"]) == 1
        err = capsys.readouterr().err
        assert err == (
            f"loomflow: error: bad setting {variable}: give true or false "
            "(or 1/0, yes/no, on/off)\n"
        ), err
        monkeypatch.delenv(variable)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://root@127.0.0.1:notaport/postgres",
        "mysql://root@127.0.0.1/app",
        "sqlite://no-third-slash.db",
    ],
)
def test_every_command_reports_a_bad_url_in_one_line(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    commands = _commands()
    capsys.readouterr()
    for argv in commands:
        code = cli_main.main(["--url", url, *argv])
        _, err = capsys.readouterr()
        assert err.count("\n") == 1, (argv, err)
        if argv[0] in ("demo", "worker"):  # no --url at all, whatever its value: bad usage
            assert code == 2, (argv, err)
            assert err.startswith(f"loomflow: error: {argv[0]} takes no --url: "), (argv, err)
            continue
        assert code == 1, (argv, err)
        assert err.startswith("loomflow: error: --url: "), (argv, err)


def test_an_unknown_scheme_on_the_command_line_lists_only_what_the_cli_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The list offered memory://, which every command then refused as living in another
    # process.
    monkeypatch.chdir(tmp_path)
    for argv, listed in (
        (["--url", "mysql://db/app", "runs", "list"], "sqlite://, postgresql://, postgres://"),
        (
            ["audit", "--audit-url", "mysql://db/app", "query"],
            "jsonl://, sqlite://, postgresql://, postgres://",
        ),
        (
            ["budget", "--budget-url", "mysql://db/app", "show"],
            "sqlite://, postgresql://, postgres://",
        ),
    ):
        assert cli_main.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.endswith(f": use {listed}\n"), err
        assert "memory" not in err, err
    assert not list(tmp_path.iterdir())


def test_migrate_refuses_a_journal_that_lives_in_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # It printed "journal schema at version 0" and exited 0: a deploy step that migrated
    # nothing anyone keeps, reported as done.
    monkeypatch.chdir(tmp_path)
    assert cli_main.main(["--url", "memory://", "migrate"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loomflow: error: a memory:// journal lives inside the process"), err
    assert not list(tmp_path.iterdir())


def test_store_url_options_are_checked_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for argv in (
        ["audit", "--audit-url", "ftp://x", "query"],
        ["budget", "--budget-url", "postgresql://u@h:port/db", "show"],
        ["migrate", "--audit-url", "jsonl://x.jsonl"],
        ["demo", "--postgres", "postgresql://u@h:nope/db"],
    ):
        assert cli_main.main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("loomflow: error: --"), err


def test_real_processes_print_one_line_and_no_traceback(tmp_path: Path) -> None:
    cases = [
        (["runs", "list"], {"LOOMFLOW_LEASE_SECONDS": "soon"}, 1),
        (["demo", "--workdir", str(tmp_path)], {"LOOMFLOW_SERIALIZER": "yaml"}, 1),
        (["--url", "postgresql://root@127.0.0.1:notaport/postgres", "runs", "list"], {}, 1),
        # Past the settings check (two hosts), asyncpg's own DSN parser still says one line.
        (["--url", "postgresql://root@127.0.0.1:5432,127.0.0.1:x/postgres", "runs", "list"], {}, 1),
        (["demo", "--postgres", "memory://"], {}, 2),
        (["demo", "--postgres", "sqlite:///x.db"], {}, 2),
        (["demo", "--kill-after", "9"], {}, 2),
    ]
    for argv, env, code in cases:
        done = loomflow(*argv, cwd=tmp_path, env=env)
        assert done.returncode == code, (argv, done.stderr)
        assert "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1, (argv, done.stderr)
        assert done.stderr.startswith("loomflow: error: "), (argv, done.stderr)
        assert done.stdout == "", argv  # refused before the story started
    assert [p.name for p in tmp_path.iterdir()] == []


def test_redact_lists_take_plain_comma_separated_values(tmp_path: Path) -> None:
    env = {"LOOMFLOW_REDACT_SECRETS": "db-pass-1", "LOOMFLOW_REDACT_ENV": "MY_TOKEN, OTHER_KEY"}
    shown = loomflow("settings", "--json", cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["redact_secrets"]["value"] == "(set, hidden)"
    assert document["redact_env"]["value"] == ["MY_TOKEN", "OTHER_KEY"]
    assert "db-pass-1" not in shown.stdout
    pairs = Settings(redact_secrets="a-pass,b-pass", redact_env="X").model_dump(mode="json")
    assert pairs["redact_secrets"] == ["**********", "**********"]
    listed = Settings(redact_secrets='["with,comma"]').redact_secrets
    assert [s.get_secret_value() for s in listed] == ["with,comma"]


# -- the demo ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One demo run in a directory that already holds a user's journal and ledger."""
    work = tmp_path_factory.mktemp("work")
    for name in ("journal.db", "journal.db-wal", "journal.db-shm", "side-effects.jsonl"):
        (work / name).write_text(f"the user's own {name}\n")
    done = loomflow("demo", "--workdir", str(work))
    assert done.returncode == 0, done.stderr
    return work, done.stdout


def test_the_demo_never_deletes_a_file_it_did_not_create(demo_run: tuple[Path, str]) -> None:
    work, out = demo_run
    for name in ("journal.db", "journal.db-wal", "journal.db-shm", "side-effects.jsonl"):
        assert (work / name).read_text() == f"the user's own {name}\n"
    journal = demo_file(work, ".db")
    assert re.fullmatch(r"loomflow-demo-[0-9A-Z]{26}\.db", journal.name)
    assert f"journal on SQLite ({journal})" in out
    assert len(demo_file(work, "-side-effects.jsonl").read_text().splitlines()) == 5


def test_the_demo_ends_with_a_command_the_user_can_run(demo_run: tuple[Path, str]) -> None:
    _work, out = demo_run
    last = out.splitlines()[-1]
    # Run as `python -m loomflow.cli`, so that is what the line says (not a bare `loomflow`).
    assert last.startswith("Look around: ")
    argv = last.removeprefix("Look around: ").split()
    assert os.path.abspath(argv[0]) == os.path.abspath(sys.executable)  # from this directory
    assert argv[1:4] == ["-m", "loomflow.cli", "--url"]
    shown = subprocess.run([*argv, "--json"], capture_output=True, text=True, check=False)
    assert shown.returncode == 0, shown.stderr
    steps = [json.loads(line)["name"] for line in shown.stdout.splitlines()]
    # 5 model calls, 5 tool calls and the run's memory episode (memory is on by default).
    assert len(steps) == 11
    assert steps[-1] == "persist_episode_5"


def test_command_name_is_what_the_user_typed_or_loomflow_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loomflow.cli import demo

    script = tmp_path / ".venv" / "bin" / "loomflow"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "demo"])
    monkeypatch.setenv("PATH", "/nonexistent")
    assert demo.command_name() == ".venv/bin/loomflow"  # not on PATH: the path, from here
    monkeypatch.setenv("PATH", str(script.parent))
    assert demo.command_name() == "loomflow"  # activated venv
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert demo.command_name() == str(script)  # outside the working directory: absolute
    # `python -m loomflow` is echoed as typed, and so is `python -m loomflow.cli`.
    package = Path(demo.__file__).parent.parent
    python = os.path.abspath(sys.executable)
    monkeypatch.setattr(sys, "argv", [str(package / "__main__.py"), "demo"])
    assert demo.command_name() == f"{python} -m loomflow"
    monkeypatch.setattr(sys, "argv", [str(package / "cli" / "__main__.py"), "demo"])
    assert demo.command_name() == f"{python} -m loomflow.cli"


def test_runs_show_names_the_tool_of_each_tool_step(demo_run: tuple[Path, str]) -> None:
    work, _ = demo_run
    url = f"sqlite:///{demo_file(work, '.db')}"
    (session,) = re.findall(r"session (order-A-1042-\w+)\)", demo_run[1])
    rows = [
        json.loads(line)
        for line in loomflow("--url", url, "runs", "show", session, "--json").stdout.splitlines()
    ]
    tools = [r["tool"] for r in rows if r["name"].startswith("tool_call_")]
    assert tools == [
        "lookup_order",
        "reserve_stock",
        "charge_card",
        "create_shipment",
        "send_confirmation",
    ]
    assert all(r["tool"] is None for r in rows if r["name"].startswith("model_call_"))
    table = loomflow("--url", url, "runs", "show", session).stdout
    assert re.search(r"tool_call_1_1_[0-9a-f]+\s+charge_card\s", table)


ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def test_json_times_are_iso_8601_utc_in_every_command(demo_run: tuple[Path, str]) -> None:
    work, out = demo_run
    url = f"sqlite:///{demo_file(work, '.db')}"
    (session,) = re.findall(r"session (order-A-1042-\w+)\)", out)
    runs = json.loads(loomflow("--url", url, "runs", "list", "--json").stdout)
    shown = loomflow("--url", url, "runs", "show", session, "--json").stdout.splitlines()
    budget = loomflow("--url", url, "budget", "show", "--json").stdout.splitlines()
    audit = json.loads(loomflow("--url", url, "audit", "query", "--json").stdout)
    user = runs["user_id"]
    exported = json.loads(loomflow("--url", url, "users", "export", user).stdout)
    times = (
        [runs["updated_at"]]
        + [json.loads(line)["created_at"] for line in shown]
        + [json.loads(line)["updated_at"] for line in budget]
        + [e["time"] for e in audit["entries"]]
        + [exported["exported_at"]]
        + [s["updated_at"] for s in exported["journal"]["sessions"]]
        + [s["created_at"] for s in exported["journal"]["sessions"]]
        + [exported["memory"]["exported_at"]]
        + [e["created_at"] for e in exported["journal"]["entries"]]
        + [b["updated_at"] for b in exported["budget"]]
    )
    assert len(times) > 40
    for value in times:
        assert isinstance(value, str), value
        assert ISO.match(value), value


async def test_checkpoint_times_and_export_message(tmp_path: Path) -> None:
    from loomflow.agent import Agent, Tuning
    from loomflow.messages import ModelResponse
    from loomflow.models import FunctionModel
    from loomflow.runtime import SqliteRuntime

    db = tmp_path / "j.db"
    runtime = SqliteRuntime(db)
    try:
        agent = Agent(
            "be brief",
            model=FunctionModel(lambda *_: ModelResponse(text="done")),
            runtime=runtime,
            tuning=Tuning(checkpoint=True),
        )
        await agent.run("hi", session_id="s1", user_id="ana")
    finally:
        await runtime.close()
    url = f"sqlite:///{db}"
    listed = await asyncio.to_thread(loomflow, "--url", url, "checkpoints", "list", "s1", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert ISO.match(row["created_at"]), row
    out = tmp_path / "ana.json"
    done = await asyncio.to_thread(
        loomflow, "--url", url, "checkpoints", "export", "--user", "ana", "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert done.stderr == f"exported 1 checkpoints of user 'ana' to {out}\n"
    assert len(json.loads(out.read_text())["checkpoints"]) == 1


@pytest.mark.postgres
def test_the_postgres_demo_prints_its_real_dsn_with_the_password_masked(
    tmp_path: Path, pg_dsn: str
) -> None:
    # Trust authentication ignores the password, so it can stand in for a real one.
    dsn = pg_dsn.replace("://", "://root:pw-s3cret@", 1) if "@" not in pg_dsn else pg_dsn
    done = loomflow("demo", "--postgres", dsn, "--workdir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "<the DSN>" not in done.stdout
    assert "pw-s3cret" not in done.stdout
    last = done.stdout.splitlines()[-1]
    from loomflow.config import _masked_url

    assert f"--url {_masked_url(dsn)} runs show order-A-1042-" in last.replace("'", "")


# -- --limit and other counts ----------------------------------------------------------------


def test_every_count_option_takes_a_positive_whole_number() -> None:
    counts = []
    for path, leaf in _leaves(cli_main._parser(), []):
        for action in leaf._actions:
            if action.dest in ("limit", "batch_size", "kill_after"):
                counts.append((path, action.dest))
                # audit query's page is capped at what the store serves in one page
                allowed = (
                    (positive_int, _page_size)
                    if path[:2] == ["audit", "query"]
                    else (positive_int,)
                )
                assert action.type in allowed, (path, action.dest)
    assert {d for _, d in counts} == {"limit", "batch_size", "kill_after"}
    assert len([p for p, d in counts if d == "limit"]) == 4  # runs, approvals, checkpoints, audit


@pytest.mark.parametrize(
    "argv",
    [
        ["runs", "list", "--limit"],
        ["checkpoints", "list", "s", "--limit"],
        ["audit", "query", "--limit"],
        ["approvals", "list", "--limit"],
    ],
)
def test_a_limit_below_one_is_a_usage_error(tmp_path: Path, argv: list[str]) -> None:
    db = tmp_path / "j.db"
    assert loomflow("--url", f"sqlite:///{db}", "migrate").returncode == 0
    for bad in ("0", "-1"):
        done = loomflow("--url", f"sqlite:///{db}", *argv, bad)
        assert done.returncode == 2, (argv, bad, done.stdout, done.stderr)
        assert "is not a whole number from 1 to" in done.stderr
        assert done.stdout == ""


# -- migrate, the settings page, the docs build, the metrics address ----------------------


def test_migrate_creates_and_checks_a_jsonl_audit_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "audit.jsonl"
    env = {"LOOMFLOW_AUDIT_URL": str(log)}
    url = f"sqlite:///{tmp_path / 'j.db'}"
    before = loomflow("--url", url, "audit", "verify", env=env)
    assert before.returncode == 1
    assert "loomflow migrate" in before.stderr
    done = loomflow("--url", url, "migrate", env=env)
    assert done.returncode == 0, done.stderr
    assert f"audit log (JSON lines) at {log} (created;" in done.stdout
    assert log.exists()
    assert json.loads((tmp_path / "logs" / "audit.jsonl.heads").read_text())
    verified = loomflow("--url", url, "audit", "verify", env=env)
    assert verified.returncode == 0, verified.stderr
    again = loomflow("--url", url, "migrate", env=env)
    assert "(exists, heads checked;" in again.stdout
    # A log cut shorter than its heads say is reported, in one line.
    log.write_text("")
    (tmp_path / "logs" / "audit.jsonl.heads").write_text('{"size": 99, "users": {}}')
    cut = loomflow("--url", url, "migrate", env=env)
    assert cut.returncode == 1
    assert "shorter than the 99 bytes" in cut.stderr
    # Lines that no heads file vouches for are not adopted by migrate: they could be forged.
    log.write_text('{"user_id": "mallory"}\n')
    (tmp_path / "logs" / "audit.jsonl.heads").unlink()
    orphan = loomflow("--url", url, "migrate", env=env)
    assert orphan.returncode == 1
    assert "heads file" in orphan.stderr
    assert len(orphan.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "logs" / "audit.jsonl.heads").exists()


def test_the_settings_page_lists_no_setting_with_a_default_as_required() -> None:
    from loomflow._settings_doc import settings_markdown

    table = settings_markdown()
    assert "(required)" not in table
    row = next(line for line in table.splitlines() if "`LOOMFLOW_REDACT_ENV`" in line)
    assert "ANTHROPIC_API_KEY,OPENAI_API_KEY" in row


def test_the_docs_hooks_are_not_copied_into_the_site() -> None:
    from mkdocs.config import load_config
    from mkdocs.structure.files import get_files

    config = load_config(str(ROOT / "mkdocs.yml"))
    assert config.hooks  # the settings table is still generated
    assert [f.src_uri for f in get_files(config) if f.src_uri.endswith(".py")] == []


def test_metrics_bind_locally_unless_a_container_says_otherwise() -> None:
    from loomflow.telemetry import serve_metrics

    default = Settings.model_fields["metrics_host"].default
    assert default == "127.0.0.1"
    import inspect

    assert inspect.signature(serve_metrics).parameters["host"].default == default
    compose = (ROOT / "deploy" / "compose.yaml").read_text()
    assert "LOOMFLOW_METRICS_HOST: 0.0.0.0" in compose  # the scraped worker sets it itself


def test_sqlite_journal_of_the_demo_is_a_real_journal(demo_run: tuple[Path, str]) -> None:
    work, _ = demo_run
    with sqlite3.connect(demo_file(work, ".db")) as conn:
        # 5 model calls, 5 tool calls and the run's memory episode.
        assert conn.execute("SELECT COUNT(*) FROM loom_entries").fetchone() == (11,)


def test_forget_without_yes_is_one_error_line_and_deletes_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    refused = loomflow("--url", url, "checkpoints", "forget", "--user", "alice")
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        "loomflow: error: checkpoints forget deletes every snapshot of the user: "
        "add --yes to confirm"
    ]
    done = loomflow("--url", url, "checkpoints", "forget", "--user", "alice", "--yes", "--json")
    assert done.returncode == 0, done.stderr


def test_app_role_without_postgres_is_refused_before_anything_is_migrated(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.db"
    refused = loomflow("--url", f"sqlite:///{journal}", "migrate", "--app-role", "app")
    assert refused.returncode == 2
    assert refused.stdout == ""  # no "schema at version" lines: nothing was migrated
    assert refused.stderr.splitlines() == [
        "loomflow: error: --app-role needs a PostgreSQL database"
    ]
    assert not journal.exists()


def test_the_demo_marks_the_call_the_kill_cut_short(demo_run: tuple[Path, str]) -> None:
    # The killed worker's last audit entry is a start with no outcome; the trail says why.
    _work, out = demo_run
    cut = [line for line in out.splitlines() if "(no outcome" in line]
    assert len(cut) == 1
    assert re.fullmatch(
        r"  #16  model\.start +\(no outcome: the worker was killed during it\)", cut[0]
    )


def test_settings_shows_the_journal_given_with_url(tmp_path: Path) -> None:
    # `loomflow --url X settings` reports the journal the other commands would open: X.
    env = {"LOOMFLOW_RUNTIME_URL": "sqlite:///from-env.db"}
    url = "postgresql://app:s3cret-pw@db:5432/app"
    done = loomflow("--url", url, "settings", "--json", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runtime_url"] == {
        "value": "postgresql://app:***@db:5432/app",
        "from": "--url",
    }
    assert "s3cret-pw" not in done.stdout
    plain = json.loads(loomflow("settings", "--json", env=env, cwd=tmp_path).stdout)
    assert plain["runtime_url"] == {"value": "sqlite:///from-env.db", "from": "environment"}


def test_without_url_a_missing_default_journal_says_how_to_name_one(tmp_path: Path) -> None:
    # The README's quick start writes ./journal.db; the CLI's default is .loomflow/journal.db.
    env = {k: v for k, v in os.environ.items() if k != "LOOMFLOW_RUNTIME_URL"}
    (tmp_path / "journal.db").touch()
    done = subprocess.run(
        [sys.executable, "-m", "loomflow.cli", "runs", "list"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "loomflow: error: no journal at .loomflow/journal.db, the default journal: name yours "
        "with --url (`loomflow --url sqlite:///journal.db ...`) or with LOOMFLOW_RUNTIME_URL"
    ]
    assert not (tmp_path / ".loomflow").exists()


def test_a_relative_url_from_another_directory_names_the_file_it_looked_for(
    tmp_path: Path,
) -> None:
    # The README's quick start writes ./journal.db in the application's directory; the same
    # --url typed in another one looked for a file there and said only "no journal at
    # journal.db", as if the application had written nothing.
    app, elsewhere = tmp_path / "app", tmp_path / "home"
    app.mkdir()
    elsewhere.mkdir()
    assert loomflow("--url", "sqlite:///journal.db", "migrate", cwd=app).returncode == 0
    done = loomflow("--url", "sqlite:///journal.db", "runs", "list", cwd=elsewhere)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"loomflow: error: no journal at journal.db ({elsewhere / 'journal.db'}: a relative "
        "path is read from the directory the command runs in): check the URL (a new store is "
        "made by `loomflow migrate` or by its first write)"
    ]
    assert not (elsewhere / "journal.db").exists()


def test_a_workdir_that_is_not_a_directory_is_one_error_line(tmp_path: Path) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    for workdir, problem in (
        (afile, "is a file, not a directory"),
        (afile / "sub", "cannot be made: Not a directory"),
        # A device is there but is no file: mkdir's "File exists" would say nothing useful.
        (Path(os.devnull), "is not a directory"),
    ):
        done = loomflow("demo", "--workdir", str(workdir))
        assert done.returncode == 2
        assert done.stderr.splitlines() == [f"loomflow: error: --workdir {workdir} {problem}"]
        assert done.stdout == ""
    assert afile.read_text() == "mine\n"


@pytest.mark.parametrize(
    "command",
    [
        ["audit", "export", "--user", "u", "-o"],
        ["users", "export", "u", "-o"],
        ["checkpoints", "export", "--user", "u", "-o"],
    ],
)
def test_an_output_file_that_cannot_be_written_is_one_error_line(
    tmp_path: Path, command: list[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    for target, reason in (
        (tmp_path / "no-such-dir" / "out.json", "No such file or directory"),
        (tmp_path, "Is a directory"),
    ):
        done = loomflow("--url", url, *command, str(target))
        assert done.returncode == 1
        assert done.stderr.splitlines() == [f"loomflow: error: {target}: {reason}"]


def test_heads_from_a_file_that_is_not_a_verify_report_are_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    export = tmp_path / "alice.json"
    assert loomflow("--url", url, "users", "export", "alice", "-o", str(export)).returncode == 0
    # A users export is JSON too; taken as heads it would check nothing and print OK.
    done = loomflow("--url", url, "audit", "verify", "--heads", str(export))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"loomflow: error: bad --heads file {export}: it is not a `verify --json` report "
        '(no "heads")'
    ]
    report = tmp_path / "heads.json"
    report.write_text(loomflow("--url", url, "audit", "verify", "--json").stdout)
    assert loomflow("--url", url, "audit", "verify", "--heads", str(report)).returncode == 0


def test_a_hold_on_an_id_no_store_knows_warns_of_a_typo(tmp_path: Path) -> None:
    # A legal hold on a mistyped id protects nobody: the real user's data stays erasable. The
    # hold is placed (one may precede the user's data), with a warning, as `users export` does.
    from loomflow.runtime import SqliteRuntime

    async def journal_alice() -> None:
        runtime = SqliteRuntime(tmp_path / "journal.db")
        async with runtime, runtime.session("s-1", user_id="alice@example.com"):
            await runtime.step("one", asyncio.sleep, 0)

    asyncio.run(journal_alice())
    url = f"sqlite:///{tmp_path / 'journal.db'}"
    assert loomflow("--url", url, "migrate").returncode == 0
    typo = loomflow("--url", url, "users", "hold", "alice@exmaple.com", "--reason", "L-7")
    assert typo.returncode == 0, typo.stderr
    assert typo.stdout == "user 'alice@exmaple.com' is under legal hold (audit entry 1)\n"
    assert typo.stderr.splitlines() == [
        "loomflow: warning: no store held anything about user 'alice@exmaple.com' before this "
        "hold: check the id (the hold protects that id alone)"
    ]
    right = loomflow("--url", url, "users", "hold", "alice@example.com", "--reason", "L-7")
    assert right.returncode == 0, right.stderr
    assert right.stderr == ""


def test_a_schema_left_unmigrated_names_the_migrate_command_that_reaches_it(
    tmp_path: Path,
) -> None:
    # Before: "run `loomflow migrate` first", which, run as told, migrated the CLI's default
    # .loomflow/journal.db and left the application's own file as it was.
    app = (
        "import asyncio\n"
        "from loomflow.runtime import SqliteRuntime\n"
        "async def main():\n"
        "    runtime = SqliteRuntime('./app.db')\n"
        "    async with runtime.session('s', user_id='u'):\n"
        "        pass\n"
        "    await runtime.close()\n"
        "asyncio.run(main())\n"
    )

    def run_app() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", app],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "LOOMFLOW_AUTO_MIGRATE": "false"},
            check=False,
        )

    refused = run_app()
    assert refused.returncode == 1
    hint = re.search(r"so run `loomflow (.*)` first", refused.stderr)
    assert hint is not None, refused.stderr
    assert hint[1] == f"migrate --url sqlite:///{tmp_path / 'app.db'}"
    assert loomflow(*hint[1].split(), cwd=tmp_path).returncode == 0  # the hint, as given
    assert run_app().returncode == 0
    assert not (tmp_path / ".loomflow").exists()


def test_the_demo_runs_where_automatic_migration_is_off(tmp_path: Path) -> None:
    # A production .env often says LOOMFLOW_AUTO_MIGRATE=false. The demo's SQLite journal is
    # a new file every time, so a hint to migrate it could never be followed: it is made ready.
    done = loomflow("demo", "--workdir", str(tmp_path), env={"LOOMFLOW_AUTO_MIGRATE": "false"})
    assert done.returncode == 0, done.stderr
    assert "No side effect ran twice" in done.stdout
    tables = {
        row[0]
        for row in sqlite3.connect(demo_file(tmp_path, ".db")).execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"
        )
    }
    assert {"loom_entries", "loom_audit", "loom_budget_buckets"} <= tables
