"""Tools: Python functions a model can call, with schemas built from their signatures.

``@tool`` wraps a sync or async function in a :class:`Tool`. Its JSON schema comes from the
type hints through pydantic, its descriptions from the Google-style docstring, and a
``RunContext`` parameter is injected rather than shown to the model. :meth:`Tool.invoke`
validates the model's arguments and turns every failure into a :class:`ToolOutcome`;
:class:`ToolRegistry` maps names to tools and rejects duplicates.
"""

from __future__ import annotations

from ._outcome import INVALID_ARGUMENTS, TIMEOUT, TOOL_ERROR, UNKNOWN_TOOL, ToolOutcome
from ._registry import ToolLike, ToolRegistry, Toolset
from ._tool import Tool, as_tool, tool

__all__ = [
    "INVALID_ARGUMENTS",
    "TIMEOUT",
    "TOOL_ERROR",
    "Tool",
    "ToolLike",
    "ToolOutcome",
    "ToolRegistry",
    "Toolset",
    "UNKNOWN_TOOL",
    "as_tool",
    "tool",
]
