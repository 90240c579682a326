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

__all__ = ["tool_step", "tool_step_name"]

# Where a tool call's arguments sit in its step's inputs, [[name, arguments], {}]: one list
# deeper than in the [name, arguments] its name hashes.
_ARGUMENTS_DEPTH = 2


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


def tool_step(turn: int, slot: int, call: _Call) -> tuple[str, Mapping[str, Any]]:
    """The journal name of a tool call, and its arguments as its step is given them.

    The name hashes the canonical text of ``[name, arguments]`` and the step's fingerprint
    that of ``[[name, arguments], {}]``: the same text of the arguments, printed here once
    for both (see :class:`~loomflow.runtime.codec.Printed`). Arguments without a text at the
    fingerprint's depth are left to be refused where they were before.
    """
    arguments, raw = codec.printed(call.arguments, _ARGUMENTS_DEPTH)
    if raw is None:
        return tool_step_name(turn, slot, call), call.arguments
    digest = hashlib.sha256(b"[" + codec.canonical_bytes(call.name) + b"," + raw + b"]")
    return f"tool_call_{turn}_{slot}_{digest.hexdigest()[:16]}", arguments
