"""Decoding of the JSON arguments text that models stream for a tool call."""

from __future__ import annotations

import json
from typing import Any, Final

from ..errors import ModelError
from ._retry import MalformedStreamError

__all__ = ["MAX_ARGUMENT_DEPTH", "parse_tool_arguments", "tool_call_name"]

MAX_ARGUMENT_DEPTH: Final = 64
"""How many containers deep a tool call's arguments may nest. Well inside the journal's
``codec.MAX_DEPTH``, which must also hold the response around them: deeper arguments would
end the run in the journal (or in a RecursionError) after the call was paid for."""


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are not JSON, and NaN compares false to everything: a rule such as
    # args={"amount": lambda v: v > 1000} would let it through.
    raise ValueError(f"{name} is not a JSON value")


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests more than :data:`MAX_ARGUMENT_DEPTH` containers (iteratively:
    a recursive walk is what must not be needed)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_ARGUMENT_DEPTH:
            return True
        children = item.values() if isinstance(item, dict) else item
        pending.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_tool_arguments(
    raw: str, *, provider: str, model: str, tool: str, call_id: str, cut: bool = False
) -> dict[str, Any]:
    """Decode a tool call's arguments; empty text means no arguments. ``cut``: the response
    ended at its output limit, which the error then names as the likely cause.

    Raises:
        ModelError: The text is not a JSON object (truncated or malformed model output, or
            NaN/Infinity, which JSON does not have), or it nests more than
            :data:`MAX_ARGUMENT_DEPTH` deep. Guessing at a partial object would run a tool
            with arguments the model never finished writing.
    """
    if not raw.strip():
        return {}
    problem = "arguments that are not a JSON object"
    try:
        arguments: object = json.loads(raw, parse_constant=_refuse_constant)
    except ValueError:
        arguments = None
    except RecursionError:  # nested deeper than the json module can read
        arguments, problem = None, f"arguments nested more than {MAX_ARGUMENT_DEPTH} levels deep"
    if isinstance(arguments, dict):
        if not _too_deep(arguments):
            return arguments
        problem = f"arguments nested more than {MAX_ARGUMENT_DEPTH} levels deep"
    problem = f"tool call {tool!r} ({call_id}) came with {problem}: {raw[:200]!r}"
    if cut:
        # Not the model's JSON at fault: a long input (a file to write) outgrew the limit.
        problem += " (the response was cut off at its output limit: raise ModelSettings.max_tokens)"
    # Caused by what came over the connection, not by the connection: the error metric
    # counts it as "other", as other malformed answers.
    raise ModelError(provider, model, problem) from MalformedStreamError(problem)


def tool_call_name(name: str, *, provider: str, model: str, call_id: str) -> str:
    """A tool call's name, which must be there: a call without one named no tool to run.

    Raises:
        ModelError: The name is empty (or only spaces). Taken as given, it was a call to the
            tool ``''``, which reached the permission checks and the audit trail as such.
    """
    if name.strip():
        return name
    problem = f"tool call {call_id or '(no id)'} came without a tool name: {name!r}"
    raise ModelError(provider, model, problem) from MalformedStreamError(problem)
