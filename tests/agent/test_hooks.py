"""Hooks see live work before it happens and every call after it, replayed ones included."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from loomflow.agent import Agent
from loomflow.agent.hooks import Interrupt, RunHooks, RunInfo
from loomflow.messages import Message, ModelResponse, ModelSettings, ToolCall, ToolSpec
from loomflow.models import FunctionModel
from loomflow.runtime import InMemoryRuntime
from loomflow.tools import Tool, ToolOutcome, tool


class Noted(BaseModel):
    what: str


class Recorder(RunHooks):
    def __init__(self, *, deny: str | None = None, stop_at_turn: int | None = None) -> None:
        self.deny = deny
        self.stop_at_turn = stop_at_turn
        self.log: list[tuple[str, Any]] = []

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        if turn == self.stop_at_turn:
            raise Interrupt("budget:tokens", "cap reached")
        self.log.append(("before_model", turn))
        return f"token-{turn}"

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        self.log.append(("after_model", (turn, replayed, token)))

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        self.log.append(("before_tool", call.name))
        info.emit(Noted(what=f"checked {call.name}"))
        if call.name == self.deny:
            return ToolOutcome(ok=False, error_type="permission_denied", error="not allowed")
        return call

    async def after_tool_call(
        self,
        info: RunInfo,
        turn: int,
        slot: int,
        call: ToolCall,
        outcome: ToolOutcome,
        *,
        replayed: bool,
    ) -> None:
        self.log.append(("after_tool", (call.name, outcome.ok, replayed)))

    async def on_event(self, info: RunInfo, event: BaseModel) -> None:
        self.log.append(("event", event))


ran: list[str] = []


@tool
def delete_all() -> str:
    """Dangerous."""
    ran.append("delete_all")
    return "deleted"


def decide(messages: list[Message], tools: list[ToolSpec]) -> Any:
    if messages[-1].role == "tool":
        return f"result: {messages[-1].content}"
    return [ToolCall(id="1", name="delete_all", arguments={})]


async def test_a_denial_reaches_the_model_and_the_run_goes_on() -> None:
    ran.clear()
    hooks = Recorder(deny="delete_all")
    agent = Agent("x", model=FunctionModel(decide), tools=[delete_all], hooks=[hooks])
    events = [e async for e in agent.stream("go")]
    result = events[-1].result  # type: ignore[union-attr]
    assert ran == []
    assert result.output == "result: Error: not allowed"
    assert not result.interrupted
    assert any(isinstance(e, Noted) for e in events)
    assert ("event", Noted(what="checked delete_all")) in hooks.log


async def test_an_interrupt_returns_an_interrupted_result() -> None:
    hooks = Recorder(stop_at_turn=1)
    agent = Agent(
        "x",
        model=FunctionModel(decide),
        tools=[delete_all],
        hooks=[hooks],
        runtime=InMemoryRuntime(),
    )
    result = await agent.run("go", session_id="s")
    assert result.interrupted
    assert result.interruption_reason == "budget:tokens"
    assert result.turns == 1
    # An interrupted run returned: the next run on the session is a new one.
    again = await agent.run("go", session_id="s")
    assert again.replayed_steps == 0


async def test_replayed_calls_skip_live_hooks_but_are_reported() -> None:
    ran.clear()
    runtime = InMemoryRuntime()
    first = Recorder()
    agent = Agent(
        "x", model=FunctionModel(decide), tools=[delete_all], hooks=[first], runtime=runtime
    )
    await agent.run("go", session_id="s")
    second = Recorder()
    replaying = Agent(
        "x", model=FunctionModel(decide), tools=[delete_all], hooks=[second], runtime=runtime
    )
    await replaying.resume("go", session_id="s")
    assert ran == ["delete_all"]
    kinds = [kind for kind, _ in second.log]
    assert "before_model" not in kinds
    assert "before_tool" not in kinds
    assert ("after_model", (0, True, None)) in second.log
    assert ("after_tool", ("delete_all", True, True)) in second.log
    assert ("after_model", (0, False, "token-0")) in first.log


def test_components_must_be_hooks() -> None:
    from loomflow.errors import UserError

    with pytest.raises(UserError, match="RunHooks"):
        Agent("x", model="scripted", budget=object())


class BlockOutput(RunHooks):
    async def check_output(self, info: RunInfo, text: str) -> str:
        raise Interrupt("guardrail:secrets", "answer held a secret")


async def test_a_blocked_answer_never_leaves_the_run() -> None:
    agent = Agent("x", model=ScriptedModelFor("the password is hunter22"), hooks=[BlockOutput()])
    result = await agent.run("tell me")
    assert result.interrupted
    assert result.interruption_reason == "guardrail:secrets"
    assert result.output == ""
    assert all("hunter22" not in m.content for m in result.messages)


def ScriptedModelFor(text: str) -> Any:
    from loomflow.models import ScriptedModel

    return ScriptedModel([text])


@tool(sensitive=["password"])
def sign_in(user: str, password: str) -> str:
    """Sign in."""
    ran.append(f"{user}:{password}")
    return f"{user} signed in"


class Renamer(RunHooks):
    """Edits one argument of the call it is given (as an approver's edit does), and notes the
    call the tool_started hooks are shown."""

    def __init__(self) -> None:
        self.started: list[ToolCall] = []

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        return call.model_copy(update={"arguments": {**call.arguments, "user": "alice"}})

    async def tool_started(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, step: str
    ) -> None:
        self.started.append(call)


async def test_tool_started_shows_an_edited_call_with_its_sensitive_arguments_sealed() -> None:
    ran.clear()

    def sign(messages: list[Message], tools: list[ToolSpec]) -> Any:
        if messages[-1].role == "tool":
            return "done"
        return [ToolCall(id="1", name="sign_in", arguments={"user": "bob", "password": "hunter2"})]

    hooks = Renamer()
    agent = Agent("x", model=FunctionModel(sign), tools=[sign_in], hooks=[hooks])
    await agent.run("sign in")
    assert ran == ["alice:hunter2"]  # the tool ran with the edit and the real value
    (started,) = hooks.started
    assert started.arguments["user"] == "alice"  # the call as it runs: the edit
    assert "hunter2" not in repr(started)  # its secret sealed, as in every other hook's call


async def test_each_live_response_is_priced_once_for_the_run_and_its_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import loomflow.hooks as hooks_module

    priced: list[ModelResponse] = []
    real = hooks_module.cost_usd

    def counting(*args: Any, **kwargs: Any) -> float | None:
        priced.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(hooks_module, "cost_usd", counting)
    seen: list[float | None] = []

    class Pricing(RunHooks):
        async def after_model_call(
            self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
        ) -> None:
            seen.append(info.cost_usd(response))

    ran.clear()
    agent = Agent("x", model=FunctionModel(decide), tools=[delete_all], hooks=[Pricing()])
    result = await agent.run("go")
    assert result.turns == 2
    # The run, the telemetry and the hook price each response; the table is asked once.
    assert len(priced) == 2
    assert seen == [0.0, 0.0]


def test_a_run_info_prices_a_response_again_under_another_table() -> None:
    from loomflow.context import RunContext
    from loomflow.messages import Usage
    from loomflow.models.pricing import ModelPrice

    info = RunInfo(
        ctx=RunContext(), agent_name="a", model_name="gpt-x", provider="openai", backend="none",
        prompt="p",
    )  # fmt: skip
    response = ModelResponse(text="hi", usage=Usage(input_tokens=1_000_000))
    assert info.cost_usd(response) is None  # no table knows the model
    info.prices = {"gpt-x": ModelPrice(input_per_mtok=2.0, output_per_mtok=0.0)}
    assert info.cost_usd(response) == 2.0
    assert info.cost_usd(ModelResponse(text="hi", usage=Usage(input_tokens=500_000))) == 1.0
