"""Decoding of the JSON arguments text that models stream for a tool call."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ModelError
from ._retry import MalformedStreamError

__all__ = ["parse_tool_arguments"]


def parse_tool_arguments(
    raw: str, *, provider: str, model: str, tool: str, call_id: str
) -> dict[str, Any]:
    """Decode a tool call's arguments; empty text means no arguments.

    Raises:
        ModelError: The text is not a JSON object (truncated or malformed model output).
            Guessing at a partial object would run a tool with arguments the model never
            finished writing.
    """
    if not raw.strip():
        return {}
    try:
        arguments = json.loads(raw)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        problem = (
            f"tool call {tool!r} ({call_id}) came with arguments that are not a JSON object: "
            f"{raw[:200]!r}"
        )
        # Caused by what came over the connection, not by the connection: the error metric
        # counts it as "other", as other malformed answers.
        raise ModelError(provider, model, problem) from MalformedStreamError(problem)
    return arguments
