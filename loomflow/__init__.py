"""loomflow: durable, governed and observable LLM agent runs."""

from __future__ import annotations

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
from .errors import LoomflowError, UserError
from .messages import Message, ModelResponse, ToolCall, Usage
from .tools import Tool, ToolOutcome, tool

__all__ = [
    "Agent",
    "AgentEvent",
    "LoomflowError",
    "Message",
    "ModelDeltaEvent",
    "ModelResponse",
    "RunContext",
    "RunFinished",
    "RunResult",
    "RunStarted",
    "Tool",
    "ToolCall",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolOutcome",
    "Tuning",
    "Usage",
    "UserError",
    "get_run_context",
    "tool",
]
__version__ = "0.1.0"
