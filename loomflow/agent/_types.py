"""What a run returns and streams, and how it is tuned."""

from __future__ import annotations

import difflib
from typing import Any, Generic, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from typing_extensions import TypeVar

from ..checkpoints import CheckpointRestored, CheckpointSaved
from ..errors import ConfigurationError
from ..governance.approvals import PendingApproval
from ..messages import Message, TextDelta, ToolCall, ToolCallDelta
from ..tools import ToolOutcome

__all__ = [
    "AgentEvent",
    "ModelDeltaEvent",
    "RunFinished",
    "RunResult",
    "RunStarted",
    "ToolCallFinished",
    "ToolCallStarted",
    "Tuning",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


OutputT = TypeVar("OutputT", default=Any)
"""The type of ``RunResult.parsed``: the run's ``output_type`` (``Any`` when unnamed)."""


class Tuning(_Frozen):
    """Knobs of the agent loop that are not part of the agent's identity.

    Attributes:
        strict_replay: Raise ``ReplayDivergenceError`` when a resumed run reaches a journaled
            step with other inputs, instead of running it fresh.
        checkpoint: Write a transcript snapshot after every pass of the loop, and let
            ``resume()`` restore the newest one (see the checkpoints docs).
        checkpoint_retention: Snapshots kept per (session, user), newest first; ``None``
            keeps them all.
        parallel_tools: Run the tool calls of one model turn concurrently.
        tool_timeout: Seconds a tool may take when it sets no timeout of its own.
        max_tokens: Output-token cap of each model call.
        temperature: Sampling temperature; ``None`` keeps the provider's default.
    """

    strict_replay: bool | None = None
    checkpoint: bool = False
    # At most what a store's 64-bit OFFSET takes: refused here, not at a run's first snapshot.
    checkpoint_retention: int | None = Field(default=10, ge=1, le=2**63 - 1)
    parallel_tools: bool = True
    tool_timeout: float | None = Field(default=None, gt=0)
    max_tokens: int = Field(default=1024, gt=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)

    def __init__(self, **knobs: Any) -> None:
        # A typed error like Settings' (a ValueError still): pydantic's names the model's
        # internals and a mistyped knob without the one that was meant.
        try:
            super().__init__(**knobs)
        except ValidationError as exc:
            raise ConfigurationError(_bad_tuning(exc)) from None


# Loop settings that Agent() takes itself, and that are easily looked for in Tuning.
_AGENT_KNOBS = ("max_turns", "output_retries")


def _bad_tuning(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        knob = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            names = [*Tuning.model_fields, *_AGENT_KNOBS]
            close = difflib.get_close_matches(knob, names, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            if close and close[0] in _AGENT_KNOBS:
                hint = f" ({close[0]} is an argument of Agent(), not of Tuning)"
            problems.append(f"Tuning has no knob {knob!r}{hint}")
        else:
            problems.append(f"{knob}: {' '.join(error['msg'].split())}")
    return "bad Tuning: " + "; ".join(problems)


class RunResult(_Frozen, Generic[OutputT]):
    """The outcome of one ``agent.run()`` (or the last event of ``agent.stream()``).

    Attributes:
        output: The model's final text (the last text seen when the run was interrupted).
        turns: Model calls made by the run, replayed ones included.
        tokens_in: Input tokens over all model calls of the run, replayed ones included.
        tokens_out: Output tokens over all model calls of the run.
        cost_usd: Estimated cost of those calls (0 for models with no known price).
        session_id: The session the run belongs to (generated when none was given).
        run_id: This run's ULID.
        interrupted: Whether the run stopped before a final answer.
        interruption_reason: ``max_turns``, ``budget:<cap>``, ``guardrail:<name>``, or
            ``approval`` when tool calls wait for a person (``approval="defer"``).
        messages: The full transcript, system prompt first.
        replayed_steps: Journaled steps answered from the journal in this run.
        fresh_steps: Journaled steps executed in this run.
        restored_from: The checkpoint this run restored instead of replaying, if any.
        parsed: The final answer validated into the run's ``output_type`` (an instance of
            it); ``None`` without an ``output_type`` or when the run was interrupted.
        pending_approvals: With ``interruption_reason="approval"``, the tool calls waiting
            for a decision (pass their ``request_id`` to ``agent.resume(approvals=...)``).
    """

    output: str
    turns: int
    tokens_in: int
    tokens_out: int
    cost_usd: float
    session_id: str
    run_id: str
    interrupted: bool = False
    interruption_reason: str | None = None
    messages: list[Message] = Field(default_factory=list)
    replayed_steps: int = 0
    fresh_steps: int = 0
    restored_from: str | None = None
    parsed: OutputT | None = None
    pending_approvals: list[PendingApproval] = Field(default_factory=list)


class RunStarted(_Frozen):
    """The run has its ids and holds its (session, user) turn."""

    type: Literal["run_started"] = "run_started"
    run_id: str
    session_id: str
    user_id: str | None


class ModelDeltaEvent(_Frozen):
    """A piece of the model's answer as it streams (replayed calls stream from the journal)."""

    type: Literal["model_delta"] = "model_delta"
    turn: int
    delta: TextDelta | ToolCallDelta
    replayed: bool


class ToolCallStarted(_Frozen):
    """The model asked for a tool call."""

    type: Literal["tool_call_started"] = "tool_call_started"
    turn: int
    slot: int
    call: ToolCall


class ToolCallFinished(_Frozen):
    """A tool call has its outcome (``replayed`` when it came from the journal)."""

    type: Literal["tool_call_finished"] = "tool_call_finished"
    turn: int
    slot: int
    call: ToolCall
    outcome: ToolOutcome
    replayed: bool


class RunFinished(_Frozen):
    """The last event of every stream: the run's result."""

    type: Literal["run_finished"] = "run_finished"
    result: RunResult


AgentEvent: TypeAlias = (
    RunStarted
    | ModelDeltaEvent
    | ToolCallStarted
    | ToolCallFinished
    | CheckpointSaved
    | CheckpointRestored
    | RunFinished
)
