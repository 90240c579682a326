"""loomflow: durable, governed and observable LLM agent runs."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ._ids import MAX_ID_BYTES, MAX_KEY_BYTES, check_id
from .context import RunContext, get_run_context
from .errors import InvalidIdError, LoomflowError, UserError

if TYPE_CHECKING:
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
    from .messages import Message, ModelResponse, ToolCall, Usage
    from .stores import Stores
    from .tools import Tool, ToolOutcome, tool

# Names loaded on first use, so that importing a light module (``loomflow.errors``, say),
# which runs this file first, does not load the agent and everything under it (the model
# SDKs, the stores, telemetry): about 90 modules of this package.
_LAZY = {
    "Agent": ".agent",
    "AgentEvent": ".agent",
    "Message": ".messages",
    "ModelDeltaEvent": ".agent",
    "ModelResponse": ".messages",
    "RunFinished": ".agent",
    "RunResult": ".agent",
    "RunStarted": ".agent",
    "Stores": ".stores",
    "Tool": ".tools",
    "ToolCall": ".messages",
    "ToolCallFinished": ".agent",
    "ToolCallStarted": ".agent",
    "ToolOutcome": ".tools",
    "Tuning": ".agent",
    "Usage": ".messages",
    "tool": ".tools",
}

# A library leaves logging to the application: without this, a warning of ours reaches stderr
# through Python's last-resort handler in a program that configured no logging at all.
logging.getLogger("loomflow").addHandler(logging.NullHandler())

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
