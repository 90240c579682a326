"""A secret named *inside* a tool argument (``config={"password": ...}``, a list of headers
holding an ``api_key``) seals that whole argument, as a top-level ``db_password`` is sealed:
no store, event, span or approval request holds the value, and the tool still gets it."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

import _nested_secret_worker as worker
import pytest
from _process_harness import harness as h  # the crash tests' process helpers
from pydantic import BaseModel

from loomflow.agent import Agent, Tuning
from loomflow.agent.hooks import RunHooks, RunInfo
from loomflow.audit import AuditLog, Redactor, SqliteAuditStore
from loomflow.audit.sealing import Sealer
from loomflow.governance import Rule, StandardPermissions
from loomflow.messages import Message, ModelResponse, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import SqliteRuntime, codec
from loomflow.telemetry import Telemetry
from loomflow.telemetry.testing import SpanCapture
from loomflow.tools import Tool, ToolOutcome, tool

PASSWORD = "hunter2-nested"
API_KEY = "abc123xyz-key"
ARGUMENTS: dict[str, Any] = {
    "config": {"host": "dbhost1", "password": PASSWORD},
    "headers": [{"name": "x-trace", "value": "t1"}, {"name": "auth", "api_key": API_KEY}],
    "retries": 3,
}
received: list[dict[str, Any]] = []


def connect(config: dict[str, Any], headers: list[dict[str, Any]], retries: int) -> str:
    """Connect to a database."""
    received.append({"config": config, "headers": headers, "retries": retries})
    return f"connected to {config['host']}"


class Script:
    """Calls ``connect`` until a call of it succeeds (a call whose sealed arguments were lost
    with a restart is an error), then answers with what it read."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments

    def __call__(self, messages: list[Message], tools: list[ToolSpec]) -> Any:
        results = [m for m in messages if m.role == "tool"]
        if not results or results[-1].is_error:
            return [ToolCall(id=f"c{len(results)}", name="connect", arguments=self.arguments)]
        return f"model saw: {results[-1].content}"


class Seen(RunHooks):
    """Everything the run's hooks are shown about calls and responses."""

    def __init__(self) -> None:
        self.shown: list[Any] = []

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        self.shown.append(response)

    async def tool_started(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, step: str
    ) -> None:
        self.shown.append(call)

    async def tool_finished(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, outcome: ToolOutcome, **kw: Any
    ) -> None:
        self.shown.append((call, outcome))


def stored_bytes(directory: Path) -> bytes:
    """Every file of the directory (the databases with their -wal files)."""
    return b"".join(p.read_bytes() for p in directory.iterdir() if p.is_file())


def assert_kept_out(directory: Path, *texts: str) -> None:
    """Neither secret is in the directory's files nor in any of ``texts``."""
    data = stored_bytes(directory)
    for secret in (PASSWORD, API_KEY):
        assert secret.encode() not in data
        assert not [text for text in texts if secret in text]


async def test_a_secret_nested_in_an_argument_reaches_the_tool_and_nothing_else(
    tmp_path: Path,
) -> None:
    received.clear()
    seen, capture = Seen(), SpanCapture()
    store = SqliteAuditStore(tmp_path / "audit.db")
    agent = Agent(
        "x",
        model=FunctionModel(Script(ARGUMENTS)),
        tools=[Tool(connect)],
        runtime=SqliteRuntime(str(tmp_path / "journal.db")),
        audit=AuditLog(store),
        telemetry=Telemetry(tracer_provider=capture.provider, metrics=False, capture_content=True),
        hooks=[seen],
        tuning=Tuning(checkpoint=True),
    )
    try:
        events = [e async for e in agent.stream("go", session_id="s", user_id="ana")]
        result = await agent.resume("go", session_id="s", user_id="ana")  # replays it all
        assert received == [ARGUMENTS]  # the tool got the real values, once
        # Only the secrets were learned: the host beside them is still shown to the model.
        assert result.output == "model saw: connected to dbhost1"
        [call] = [c for m in result.messages for c in m.tool_calls]
        assert call.arguments["config"].startswith("[sealed:")
        assert call.arguments["headers"].startswith("[sealed:")
        assert call.arguments["retries"] == 3
        checkpoints = await agent.list_checkpoints("s", user_id="ana")
        assert checkpoints
        assert agent.memory is not None
        episodes = await agent.memory.episodes("s", user_id="ana")
        assert episodes
        trail = (await store.query(user_id="ana")).entries
        spans = repr([(s.name, dict(s.attributes or {})) for s in capture.spans])
        assert "gen_ai.tool.call.arguments" in spans
    finally:
        await agent.aclose()
        await store.close()
    assert_kept_out(
        tmp_path,
        repr(result.messages),
        repr(events),
        repr(seen.shown),
        repr(checkpoints),
        repr(episodes),
        repr([e.payload for e in trail]),
        spans,
    )


async def test_a_deferred_approval_holds_no_nested_secret_and_runs_with_the_real_value(
    tmp_path: Path,
) -> None:
    received.clear()
    agent = Agent(
        "x",
        model=FunctionModel(Script(ARGUMENTS)),
        tools=[Tool(connect)],
        runtime=SqliteRuntime(str(tmp_path / "journal.db")),
        permissions=StandardPermissions(rules=[Rule.ask("connect")], approval="defer"),
    )
    try:
        first = await agent.run("go", session_id="s", user_id="ana")
        (request,) = await agent.pending_approvals("s", user_id="ana")
        assert request.arguments["config"]["host"] == "dbhost1"  # the approver sees the rest
        assert_kept_out(tmp_path, repr(request), repr(first))
        result = await agent.resume(
            "go", session_id="s", user_id="ana", approvals={request.request_id: "allow"}
        )
        assert received == [ARGUMENTS]  # approved in this process: the real values ran
        assert result.output == "model saw: connected to dbhost1"
    finally:
        await agent.aclose()
    assert_kept_out(tmp_path, repr(result.messages))


@pytest.mark.timeout(120)
async def test_a_run_resumed_after_a_kill_gets_sealed_arguments_lost_and_calls_again(
    tmp_path: Path,
) -> None:
    assert worker.ARGUMENTS["config"]["password"] == PASSWORD
    journal = tmp_path / "journal.db"
    stderr = tmp_path / "worker.stderr"
    with stderr.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(worker.__file__)),
            str(journal),
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    child = h.Child("worker", proc, stderr)
    try:
        # It journaled the model's call (the secret sealed) and is inside the tool.
        await child.expect("in-tool")
    finally:
        await h.kill_all([child])  # SIGKILL
    stderr.unlink()
    assert_kept_out(tmp_path)
    received.clear()
    agent = Agent(
        "x",
        model=FunctionModel(Script(worker.ARGUMENTS)),
        tools=[Tool(connect)],
        runtime=SqliteRuntime(str(journal), lease_seconds=1.0),
    )
    try:
        result = await agent.resume("go", session_id="s", user_id="ana")  # past its lease
    finally:
        await agent.aclose()
    [lost, answered] = [m for m in result.messages if m.role == "tool"]
    assert lost.is_error
    assert "the argument 'config' of this 'connect' call was sealed" in lost.content
    # The model called again with the value it still knew; that call ran.
    assert received == [worker.ARGUMENTS]
    assert answered.content == "connected to dbhost1"
    assert_kept_out(tmp_path, repr(result.messages))


def test_each_argument_that_nests_a_secret_name_is_sealed_whole() -> None:
    redactor = Redactor()
    call = ToolCall(id="c", name="connect", arguments=ARGUMENTS)
    sealer = Sealer({}, redactor)
    sealed = sealer.seal_call(call)
    assert set(sealed.arguments) == set(ARGUMENTS)
    assert sealed.arguments["config"].startswith("[sealed:")
    assert sealed.arguments["headers"].startswith("[sealed:")
    assert sealed.arguments["retries"] == 3
    assert sealer.unseal(sealed).arguments == ARGUMENTS
    # The secrets are learned (a tool that echoes one is scrubbed), their neighbours are not.
    assert redactor.text(f"{PASSWORD} {API_KEY}") == "[REDACTED] [REDACTED]"
    assert redactor.text("dbhost1 x-trace auth") == "dbhost1 x-trace auth"


@pytest.mark.parametrize(
    "value",
    [
        {"host": "db", "password": None},  # a secret name that holds nothing
        {"host": "db", "token": ""},
        [{"api_key": True}],
        {"boarding_pass": "XK7Q2PLM"},  # a doubtful name: hidden in displays, not sealed
        {"passwords_policy": {"min_length": 12}},
        [["deep", {"host": "db"}]],
    ],
)
def test_a_value_that_names_no_secret_it_holds_is_not_sealed(value: Any) -> None:
    call = ToolCall(id="c", name="connect", arguments={"config": value})
    assert Sealer({}, Redactor()).seal_call(call) is call


def test_nested_names_are_found_at_any_depth_and_follow_the_redactors_keys() -> None:
    deep: Any = {"clientSecret": "s3cr3t-value"}
    for _ in range(45):  # 91 containers deep, near the journal's limit (codec.MAX_DEPTH)
        deep = [{"level": deep}]
    call = ToolCall(id="c", name="connect", arguments={"config": deep})
    assert Sealer({}, Redactor()).seal_call(call).arguments["config"].startswith("[sealed:")
    shallow = ToolCall(id="c", name="connect", arguments={"config": {"apiToken": "plain"}})
    # A redactor told to hide no key by its words seals none by a nested name either.
    assert Sealer({}, Redactor(key_words=False, sensitive_keys=())).seal_call(shallow) is shallow


async def test_a_journal_written_with_a_nested_secret_in_clear_still_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    received.clear()

    class FailsOnce(Script):
        failed = False

        def __call__(self, messages: list[Message], tools: list[ToolSpec]) -> Any:
            if any(m.role == "tool" for m in messages) and not self.failed:
                self.failed = True
                raise ConnectionError("the model's provider went away")
            return super().__call__(messages, tools)

    def agent_with(script: Script) -> Agent:
        return Agent(
            "x",
            model=FunctionModel(script),
            tools=[Tool(connect)],
            runtime=SqliteRuntime(str(tmp_path / "journal.db")),
        )

    # Written as a release that sealed no nested name did: the values in clear.
    with monkeypatch.context() as patched:
        patched.setattr(Redactor, "seals_key", lambda self, key: False)
        first = agent_with(FailsOnce(ARGUMENTS))
        with pytest.raises(ConnectionError):
            await first.run("go", session_id="s", user_id="ana")
        await first.aclose()
    assert PASSWORD.encode() in stored_bytes(tmp_path)
    resumed = agent_with(Script(ARGUMENTS))
    try:
        result = await resumed.resume("go", session_id="s", user_id="ana")
    finally:
        await resumed.aclose()
    assert received == [ARGUMENTS]  # replayed: the tool did not run again
    assert result.output == "model saw: connected to dbhost1"
    [call] = [c for m in result.messages for c in m.tool_calls]
    assert call.arguments == ARGUMENTS


async def test_a_result_holding_a_secret_name_is_journaled_and_read_redacted(
    tmp_path: Path,
) -> None:
    # Results are not sealed by key: the value under a key naming a secret is scrubbed before
    # it is journaled, so the model reads the placeholder too (a secret is not sent to the
    # model's provider); the rest of the result is journaled and read as returned.
    token = "tok-returned-9f8e7d"

    def issue(user: str) -> dict[str, str]:
        """Issue a token."""
        return {"user": user, "token": token}

    read: list[str] = []

    def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role != "tool":
            return [ToolCall(id="c0", name="issue", arguments={"user": "ana"})]
        read.append(messages[-1].content)
        return "issued"

    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[Tool(issue)],
        runtime=SqliteRuntime(str(tmp_path / "journal.db")),
    )
    try:
        await agent.run("go", session_id="s", user_id="ana")
    finally:
        await agent.aclose()
    assert read == ['{"user":"ana","token":"[REDACTED]"}']
    assert token.encode() not in stored_bytes(tmp_path)


class _Login(BaseModel):
    host: str
    password: str


@dataclasses.dataclass(frozen=True)
class _Key:
    api_key: str


@pytest.mark.parametrize(
    "value",
    [
        _Login(host="dbhost1", password=PASSWORD),
        [_Login(host="dbhost1", password=PASSWORD)],
        {"login": _Login(host="dbhost1", password=PASSWORD)},
        _Key(api_key=PASSWORD),
        frozenset({_Key(api_key=PASSWORD)}),
    ],
    ids=["model", "model-in-list", "model-in-dict", "dataclass", "dataclass-in-set"],
)
def test_a_model_or_dataclass_holding_a_secret_field_is_sealed(value: Any) -> None:
    # The journal prints a model's or dataclass's fields by name, as it prints a dict's keys.
    call = ToolCall(id="c", name="connect", arguments={"config": value})
    redactor = Redactor()
    sealer = Sealer({}, redactor)
    sealed = sealer.seal_call(call)
    assert sealed.arguments["config"].startswith("[sealed:")
    assert PASSWORD.encode() not in codec.dumps(sealed)
    assert sealer.unseal(sealed).arguments["config"] == value
    assert redactor.text(PASSWORD) == "[REDACTED]"


@dataclasses.dataclass
class _Link:
    api_key: str
    next: Any = None


@pytest.mark.timeout(20)
def test_a_dataclass_that_holds_itself_is_refused_not_looped_over() -> None:
    # Its repr (what the secret-shape check reads) stops at the cycle; the walk must too,
    # leaving the journal's own refusal of a value that contains itself.
    link = _Link(api_key=PASSWORD)
    link.next = link
    call = ToolCall(id="c", name="connect", arguments={"config": link})
    with pytest.raises(codec.NestingTooDeepError):
        Sealer({}, Redactor()).seal_call(call)


def test_a_sealed_model_or_dataclass_has_its_values_learned_as_secrets() -> None:
    # A tool that echoes a sealed value back must have it scrubbed, as for a dict's.
    @tool(sensitive=["login"])
    def log_in(login: Any, key: Any) -> str:
        """Log in."""
        return "ok"

    redactor = Redactor()
    sealer = Sealer({"log_in": log_in}, redactor)
    login = _Login(host="dbhost1", password=PASSWORD)
    call = ToolCall(
        id="c", name="log_in", arguments={"login": login, "key": {"api_key": _Key(API_KEY)}}
    )
    sealed = sealer.seal_call(call)
    assert sealed.arguments["login"].startswith("[sealed:")
    assert sealed.arguments["key"].startswith("[sealed:")
    assert redactor.text(f"{PASSWORD} {API_KEY}") == "[REDACTED] [REDACTED]"
