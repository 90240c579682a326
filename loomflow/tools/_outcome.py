"""The result of invoking a tool, as the agent loop, the journal and the model see it."""

from __future__ import annotations

import contextlib
from typing import Any, Final

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticSerializationError, to_json

from .._json import json_safe
from ..runtime import codec
from ..runtime.codec import register_type

__all__ = ["INVALID_ARGUMENTS", "TIMEOUT", "TOOL_ERROR", "UNKNOWN_TOOL", "ToolOutcome"]

INVALID_ARGUMENTS: Final = "invalid_arguments"
"""The arguments did not match the tool's parameters; the tool did not run."""
TOOL_ERROR: Final = "tool_error"
"""The tool raised, or returned a value the journal cannot store."""
TIMEOUT: Final = "timeout"
"""The tool ran past its ``timeout``."""
UNKNOWN_TOOL: Final = "unknown_tool"
"""The model asked for a tool name that is not registered."""


class ToolOutcome(BaseModel):
    """What one tool call produced: a value, or an error the model can read.

    Attributes:
        ok: ``True`` when the tool returned normally.
        value: The returned value (JSON-like data or a pydantic model) when ``ok``.
        error: A one-line explanation when not ``ok``.
        error_type: ``"invalid_arguments"``, ``"tool_error"``, ``"timeout"`` or
            ``"unknown_tool"`` when not ``ok``.
    """

    model_config = ConfigDict(frozen=True)

    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None

    def as_text(self) -> str:
        """Render the outcome as the text of a tool result message.

        Example:
            >>> ToolOutcome(ok=True, value={"temp": 21}).as_text()
            '{"temp":21}'
            >>> ToolOutcome(ok=False, error="city is unknown", error_type="tool_error").as_text()
            'Error: city is unknown'
        """
        if not self.ok:
            return f"Error: {self.error or self.error_type or 'the tool failed'}"
        value = self.value
        # What a replay of the journaled result renders too: sets and dicts with keys that
        # are not strings in a fixed order, enums as values, models as fields. A value with
        # no encoding was never journaled (there is no journal): rendered as it is.
        if type(value) is not str:
            with contextlib.suppress(codec.UnsupportedValueError):
                value = codec.plain(value)
        if isinstance(value, str):
            return value
        # pydantic's serializer knows datetimes, UUIDs, decimals and bytes; `fallback=str`
        # keeps a stray unknown object from turning a result into a crash, and "strings" keeps
        # NaN/Infinity valid JSON.
        try:
            raw = to_json(value, fallback=str, inf_nan_mode="strings")
        except PydanticSerializationError:
            try:  # bytes that are not UTF-8: base64 them
                raw = to_json(value, fallback=str, inf_nan_mode="strings", bytes_mode="base64")
            except PydanticSerializationError:  # text with a lone surrogate
                raw = to_json(json_safe(value), inf_nan_mode="strings")
        return raw.decode()


# The journal stores a model's class path and looks it up on decode; pin it to the public
# package so that reorganising private modules never orphans journaled tool results.
ToolOutcome.__module__ = "loomflow.tools"
register_type(ToolOutcome)  # every tool call's result is journaled as one
