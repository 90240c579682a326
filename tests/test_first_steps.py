"""What a new user trips over in their first hour, found by following the README literally."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from loomflow import Agent
from loomflow.audit import SqliteAuditStore
from loomflow.config import Settings
from loomflow.errors import ConfigurationError
from loomflow.memory import SqliteMemory
from loomflow.runtime import SqliteRuntime


def test_printing_an_agent_does_not_build_its_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # repr() read the model, which builds the provider's client: without a key, a log line
    # or a debugger showing the agent raised ConfigurationError.
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    agent = Agent("x", model="claude-opus-4-7")
    assert repr(agent) == "Agent(name='agent', model='claude-opus-4-7', tools=[])"
    with pytest.raises(ConfigurationError, match="no credentials"):
        agent.model  # noqa: B018 - running it still needs the key, and says so


async def test_a_model_that_cannot_be_built_leaves_no_run_in_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README's quick start without ANTHROPIC_API_KEY: the model was built only after the
    # run was opened, so the ConfigurationError left an "open (resumable)" run with no steps
    # in the journal, which `runs list` showed and a resume or a prune had to deal with.
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    runtime = SqliteRuntime(tmp_path / "journal.db")
    agent = Agent("x", model="claude-opus-4-7", runtime=runtime)
    try:
        with pytest.raises(ConfigurationError, match="no credentials"):
            await agent.run("Refund $20 on order 42", session_id="ticket-42", user_id="alice")
        with pytest.raises(ConfigurationError, match="no credentials"):
            await agent.resume("Refund $20 on order 42", session_id="ticket-42", user_id="alice")
        assert await runtime.sessions() == []
    finally:
        await runtime.close()


async def test_resuming_an_agent_without_a_runtime_warns_that_it_runs_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An agent built without runtime= journals nothing, so its resume() ran every tool again
    # without a word, while a journal's resume that finds no run warns exactly that.
    agent = Agent("x", model="scripted")
    with caplog.at_level(logging.WARNING, logger="loomflow.agent"):
        result = await agent.resume("Refund $20 on order 42", session_id="ticket-42")
    assert result.output == "Echo: Refund $20 on order 42"
    assert "agent 'agent' has no runtime" in caplog.text
    assert "give the agent a runtime=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loomflow.agent"):
        await agent.run("Refund $20 on order 42", session_id="ticket-42")
    assert "has no runtime" not in caplog.text  # run() promises no replay


async def test_a_sqlite_url_given_for_a_path_opens_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README shows SqliteRuntime("./journal.db") beside AuditLog("sqlite:///journal.db");
    # the URL given to the runtime made a directory named "sqlite:" and a journal inside it.
    monkeypatch.chdir(tmp_path)
    runtime = SqliteRuntime("sqlite:///journal.db")
    try:
        assert runtime.path == Path("journal.db")
        async with runtime.session("s", "u"):
            await runtime.step("one", lambda: 1)
    finally:
        await runtime.close()
    assert (tmp_path / "journal.db").is_file()
    assert not (tmp_path / "sqlite:").exists()
    absolute = tmp_path / "abs" / "memory.db"
    memory = SqliteMemory(f"sqlite:///{absolute}")
    try:
        await memory.remember("alice", "likes", "tea", user_id="alice")
    finally:
        await memory.close()
    assert absolute.is_file()


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("postgresql://app@db/app", "postgresql:// URL given where a SQLite file path belongs"),
        ("sqlite:journal.db", "lacks the '//' after its scheme"),
        ("sqlite://journal.db", "bad SQLite URL"),
    ],
)
def test_a_url_no_sqlite_file_is_refused_where_a_path_belongs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, problem: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for build in (SqliteRuntime, SqliteMemory, SqliteAuditStore):
        with pytest.raises(ConfigurationError, match=problem):
            build(given)
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_paths_that_merely_look_like_schemes_stay_paths(tmp_path: Path) -> None:
    for path in (":memory:", "C:/data/journal.db", str(tmp_path / "postgres:x.db")):
        assert str(SqliteRuntime(path).path) == str(Path(path))


def test_a_bad_setting_is_a_configuration_error_naming_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was pydantic's ValidationError, naming the field (runtime_url), not the variable an
    # operator sets, and not a LoomflowError.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOOMFLOW_RUNTIME_URL", "sqlite:t.db")
    with pytest.raises(ConfigurationError, match=r"setting LOOMFLOW_RUNTIME_URL: 'sqlite:t\.db'"):
        Settings()
    with pytest.raises(ConfigurationError, match="LOOMFLOW_RUNTIME_URL"):
        Agent.from_settings("x", model="scripted")
    monkeypatch.delenv("LOOMFLOW_RUNTIME_URL")
    monkeypatch.setenv("LOOMFLOW_LEASE_SECONDS", "soon")
    with pytest.raises(ConfigurationError, match="LOOMFLOW_LEASE_SECONDS"):
        Settings()
    # A lease of a millisecond made the heartbeat spin on the database.
    monkeypatch.setenv("LOOMFLOW_LEASE_SECONDS", "0.001")
    with pytest.raises(ConfigurationError, match="LOOMFLOW_LEASE_SECONDS"):
        Settings()
    monkeypatch.setenv("LOOMFLOW_LEASE_SECONDS", "1")
    assert Settings().lease_seconds == 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "sqlite:///app.db", "--audit-url", "sqlite:///audit.db", "audit", "query"],
        ["--budget-url=sqlite:///b.db", "budget", "show"],
    ],
)
def test_a_group_option_before_its_group_is_named_as_misplaced(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse read the URL after it as the command: "invalid choice: 'sqlite:///audit.db'".
    cli_main = importlib.import_module("loomflow.cli.main")  # the package exports main()

    with pytest.raises(SystemExit) as exited:
        cli_main.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    option = argv[2] if argv[0] == "--url" else "--budget-url"
    assert f"{option} goes after its command group" in err
    assert "invalid choice" not in err


def test_ctrl_c_while_the_command_loads_is_a_quiet_exit_130() -> None:
    # The console script imports the command's modules first; a Ctrl-C then was a traceback
    # through the import system. Here the import of those modules is what gets interrupted.
    script = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'loomflow.cli.main':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "from loomflow.cli import main\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
