"""Tool arguments whose names the redactor hides (``db_password``) are sealed in the journal
like declared ``sensitive`` ones, without any configuration, and journals written before
(with such values in clear) still replay without running a tool again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loomflow.agent import Agent
from loomflow.audit import Redactor
from loomflow.audit.sealing import Sealer
from loomflow.messages import Message, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime
from loomflow.tools import Tool

PASSWORD = "hunter2-db"
received: list[dict[str, Any]] = []


def connect(host: str, db_password: str | None = None) -> str:
    """Connect to a database."""
    received.append({"host": host, "db_password": db_password})
    return f"connected to {host}"


class Script:
    """Calls ``connect`` once, then answers; ``fail_after_tool`` makes the second model call
    fail once (the worker died after the tool step was journaled)."""

    def __init__(self, arguments: dict[str, Any], *, fail_after_tool: bool = False) -> None:
        self.arguments = arguments
        self.fail_after_tool = fail_after_tool

    def __call__(self, messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results:
            return [ToolCall(id="c0", name="connect", arguments=dict(self.arguments))]
        if self.fail_after_tool:
            self.fail_after_tool = False
            raise ConnectionError("the model's provider went away")
        return f"model saw: {results[-1].content}"


def journal_bytes(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in directory.iterdir() if p.is_file())


def agent_on(directory: Path, script: Script) -> Agent:
    return Agent(
        "x",
        model=FunctionModel(script),
        tools=[Tool(connect)],
        runtime=SqliteRuntime(str(directory / "journal.db")),
    )


async def test_a_value_under_a_secret_name_never_reaches_the_journal(tmp_path: Path) -> None:
    received.clear()
    agent = agent_on(tmp_path, Script({"host": "db1", "db_password": PASSWORD}))
    result = await agent.run("go", session_id="s", user_id="ana")
    assert received == [{"host": "db1", "db_password": PASSWORD}]  # the tool got the value
    assert result.output == "model saw: connected to db1"
    assert PASSWORD.encode() not in journal_bytes(tmp_path)
    [call] = [c for m in result.messages for c in m.tool_calls]
    assert call.arguments["host"] == "db1"
    assert call.arguments["db_password"].startswith("[sealed:")


@pytest.mark.parametrize("value", [None, "", True])
def test_a_name_that_holds_nothing_is_not_sealed(value: Any) -> None:
    # Nothing to keep out of the journal: sealed, a resumed run would lose it for nothing.
    call = ToolCall(id="c", name="connect", arguments={"host": "db1", "db_password": value})
    assert Sealer({}, Redactor()).seal_call(call) is call


def test_sealing_by_name_follows_the_redactors_keys() -> None:
    call = ToolCall(id="c", name="connect", arguments={"host": "db1", "apiToken": "plain"})
    sealed = Sealer({}, Redactor()).seal_call(call)
    assert sealed.arguments["apiToken"].startswith("[sealed:")
    assert sealed.arguments["host"] == "db1"
    # A redactor told to hide no key by its words (the audit log's, say) seals none by name.
    assert Sealer({}, Redactor(key_words=False, sensitive_keys=())).seal_call(call) is call


@pytest.mark.parametrize("name", ["boarding_pass", "skiPass", "pass"])
def test_a_doubtful_name_is_hidden_in_displays_but_not_sealed(name: str) -> None:
    # A trailing "pass" holds a ticket as often as a password: the audit log hides it, but
    # sealing would also teach the value as a secret and blank it out of the tool results
    # the model reads ("checked in booking [REDACTED]").
    redactor = Redactor()
    assert redactor.hides_key(name)
    call = ToolCall(id="c", name="check_in", arguments={name: "XK7Q2PLM"})
    assert Sealer({}, redactor).seal_call(call) is call
    assert redactor.text("checked in booking XK7Q2PLM") == "checked in booking XK7Q2PLM"


@pytest.mark.parametrize("name", ["db_password", "smtp_pwd", "X-Api-Key", "clientSecret", "token"])
def test_a_name_that_names_a_secret_is_sealed(name: str) -> None:
    call = ToolCall(id="c", name="connect", arguments={name: "v4lue-kept-out"})
    assert Sealer({}, Redactor()).seal_call(call).arguments[name].startswith("[sealed:")


async def test_a_journal_written_with_the_value_in_clear_still_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    received.clear()
    arguments = {"host": "db1", "db_password": PASSWORD}
    # Written as a release that sealed no argument by its name did: the value in clear.
    with monkeypatch.context() as patched:
        patched.setattr(Redactor, "seals_key", lambda self, key: False)
        first = agent_on(tmp_path, Script(arguments, fail_after_tool=True))
        with pytest.raises(ConnectionError):
            await first.run("go", session_id="s", user_id="ana")
    assert PASSWORD.encode() in journal_bytes(tmp_path)
    assert received == [arguments]
    # Resumed by this release, in a fresh agent (another process's memory): the model's
    # call and the tool step replay as journaled, and the tool does not run again.
    resumed = agent_on(tmp_path, Script(arguments))
    result = await resumed.resume("go", session_id="s", user_id="ana")
    assert result.output == "model saw: connected to db1"
    assert received == [arguments]
    assert result.replayed_steps >= 2  # the first model call and the tool call
    [call] = [c for m in result.messages for c in m.tool_calls]
    assert call.arguments == arguments
