"""loomflow: durable, governed and observable LLM agent runs."""

from __future__ import annotations

from ._ids import MAX_ID_BYTES, MAX_KEY_BYTES, check_id
from .agent import (
    Agent,
    AgentEvent,
    ModelDeltaEvent,
    RunFinished,
    RunResult,
    RunStarted,
    ToolCallFinished,
    ToolCallStarted,
    Tuning,
)
from .context import RunContext, get_run_context
from .errors import InvalidIdError, LoomflowError, UserError
from .messages import Message, ModelResponse, ToolCall, Usage
from .stores import Stores
from .tools import Tool, ToolOutcome, tool

__all__ = [
    "Agent",
    "AgentEvent",
    "InvalidIdError",
    "LoomflowError",
    "MAX_ID_BYTES",
    "MAX_KEY_BYTES",
    "Message",
    "ModelDeltaEvent",
    "ModelResponse",
    "RunContext",
    "RunFinished",
    "RunResult",
    "RunStarted",
    "Stores",
    "Tool",
    "ToolCall",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolOutcome",
    "Tuning",
    "Usage",
    "UserError",
    "check_id",
    "get_run_context",
    "tool",
]
# The one place the version is written (pyproject.toml reads it). 0.21 follows 0.20, so
# `pip install -U loomflow` from a 0.20 install picks this release up.
__version__ = "0.21.0"
