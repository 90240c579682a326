"""The agent layer: a ReAct loop on the journaled runtime, and architectures built from it."""

from __future__ import annotations

from ..checkpoints import CheckpointRestored, CheckpointSaved
from ._agent import Agent
from ._types import (
    AgentEvent,
    ModelDeltaEvent,
    RunFinished,
    RunResult,
    RunStarted,
    ToolCallFinished,
    ToolCallStarted,
    Tuning,
)

__all__ = [
    "Agent",
    "AgentEvent",
    "CheckpointRestored",
    "CheckpointSaved",
    "ModelDeltaEvent",
    "RunFinished",
    "RunResult",
    "RunStarted",
    "ToolCallFinished",
    "ToolCallStarted",
    "Tuning",
]
