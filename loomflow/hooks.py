"""The run-hook contract: how governance, audit and telemetry plug into the agent loop.

This module is a base layer. The agent calls hooks, and governance, audit and telemetry
implement them, so all four stand on it and none needs another to know the contract
(``loomflow.agent.hooks`` re-exports it). See ``docs/concepts/architecture.md``.

The loop calls every :class:`RunHooks` given to the agent at fixed points. Some points happen
only for *live* work (a model call or tool call that really runs), never for results replayed
from the journal: that is where budgets reserve, permissions check and guardrails inspect tool
results. Other points see both, with ``replayed`` saying which (audit and telemetry).

A hook stops a run by raising :class:`Interrupt`; the run then *returns* an interrupted
``RunResult`` with that reason (so its epoch advances like any finished run). A hook reports
something to the stream (and so to the other hooks) with ``info.emit(event)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, runtime_checkable

from pydantic import BaseModel

from .context import RunContext
from .errors import _rebuild
from .messages import Message, ModelResponse, ModelSettings, ToolCall
from .models.pricing import ModelPrice, cost_usd
from .redaction import Redactor
from .runtime import Runtime
from .tools import Tool, ToolOutcome

__all__ = ["HookProvider", "Interrupt", "RunHooks", "RunInfo", "RunPlugin"]


class Interrupt(Exception):
    """Raised by a hook to end the run with ``interrupted=True`` and ``reason``.

    Reasons are ``budget:<cap>`` or ``guardrail:<name>``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)

    def __reduce__(self) -> tuple[object, ...]:  # args holds the joined message, not the fields
        return (_rebuild, (type(self), self.args, self.__dict__))


@dataclass(slots=True)
class RunInfo:
    """What hooks know about the run in progress."""

    ctx: RunContext
    agent_name: str
    model_name: str
    provider: str
    backend: str
    prompt: str
    epoch: int | None = None
    resumed: bool = False
    tools: Mapping[str, Tool[..., Any]] = field(default_factory=dict)
    # The journal the run's steps go to (the enclosing run's, for an agent inside another
    # run): audit and telemetry observe its steps. ``None`` only where no agent built this.
    runtime: Runtime | None = None
    # The agent's redactor: what hooks that store or export text scrub it with.
    redactor: Redactor | None = None
    # The price table the run's model calls are charged at (the budget's, if it has one;
    # ``None``: the list prices).
    prices: Mapping[str, ModelPrice] | None = None
    _emit: Callable[[BaseModel], None] = field(default=lambda _e: None, repr=False)
    # For a replayed model call, while its after_model_call hooks run: the messages and
    # settings it was made with (a live call's hooks had them in before_model_call), so a
    # budget counts it toward the run's caps as it counted when it ran. ``None`` otherwise.
    _replayed_request: tuple[list[Message], ModelSettings] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # The last response priced, with its table and cost: the run, the telemetry, the audit
    # log and a budget each price every live response, the same way (responses are values).
    _priced: tuple[Any, Any, float | None] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def run_id(self) -> str:
        return self.ctx.run_id or ""

    @property
    def session_id(self) -> str:
        return self.ctx.session_id or ""

    @property
    def user_id(self) -> str | None:
        return self.ctx.user_id

    def cost_usd(self, response: ModelResponse) -> float | None:
        """What ``response`` cost in USD, priced as the budget charges it (see
        :func:`~loomflow.models.pricing.price_for`), or ``None`` when no table knows the model.
        """
        priced = self._priced
        if priced is not None and priced[0] is response and priced[1] is self.prices:
            return priced[2]
        cost = cost_usd(
            self.model_name,
            response.usage,
            provider=self.provider,
            prices=self.prices,
            reported=response.model,
        )
        self._priced = (response, self.prices, cost)
        return cost

    def emit(self, event: BaseModel) -> None:
        """Put ``event`` in the run's event stream; every hook's ``on_event`` sees it."""
        self._emit(event)


class RunHooks:
    """Base class of loop hooks: every method is a no-op to override."""

    async def run_started(self, info: RunInfo) -> None:
        """The run holds its turn; nothing has been called yet."""

    async def check_input(self, info: RunInfo, prompt: str) -> str:
        """Inspect (and possibly rewrite) the user's prompt, or raise :class:`Interrupt`."""
        return prompt

    async def check_history(self, info: RunInfo, messages: list[Message]) -> list[Message]:
        """Inspect (and possibly rewrite) the messages the caller put before the prompt (a
        team worker's earlier tasks and answers), or raise :class:`Interrupt`. Called again,
        apart, with the messages memory recalled from the session's earlier runs, when there
        are any. Called with the same messages on a replay, so a rewrite must depend on them
        alone."""
        return messages

    async def before_model_call(
        self, info: RunInfo, turn: int, messages: list[Message], settings: ModelSettings
    ) -> Any:
        """Live model calls only, right before the provider is called.

        Returns a token handed back to :meth:`after_model_call` or :meth:`model_call_failed`
        (a budget reservation, say). Raise :class:`Interrupt` to refuse the call.
        """
        return None

    async def model_call_failed(
        self, info: RunInfo, turn: int, error: BaseException, token: Any
    ) -> None:
        """A live model call raised (or its stream was abandoned)."""

    async def model_first_chunk(self, info: RunInfo, turn: int, *, token: Any) -> None:
        """Live model calls that stream only: the first text or tool-call delta arrived (the
        time to first chunk ends here). A model that answers in one piece never calls it."""

    async def model_call_finished(
        self, info: RunInfo, turn: int, response: ModelResponse, *, token: Any
    ) -> None:
        """Live model calls only: the whole response arrived, and is about to be journaled.
        :meth:`after_model_call` follows once it is."""

    async def after_model_call(
        self, info: RunInfo, turn: int, response: ModelResponse, *, replayed: bool, token: Any
    ) -> None:
        """Every model call, live or replayed (``token`` is ``None`` when replayed)."""

    async def before_tool_call(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, tool: Tool[..., Any] | None
    ) -> ToolCall | ToolOutcome:
        """Live tool calls only. Return the call (maybe with edited arguments) to run it, or
        a ``ToolOutcome`` to answer instead (a denial reaches the model as a tool error)."""
        return call

    async def tool_started(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, step: str
    ) -> None:
        """Live tool calls only: every ``before_tool_call`` let the call through and the tool
        body is about to run (``step`` is the call's journal step name). ``call`` is the one a
        ``before_tool_call`` put in the model's call's place (an approver's edit), else the
        model's call; either way with its sensitive arguments sealed. Raising here keeps the
        tool from running."""

    async def check_tool_result(
        self, info: RunInfo, turn: int, slot: int, call: ToolCall, outcome: ToolOutcome
    ) -> ToolOutcome:
        """Live tool results only, before they are journaled: inspect, redact, or interrupt."""
        return outcome

    async def tool_finished(
        self,
        info: RunInfo,
        turn: int,
        slot: int,
        call: ToolCall,
        outcome: ToolOutcome,
        *,
        step: str,
        executed: bool,
    ) -> None:
        """Live tool calls only: the final outcome (checked, scrubbed and sealed), *before* it
        is journaled. ``executed`` is ``False`` when a hook answered instead of the tool.
        Raising here leaves the call unjournaled, so a resumed run runs it again."""

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
        """Every tool call, live or replayed."""

    async def check_output(self, info: RunInfo, text: str) -> str:
        """Inspect (and possibly rewrite) the final answer, or raise :class:`Interrupt`."""
        return text

    async def on_event(self, info: RunInfo, event: BaseModel) -> None:
        """An event another hook emitted (budget warning, permission decision, ...)."""

    async def run_finished(
        self, info: RunInfo, result: Any | None, error: BaseException | None
    ) -> None:
        """The run returned ``result`` (a ``RunResult``) or raised ``error``.

        Every hook hears of the run's end once: when one fails here on a run that returned,
        the run raises that failure, and the hooks after it are told of it as ``error``.
        """


@runtime_checkable
class HookProvider(Protocol):
    """A component that plugs into the agent loop through the hooks it returns.

    ``StandardBudget``, ``PermissionPolicy``, ``AuditLog``, ``Telemetry`` and the guardrails
    are providers; the agent calls ``as_hooks()`` once, when it is built.
    """

    def as_hooks(self) -> RunHooks:
        """The hooks the loop calls for this component."""
        ...


RunPlugin: TypeAlias = RunHooks | HookProvider
"""What ``Agent(budget=, permissions=, audit=, telemetry=, guardrails=)`` accepts."""
