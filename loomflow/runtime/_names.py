"""Journal names of the agent's tool steps, kept here because the journal itself needs them.

The agent names each tool call's step; importing a 0.20 journal re-keys its tool steps the
same way (``_legacy``). The name is part of the journal key, so it lives below both, where
the runtime can use it without importing the agent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Protocol

from . import codec

__all__ = ["tool_step_name"]


class _Call(Protocol):
    """What names a tool call's step (a ``loomflow.messages.ToolCall``)."""

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> Mapping[str, Any]: ...


def tool_step_name(turn: int, slot: int, call: _Call) -> str:
    """The journal name of a tool call: position plus a hash of tool name and arguments."""
    digest = hashlib.sha256(codec.canonical_bytes([call.name, call.arguments])).hexdigest()
    return f"tool_call_{turn}_{slot}_{digest[:16]}"
