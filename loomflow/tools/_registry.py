"""A name-to-tool mapping that refuses ambiguity."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

from ..errors import UserError
from ._outcome import UNKNOWN_TOOL, ToolOutcome
from ._tool import Tool, as_tool

__all__ = ["ToolLike", "ToolRegistry", "Toolset"]

ToolLike: TypeAlias = Tool[..., Any] | Callable[..., Any]
"""A :class:`Tool` or a plain function that :func:`as_tool` can wrap."""


class ToolRegistry(Mapping[str, Tool[..., Any]]):
    """The tools an agent offers, by name.

    Plain functions are wrapped with :func:`as_tool`. Two different tools with one name are
    rejected, because the model could not tell them apart; adding the very same tool twice
    is harmless and ignored.

    Example:
        >>> registry = ToolRegistry([get_weather, send_email])
        >>> outcome = await registry.invoke("get_weather", {"city": "Oslo"})
    """

    def __init__(self, tools: Iterable[ToolLike] = ()) -> None:
        """Register ``tools`` in order.

        Raises:
            UserError: on a duplicate name or an object that cannot be a tool.
        """
        self._tools: dict[str, Tool[..., Any]] = {}
        for item in tools:
            self.add(item)

    def add(self, item: ToolLike) -> Tool[..., Any]:
        """Register one tool or function and return the :class:`Tool` stored.

        Raises:
            UserError: when another tool already uses the name.
        """
        new = as_tool(item)
        existing = self._tools.get(new.name)
        if existing is new:
            return new
        if existing is not None and existing.fn is new.fn:
            raise UserError(
                f"the function behind tool {new.name!r} ({_origin(new)}) is registered twice; "
                "register it once"
            )
        if existing is not None:
            raise UserError(
                f"two tools are named {new.name!r} ({_origin(existing)} and {_origin(new)}); "
                "give one of them another name with @tool(name=...)"
            )
        self._tools[new.name] = new
        return new

    def __getitem__(self, name: str) -> Tool[..., Any]:
        return self._tools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"ToolRegistry({list(self._tools)!r})"

    def specs(self) -> list[dict[str, Any]]:
        """Every tool's :meth:`Tool.spec`, in registration order."""
        return [t.spec() for t in self._tools.values()]

    async def invoke(self, name: str, arguments: Mapping[str, Any] | None) -> ToolOutcome:
        """Run the tool called ``name``; an unknown name is an ``"unknown_tool"`` outcome.

        Models do invent tool names; that is reported back to them, never raised.
        """
        found = self._tools.get(name)
        if found is None:
            available = ", ".join(self._tools) or "none"
            return ToolOutcome(
                ok=False,
                error_type=UNKNOWN_TOOL,
                error=f"there is no tool named {name!r} (available tools: {available})",
            )
        return await found.invoke(arguments)


Toolset = ToolRegistry
"""Alias of :class:`ToolRegistry`."""


def _origin(t: Tool[..., Any]) -> str:
    fn = t.fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{qualname}" if module else qualname
